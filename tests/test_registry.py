"""Every registered op implementation meets its contract (fidelity.testing), and the contracts can fail."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import find, settings

from fidelity.decoders.production import faults, ops
from fidelity.decoders.production.registry import REGISTRY, forcing, implementation, selections
from fidelity.decoders.profiles import CHOICES, get_profile
from fidelity.model.formats import dequantize_fp8, fake_quant_fp8, hadamard
from fidelity.testing import Case, check_against_oracle, check_case, contract_of, strategy_of

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

MAX_EXAMPLES = 30
BF16 = torch.bfloat16

KNOWN_DEVIATIONS: dict = {}  # (op, impl) -> narrowed input strategy, for a documented deviation from the spec
PAIRS = [(op, impl) for op, impls in sorted(REGISTRY.items()) for impl in sorted(impls)]


@pytest.mark.parametrize(("op", "impl"), PAIRS, ids=[f"{op}[{impl}]" for op, impl in PAIRS])
def test_registered_implementation_meets_its_contract(op, impl):
    device = None if impl == "cpu" else "cuda"  # GPU kernels get their inputs on the GPU
    if device and not torch.cuda.is_available():
        pytest.skip(f"{impl} implementation needs a CUDA device")
    check_against_oracle(op, REGISTRY[op][impl], max_examples=MAX_EXAMPLES, device=device,
                         strategy=KNOWN_DEVIATIONS.get((op, impl)))


def test_every_registered_op_has_a_contract():
    from fidelity.decoders.production.registry import OPS

    assert sorted(set(REGISTRY) - set(OPS)) == []
    for name in OPS:
        contract = contract_of(name)
        assert contract.kind in ("tolerance", "bitexact") and contract.why, name
        assert all(o.tolerance is None or o.tolerance.why for o in contract.outputs), name


@pytest.mark.parametrize("op", ["kv_round", "kv_norm_rope_fp8"])
def test_the_ops_taking_kv_scale_floor_draw_every_choice_of_that_profile_field(op):
    """The strategies of the ops that take the profile field ``kv_scale_floor`` draw each of its choices; the
    profile fields a drawn case sets (``kv_nope`` as ``fmt``, ``kv_scale_floor``) make a profile that the
    profiles' validation accepts, and the emulation meets the op's contract on that case."""
    for floor in CHOICES["kv_scale_floor"]:
        case = find(strategy_of(op), lambda c, floor=floor: c["scale_floor"] == floor,
                    settings=settings(database=None, derandomize=True, max_examples=200))
        profile = get_profile(f"reference:kv_nope={case['fmt']},kv_scale_floor={case['scale_floor']}")
        assert profile.kv_scale_floor == floor
        check_case(op, getattr(ops, op), case)


def test_every_op_record_has_its_parts():
    """One record per op: emulation, kernel (run and takes, route where named; None for an op without one),
    contract and strategy (named attributes of ``fidelity.testing.contracts`` / ``fidelity.testing.strategies``)."""
    pytest.importorskip("triton")
    from fidelity.decoders.production.registry import OPS, kernel_functions
    from fidelity.testing import OpContract, contracts, strategies

    for name, op in OPS.items():
        assert callable(op.emulation), name
        if op.kernel is not None:
            run, takes, route = kernel_functions(name)
            assert callable(run) and callable(takes) and (op.kernel.route is None or callable(route)), name
        assert isinstance(getattr(contracts, op.contract, None), OpContract), (name, op.contract)
        assert callable(getattr(strategies, op.strategy, None)), (name, op.strategy)
    assert sum(op.kernel is None for op in OPS.values()) == 1  # sinkhorn_split (hc_pre's kernel runs it)


def test_cpu_sparse_attention_keeps_a_nan_kv_row_out_of_queries_that_do_not_read_it():
    kv = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(BF16)
    kv[0, 5] = math.nan
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
    idx = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32)  # query 1 never reads row 0
    case = Case({"q": q, "kv": kv, "idx": idx, "sink": torch.zeros(2), "scale": 64**-0.5, "fmt": "bf16"})
    check_case("sparse_attention", ops.sparse_attention, case)


# ---- deliberately broken ports: each must be caught -----------------------------------------------------------


def sink_with_value_row(q, kv, idx, sink, scale, fmt="bf16"):
    """Sink as an extra logit column that (wrongly) carries the query's first kv row as its value."""
    valid = idx >= 0
    rows = torch.where(valid[..., None], kv[idx.clamp(min=0).long()].float(), 0.0)
    logits = (torch.einsum("nhd,nkd->nhk", q.float(), rows) * scale).masked_fill(~valid[:, None], -math.inf)
    p = torch.cat((logits, sink.float()[None, :, None].expand(len(q), -1, 1)), dim=-1).softmax(-1)
    return torch.einsum("nhk,nkd->nhd", p, torch.cat((rows, rows[:, :1]), dim=1)).to(BF16)


def sink_dropped(q, kv, idx, sink, scale, fmt="bf16"):
    return ops.sparse_attention(q, kv, idx, torch.full_like(sink, -math.inf), scale, fmt)


def rope_rotate_half(x, positions, freqs, inverse=False):
    """Rotates (x[i], x[i + 32]) instead of the interleaved pairs (x[2i], x[2i+1])."""
    rd = 2 * freqs.numel()
    angles = positions.float()[:, None] * freqs.float()[None]
    cos, sin = (t.view(len(x), *([1] * (x.ndim - 2)), -1) for t in (angles.cos(), angles.sin()))
    sin = -sin if inverse else sin
    a, b = x[..., -rd : -rd // 2].float(), x[..., -rd // 2 :].float()
    return torch.cat((x[..., :-rd], (a * cos - b * sin).to(x.dtype), (a * sin + b * cos).to(x.dtype)), dim=-1)


def rope_positions_through_bf16(x, positions, freqs, inverse=False):
    return ops.apply_rope(x, positions.to(BF16).long(), freqs, inverse)


def sinkhorn_3_iterations(mixes, scale, base, hc, iters, eps):
    return ops.sinkhorn_split(mixes, scale, base, hc, 3, eps)


def hc_post_comb_untransposed(f, residual, post, comb, out_dtype=BF16):
    return ops.hc_post(f, residual, post, comb.transpose(-1, -2), out_dtype)


def index_scores_without_relu(q, keys, weights, dtype=BF16):
    return (torch.einsum("nhd,ed->nhe", q.to(dtype), keys.to(dtype)) * weights.to(dtype)[..., None]).sum(1)


def index_scores_fp4_high_nibble_first(q, codes, scales, weights, dtype=BF16):
    """Reads element 2i from the high nibble (the packing convention flipped)."""
    swapped = (codes >> 4) | ((codes & 0xF) << 4)
    return ops.index_scores_fp4(q, swapped, scales, weights, dtype)


def kv_round_32_blocks(kv, rope_dims, fmt, scale_floor="amax"):
    return ops.kv_round(kv, rope_dims, "bf16") if fmt != "fp8" else torch.cat(
        (fake_quant_fp8(kv[..., :-rope_dims], 32, scale_floor), kv[..., -rope_dims:]), dim=-1)


def kv_round_scale_floor_ignored(kv, rope_dims, fmt, scale_floor="amax"):
    """Rounds with the official scale rule whatever ``scale_floor`` says (the CUDA kernel's rule, without its
    ``takes`` refusal): FlashMLA's rule differs on the blocks with amax below 0.0274."""
    return ops.kv_round(kv, rope_dims, fmt)


def indexer_round_scale_floor(x, fmt, rotate):
    """The ``fp4-scale-floor`` port: FP4 scales rounded down, so each block's maximum saturates at 6 s."""
    with faults.inject("fp4-scale-floor"):
        return ops.indexer_round(x, fmt, rotate)


def indexer_round_quantized_before_rotation(x, fmt, rotate):
    return hadamard(ops.indexer_round(x, fmt, False)) if rotate else ops.indexer_round(x, fmt, False)


def compressor_rope_at_the_blocks_last_position(*args):
    """The ``compressed-rope-last`` port: the entry rotated at the block's last position."""
    with faults.inject("compressed-rope-last"):
        return ops.compressor_decode(*args)


def kv_path_rope_before_norm(x, weight, eps, positions, freqs, fmt, scale_floor="amax"):
    """Rotates the wkv output first, then kv_norm: the norm's weight lands on rotated coordinates."""
    return ops.kv_round(ops.rms_norm(ops.apply_rope(x, positions, freqs), weight, eps), 2 * freqs.numel(), fmt,
                        scale_floor)


def kv_path_round_in_128_blocks(x, weight, eps, positions, freqs, fmt, scale_floor="amax"):
    """One ue8m0 scale per 128 nope dims: a block's small values sink into the subnormal codes of its neighbour's
    scale."""
    kv, rd = ops.apply_rope(ops.rms_norm(x, weight, eps), positions, freqs), 2 * freqs.numel()
    nope = kv[..., :-rd]
    wide = nope[..., : nope.shape[-1] // 128 * 128]
    rounded = fake_quant_fp8(wide, 128, scale_floor) if fmt == "fp8" else wide
    return torch.cat((rounded, nope[..., wide.shape[-1]:], kv[..., -rd:]), dim=-1)


def gate_weights_from_biased_scores(x, weight, bias, tid2eid, ids, cfg):
    scores = F.softplus(x @ weight.T).sqrt()
    biased = scores if bias is None else scores + bias
    picks = tid2eid[ids].long() if tid2eid is not None else biased.topk(cfg.n_activated_experts, dim=-1).indices
    w = biased.gather(1, picks)
    return w / w.sum(-1, keepdim=True) * cfg.route_scale, picks


def rms_norm_fp8_scale_floor(x, weight, eps):
    """Scale 2^floor(log2(amax / 448)) instead of ceil: the block maximum saturates at 448 s."""
    y = ops.rms_norm(x, weight, eps).float().unflatten(-1, (-1, 128))
    s = torch.exp2(torch.floor(torch.log2(y.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)))
    codes = (y / s).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    return codes, (torch.log2(s).squeeze(-1) + 127).to(torch.uint8)


def rms_norm_act_quant_scale_floor(x, weight, eps):
    codes, scales = rms_norm_fp8_scale_floor(x, weight, eps)
    return ops.rms_norm(x, weight, eps), dequantize_fp8(codes, scales, 128).to(BF16)


def act_linear_scale_floor(x, weight, act="fp8"):
    """Activation scale 2^floor(log2(amax / 448)): each 1x128 block's largest values saturate at 448 s."""
    b = x.float().unflatten(-1, (-1, 128))
    s = torch.exp2(torch.floor(torch.log2(b.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)))
    xq = ((b / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2)
    return (xq @ weight.T).to(BF16)


def expert_without_clamp(x, w1, w2, w3, limit, weight, act):
    return ops.expert(x, w1, w2, w3, 0.0, weight, act)


def fp8kv_scale_bytes_without_pad(q, kv_packed, idx, sink, scale, rope_dims):
    """Reads the scale bytes one byte late (as if a pad byte came before them): every block takes its neighbour's
    scale, the last one the pad's (2^-127)."""
    shifted = kv_packed.clone()
    start = q.shape[-1] - rope_dims + 2 * rope_dims
    n = (q.shape[-1] - rope_dims) // 64
    shifted[:, start : start + n] = kv_packed[:, start + 1 : start + n + 1]
    return ops.sparse_attention_fp8kv(q, shifted, idx, sink, scale, rope_dims)


def fp32_linear_in_bf16(x, weight):
    """The compressors' projections as transformers computes them: a bf16 GEMM (output rounded to bf16), not the
    official fp32 Linear."""
    return (x.to(BF16) @ weight.to(BF16).T).float()


def fp8_weight_linear_groups_ignored(x, codes, scales, act="fp8", groups=1):
    """wo_a's grouped projection with every output group reading x's first group."""
    k = codes.shape[1]
    return ops.fp8_weight_linear(x[:, :k].repeat(1, groups), codes, scales, act, groups)


def take_off_by_one(stack, index):
    """The expert one past the picked one (a stack read at the wrong stride), wrapping at the end."""
    return ops.take(stack, (index + 1) % stack.shape[0])


def put_at_block_end_one_token_early(store, pos, ratio, offset, row, ring=0):
    """The entry written when the block's second-to-last token arrives (pos % ratio == ratio - 2)."""
    return ops.put_at_block_end(store, pos + 1, ratio, offset, row, ring) if ratio > 1 else \
        ops.put_at_block_end(store, pos, ratio, offset + 1, row, ring)


def decode_slots_window_without_self(pos, picks, window, ratio, n_compressed):
    """The window's newest slot (the token itself) marked empty."""
    rows, local = ops.decode_slots(pos, picks, window, ratio, n_compressed)
    local = local.clone()
    local[0, (window - 1) if int(pos) >= window - 1 else int(pos)] = -1
    return rows, local


def mask_past_keeps_the_limit(scores, pos, ratio):
    """Entry (p + 1) // ratio left visible (j > limit masked instead of j >= limit)."""
    return ops.mask_past(scores, pos + ratio, ratio)


def topk_ties_to_the_higher_id(scores, k):
    """Equal scores ranked by descending id."""
    flipped = scores.flip(-1)
    return (scores.shape[-1] - 1 - ops.radix_topk(flipped, k))


def moe_sum_shared_first(out, shared):
    """The shared expert added before the routed slots (another fp32 order: other bits)."""
    y = shared.float()
    for j in range(out.shape[1]):
        y = y + out[:, j].float()
    return y.to(BF16)


BROKEN = [
    ("sparse_attention", sink_with_value_row, "cos|calc_diff"),
    ("sparse_attention", sink_dropped, "cos|calc_diff"),
    ("sparse_attention_fp8kv", fp8kv_scale_bytes_without_pad, "cos|calc_diff|non-finite"),
    ("apply_rope", rope_rotate_half, "cos|calc_diff|non-finite"),
    ("apply_rope", rope_positions_through_bf16, "cos|calc_diff"),
    ("sinkhorn_split", sinkhorn_3_iterations, "output 'comb'"),
    ("hc_post", hc_post_comb_untransposed, "cos|calc_diff"),
    ("index_scores", index_scores_without_relu, "error bound|non-finite"),
    ("index_scores_fp4", index_scores_fp4_high_nibble_first, "error bound|non-finite"),
    ("kv_round", kv_round_32_blocks, "not exact"),
    ("kv_round", kv_round_scale_floor_ignored, "not exact"),
    ("indexer_round", indexer_round_scale_floor, "not exact"),
    ("indexer_round", indexer_round_quantized_before_rotation, "not exact"),
    ("compressor_decode", compressor_rope_at_the_blocks_last_position, "cos|calc_diff"),
    ("kv_norm_rope_fp8", kv_path_rope_before_norm, "error bound"),
    ("kv_norm_rope_fp8", kv_path_round_in_128_blocks, "error bound"),
    ("gate", gate_weights_from_biased_scores, "output 'weights'"),
    ("expert", expert_without_clamp, "cos|calc_diff"),
    ("rms_norm_fp8", rms_norm_fp8_scale_floor, "error bound"),
    ("rms_norm_act_quant", rms_norm_act_quant_scale_floor, "error bound"),
    ("act_linear", act_linear_scale_floor, "error bound"),
    ("fp32_linear", fp32_linear_in_bf16, "error bound"),
    ("fp8_weight_linear", fp8_weight_linear_groups_ignored, "error bound"),
    ("take", take_off_by_one, "not exact"),
    ("put_at_block_end", put_at_block_end_one_token_early, "not exact"),
    ("decode_slots", decode_slots_window_without_self, "not exact"),
    ("mask_past", mask_past_keeps_the_limit, "not exact"),
    ("radix_topk", topk_ties_to_the_higher_id, "not exact"),
    ("moe_sum", moe_sum_shared_first, "not exact"),
]


@pytest.mark.parametrize(("op", "broken", "metric"), BROKEN, ids=[f"{op}-{fn.__name__}" for op, fn, _ in BROKEN])
def test_a_broken_port_is_caught(op, broken, metric):
    with pytest.raises(AssertionError, match=rf"(?s){op}: implementation '{broken.__name__}'.*({metric})") as err:
        check_against_oracle(op, broken, max_examples=40)
    assert "inputs: " in str(err.value)  # the failing input shapes are named


def test_a_fault_planted_in_an_ops_emulation_routes_that_op_to_it_and_says_so(monkeypatch):
    """While ``sink-dropped`` is injected, ``sparse_attention`` resolves to its emulation even where a kernel is
    selected, with the reason in ``kernel_fallbacks``; other ops keep their kernel."""
    from fidelity.decoders.production import fallbacks
    from fidelity.decoders.production.faults import inject

    kernel = lambda *a, **k: None  # noqa: E731 (a stand-in GPU kernel)
    for op in ("sparse_attention", "hc_post"):
        monkeypatch.setitem(REGISTRY[op], "gpu-kernel", kernel)
    fallbacks.reset()
    with forcing({"sparse_attention": "gpu-kernel", "hc_post": "gpu-kernel"}):
        with inject("sink-dropped"):
            assert implementation("sparse_attention", "cuda") is REGISTRY["sparse_attention"]["cpu"]
            assert implementation("hc_post", "cuda") is kernel
        assert implementation("sparse_attention", "cuda") is kernel
    assert fallbacks.counts() == {"sparse_attention": {"injected fault sink-dropped": 1}}


def test_forcing_an_implementation_holds_for_its_block_only():
    with forcing({"sparse_attention": "cpu"}):
        assert selections()["sparse_attention"] == "cpu"
        assert implementation("sparse_attention", "cuda") is REGISTRY["sparse_attention"]["cpu"]
    assert "sparse_attention" not in selections()
    with pytest.raises(KeyError, match="implementation 'cuda-graph' not registered"), \
            forcing({"sparse_attention": "cuda-graph"}):
        pass
    with pytest.raises(KeyError, match="op 'flash_attention'"), forcing({"flash_attention": "cpu"}):
        pass


def test_forced_implementations_and_injected_faults_stay_in_the_thread_that_set_them():
    """Context-scoped state: a decoder in another thread sees neither this thread's forced implementations nor its
    injected faults."""
    import threading

    from fidelity.decoders import faults

    seen = {}

    def other_thread():
        seen["selections"], seen["faults"] = selections(), faults.active()

    with forcing({"sparse_attention": "cpu"}), faults.inject("sink-dropped"):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert selections() == {"sparse_attention": "cpu"} and faults.active() == {"sink-dropped"}
    assert seen == {"selections": {}, "faults": frozenset()}


def test_every_fault_planted_in_the_emulations_routes_its_op_away_from_a_kernel():
    """A fault that lives inside ``ops.py`` must be in ``faults.IN_EMULATION`` (so a GPU kernel of that op steps
    aside while it is injected), unless the kernels call the very helper that reads it (``expert_clamps``)."""
    import ast
    import inspect

    from fidelity.decoders.production.faults import IN_EMULATION

    read_by_kernels = {"expert_clamps"}
    planted = {}
    for fn in ast.parse(inspect.getsource(ops)).body:
        if isinstance(fn, ast.FunctionDef) and fn.name not in read_by_kernels:
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "on":
                    planted[node.args[0].value] = fn.name
    assert planted, "no fault found in ops.py: the scan is broken"
    assert {f: op for f, op in planted.items() if f not in IN_EMULATION} == {}
    assert all(op in REGISTRY for ops_ in IN_EMULATION.values() for op in ops_)
