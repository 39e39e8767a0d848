"""GPU production kernels (fidelity.decoders.production.kernels, Triton) against the CPU emulation and the fp64 oracle.

Skipped as a module without triton or without a CUDA device (CI runs on CPU). Property tests are hypothesis,
derandomized, no deadline. Contracts:

* vs the oracle: ``fidelity.testing.check_against_oracle`` / ``check_case`` (the op's published contract);
* vs the CPU emulation (``fidelity.decoders.production.ops``): sparse attention per (query, head) row
  ``calc_diff <= (2 * 1.25 * 2^-8)^2 / 2`` (P's bf16 rounding may flip where fp32 exp / summation order differ);
  index scores within twice the contract's elementwise bound; RMSNorm ``y`` within one bf16 ulp;
* bit-exact: the FP8 quantizer of ``rms_norm_fp8`` (codes and scale bytes, given the kernel's ``y``), the
  584 B/token FP8 KV packing (unpacks to exactly ``ops.kv_round`` rows), FP4 keys vs their dequantized bf16
  copy (same tile values, same MMA), and the causal mask (the FP8-KV attention output is held to the emulation
  tolerance: its K tile reaches the MMA from registers, see its test).
"""

import math

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fidelity.decoders.production import ops, routes  # noqa: E402
from fidelity.decoders.production.faults import inject  # noqa: E402
from fidelity.decoders.production.kernels import (  # noqa: E402
    act_quant,
    fallbacks,
    indexer,
    kv_path,
    mhc,
    rms_norm,
    sparse_attention,
    take,
    weight_gemv,
)
from fidelity.decoders.production.registry import REGISTRY, implementation  # noqa: E402
from fidelity.model.formats import dequantize_fp4, fake_quant_fp8, quantize_fp4, quantize_fp8  # noqa: E402
from fidelity.testing import Case, check_against_oracle, check_case, strategies  # noqa: E402

BF16 = torch.bfloat16
CUDA = "cuda"
ROW_CALC_DIFF = (2 * 1.25 * 2.0**-8) ** 2 / 2
ROW_CALC_DIFF_E4M3 = (2 * 1.25 * 2.0**-4) ** 2 / 2  # the same rule with P on the e4m3 grid (3 mantissa bits)
PROPS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
REGISTERED = ("sparse_attention", "index_scores", "index_scores_fp4", "rms_norm", "hc_pre", "hc_post", "act_linear",
              "kv_round", "fp8_weight_linear", "fp4_picked_linear", "fp32_linear")


def _gen(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def _row_calc_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row calc_diff (last dim), fp64, rows where both are all-zero count as 0."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    den = (a * a).sum(-1) + (b * b).sum(-1)
    return torch.where(den > 0, 1 - 2 * (a * b).sum(-1) / den.clamp(min=1e-300), 0.0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (+0 == -0)."""
    a, b = a.double(), b.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


# ---------------------------------------------------------------------------------------------------------------
# registry and the published contracts (oracle in fp64)
# ---------------------------------------------------------------------------------------------------------------


def test_kernels_are_registered_under_the_cpu_op_names():
    for op in REGISTERED:
        assert "cpu" in REGISTRY[op] and "triton" in REGISTRY[op], op


@pytest.mark.parametrize("op", REGISTERED)
def test_kernel_meets_the_op_contract(op):
    check_against_oracle(op, REGISTRY[op]["triton"], max_examples=40, device=CUDA)


def test_weight_gemvs_meet_their_contracts_where_the_row_blocks_overhang():
    """Row blocks larger than the output (BN 256 over 128 / 384 rows; 256 over 64 / 128; 256 over 16 / 200 bf16
    rows): the masked rows; grouped FP8 cases with 64-row blocks inside 128-row groups."""
    def fp8(x, codes, scales, act, groups):
        xq = fake_quant_fp8(x, 128) if act == "fp8" else x
        return weight_gemv.fp8_weight_linear(xq, codes, scales, groups=groups, bn=256 if groups == 1 else 64)

    def f32(x, weight):
        return weight_gemv.bf16_weight_linear_f32(x, weight, bn=256)

    def fp4(x, experts, packed, scales, act):
        return weight_gemv.fp4_expert_linear(fake_quant_fp8(x, 128), experts, packed, scales, bn=256) \
            if act == "fp8" else ops.fp4_picked_linear(x, experts, packed, scales, act)

    check_against_oracle("fp8_weight_linear", fp8, max_examples=25, device=CUDA)
    check_against_oracle("fp4_picked_linear", fp4, max_examples=25, device=CUDA)
    check_against_oracle("fp32_linear", f32, max_examples=25, device=CUDA)


def test_sparse_attention_contract_wide_heads():
    check_against_oracle("sparse_attention", sparse_attention.sparse_attention, max_examples=25, device=CUDA,
                         strategy=strategies.sparse_attention_inputs(head_dims=(128, 512), max_heads=128))


def test_index_scores_contract_64_heads():
    check_against_oracle("index_scores", indexer.index_scores, max_examples=25, device=CUDA,
                         strategy=strategies.index_scores_inputs(dims=(128,), max_heads=64))


def test_index_scores_fp4_contract_on_fp8_tensor_cores():
    def fp8_mma(q, codes, scales, weights, dtype):
        return indexer.index_scores_fp4(q, codes, scales, weights, mma="fp8")

    check_against_oracle("index_scores_fp4", fp8_mma, max_examples=40, device=CUDA,
                         strategy=strategies.index_scores_fp4_inputs(dims=(128,), max_heads=64))


def test_registered_kernels_accept_cpu_tensors():
    q = torch.randn(2, 4, 128).to(BF16)
    kv = torch.randn(10, 128).to(BF16)
    idx = torch.tensor([[0, 1, -1], [2, -1, 3]], dtype=torch.int32)
    out = sparse_attention.sparse_attention(q, kv, idx, torch.zeros(4), 128**-0.5)
    assert out.device.type == "cpu" and out.dtype == BF16
    assert _row_calc_diff(out, ops.sparse_attention(q, kv, idx, torch.zeros(4), 128**-0.5)).max() <= ROW_CALC_DIFF


# ---------------------------------------------------------------------------------------------------------------
# sparse attention: DSv4-shaped cases (window of 128 incl. self, compressed picks, -1 padding)
# ---------------------------------------------------------------------------------------------------------------

_T_EDGES = (0, 1, 2, 3, 4, 5, 7, 8, 126, 127, 128, 129, 255, 256, 511, 512, 513)


@st.composite
def attention_cases(draw):
    """q [n, H, d], kv [window rows | compressed rows], idx = 128 window entries (positions t-127..t, -1 before 0,
    valid first or in position order) + a top-k part over the visible compressed entries j < (t+1)//ratio
    (HCA: all of them; CSA: a random subset; ragged / all -1 / empty cache)."""
    h = draw(st.sampled_from((4, 64, 128)))
    d = 128 if h == 4 else draw(st.sampled_from((128, 512)))
    n = draw(st.integers(1, 4))
    t_last = draw(st.one_of(st.sampled_from(_T_EDGES), st.integers(0, 2000)))
    ratio = draw(st.sampled_from((4, 128)))
    topk = draw(st.sampled_from((0, 1, 63, 64, 65, 128, 512)))
    picks = draw(st.sampled_from(("visible", "ragged", "all_masked")))
    valid_first = draw(st.booleans())
    g = _gen(draw)
    positions = [max(0, t_last - n + 1 + i) for i in range(n)]
    n_comp = (t_last + 1) // ratio
    idx = torch.full((n, 128 + topk), -1, dtype=torch.int32)
    for i, t in enumerate(positions):
        win = torch.arange(t - 127, t + 1)
        win = torch.where(win >= 0, win, -1)
        if valid_first:
            win = torch.cat((win[win >= 0], win[win < 0]))
        idx[i, :128] = win.to(torch.int32)
        visible = (t + 1) // ratio
        if topk and visible and picks != "all_masked":
            chosen = torch.randperm(visible, generator=g)[: min(topk, visible)]
            if picks == "ragged":
                chosen = chosen[torch.rand(len(chosen), generator=g) < 0.6]
            idx[i, 128 : 128 + len(chosen)] = (t_last + 1 + chosen).to(torch.int32)
    kv_scale = draw(st.sampled_from((0.25, 1.0, 4.0)))
    temperature = draw(st.sampled_from((0.5, 1.0, 4.0)))
    kv = (torch.randn(t_last + 1 + n_comp, d, generator=g) * kv_scale).to(BF16)
    q = (torch.randn(n, h, d, generator=g) * (temperature / kv_scale)).to(BF16)
    sink = torch.randn(h, generator=g) * 2 + draw(st.sampled_from((0.0, 4.0, -8.0)))
    args = {"q": q, "kv": kv, "idx": idx, "sink": sink, "scale": d**-0.5, "fmt": "bf16"}
    return Case(args, note=f"H={h} d={d} t={t_last} ratio={ratio} topk={topk} picks={picks} n_comp={n_comp}")


@PROPS
@given(case=attention_cases())
def test_sparse_attention_matches_emulation_and_oracle(case):
    a = case.args
    found = sparse_attention.sparse_attention_cuda(*(v.to(CUDA) if isinstance(v, torch.Tensor) else v
                                                     for v in a.values())).cpu()
    emulated = ops.sparse_attention(*a.values())
    worst = float(_row_calc_diff(found, emulated).max())
    assert worst <= ROW_CALC_DIFF, f"calc_diff vs emulation {worst:.3g} > {ROW_CALC_DIFF:.3g}; {case.note}"
    check_case("sparse_attention", sparse_attention.sparse_attention, case, device=CUDA)


@PROPS
@given(case=attention_cases())
def test_sparse_attention_e4m3_profile_runs_the_kernel_and_matches_its_emulation(case):
    """``fmt="fp8"`` (profile fp8-fmha: e4m3 Q, K/V and P) runs in the kernel, not the emulation fallback, and
    matches ``ops.sparse_attention(..., "fp8")`` on the same device: an e4m3 P flip from the fp32 summation order
    moves a weight by up to 2^-4 relative (the per-row bound), and almost every output is bit-equal (which a
    kernel that ignored the format would not be)."""
    args = [v.to(CUDA) if isinstance(v, torch.Tensor) else v for v in dict(case.args, fmt="fp8").values()]
    fallbacks.reset()
    found = sparse_attention.sparse_attention_cuda(*args)
    assert fallbacks.counts() == {}, case.note
    emulated = ops.sparse_attention(*args)
    worst = float(_row_calc_diff(found, emulated).max())
    assert worst <= ROW_CALC_DIFF_E4M3, f"calc_diff vs emulation {worst:.3g}; {case.note}"
    assert float((found == emulated).float().mean()) >= 0.9, case.note


def test_sparse_attention_fallbacks_are_logged_with_their_reason():
    q = torch.randn(2, 4, 96).to(BF16).to(CUDA)  # head_dim 96: no kernel launch for it
    kv = torch.randn(10, 96).to(BF16).to(CUDA)
    idx = torch.tensor([[0, 1, -1], [2, -1, 3]], dtype=torch.int32, device=CUDA)
    sink = torch.zeros(4, device=CUDA)
    fallbacks.reset()
    sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 96**-0.5)
    with inject("sink-dropped"):  # the registry hands out the emulation, which carries the fault
        assert implementation("sparse_attention", CUDA) is REGISTRY["sparse_attention"]["cpu"]
    assert fallbacks.counts() == {"sparse_attention": {"input dtype, shape or format not supported": 1,
                                                       "injected fault sink-dropped": 1}}


@PROPS
@given(case=attention_cases(), splits=st.sampled_from((2, 3, 5)), split_d=st.sampled_from((1, 2)))
def test_sparse_attention_split_variants(case, splits, split_d):
    a = case.args
    if a["q"].shape[-1] != 512:
        split_d = 1
    args = [v.to(CUDA) if isinstance(v, torch.Tensor) else v for v in a.values()]
    found = sparse_attention.sparse_attention_cuda(*args, config={"num_splits": splits, "split_d": split_d}).cpu()
    assert float(_row_calc_diff(found, ops.sparse_attention(*a.values())).max()) <= ROW_CALC_DIFF, case.note
    if split_d == 1 and a["idx"].shape[1] <= 64:  # a single index block: the unsplit launch's arithmetic
        assert torch.equal(found, sparse_attention.sparse_attention_cuda(*args, config={"route": "triton"}).cpu())


def _ws_runs_here() -> bool:
    return torch.cuda.get_device_capability() == (9, 0) and triton.__version__.startswith("3.6.")


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@PROPS
@given(case=attention_cases())
def test_ws_route_matches_emulation_and_the_triton_route_with_one_or_two_consumers(case):
    """The warp-specialized kernel (route ``ws``) on DSv4-shaped cases: the emulation's contract, and the Triton
    kernel's output except for rare bf16 flips (same reference order, different fp32 summation order). One
    consumer warpgroup per CTA (32 heads, rows as the MMA's M) and two (64 heads, heads as M) round P at the same
    points; their row sums add in different orders, so they agree except for rare one-ulp flips."""
    a = case.args
    if a["q"].shape[-1] != 512:
        return
    args = [v.to(CUDA) if isinstance(v, torch.Tensor) else v for v in a.values()]
    got = sparse_attention.sparse_attention_cuda(*args, config={"route": "ws", "consumers": 1}).cpu()
    assert float(_row_calc_diff(got, ops.sparse_attention(*a.values())).max()) <= ROW_CALC_DIFF, case.note
    other = sparse_attention.sparse_attention_cuda(*args, config={"route": "triton"}).cpu()
    assert float(_row_calc_diff(got, other).max()) <= ROW_CALC_DIFF, case.note
    assert (got == other).float().mean() >= 0.99, case.note
    if a["q"].shape[1] % 64 == 0:
        two = sparse_attention.sparse_attention_cuda(*args, config={"route": "ws", "consumers": 2}).cpu()
        assert float(_row_calc_diff(two, ops.sparse_attention(*a.values())).max()) <= ROW_CALC_DIFF, case.note
        assert (two == got).float().mean() >= 0.999, case.note


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("topk", [1, 63, 65, 130, 320, 1152])
@pytest.mark.parametrize("consumers", [1, 2])
def test_ws_layouts_meet_the_contract_over_ragged_blocks_and_masked_rows(heads, topk, consumers):
    """Both ``ws`` layouts against the emulation with 1 to 18 blocks (the slot rings and the two-consumer
    layout's double-buffered P wrap several times), a ragged last block, 30% masked entries and a row with none
    valid (zero output)."""
    g = torch.Generator().manual_seed(heads * 10_000 + topk)
    q = (torch.randn(5, heads, 512, generator=g) * 2).to(BF16)
    kv = torch.randn(3000, 512, generator=g).to(BF16)
    idx = torch.randint(0, 3000, (5, topk), generator=g).to(torch.int32)
    idx[torch.rand(5, topk, generator=g) < 0.3] = -1
    idx[2] = -1
    sink = torch.randn(heads, generator=g)
    got = sparse_attention.sparse_attention_cuda(q.to(CUDA), kv.to(CUDA), idx.to(CUDA), sink.to(CUDA), 512**-0.5,
                                                 config={"consumers": consumers}).cpu()
    assert not got[2].abs().any()
    assert float(_row_calc_diff(got, ops.sparse_attention(q, kv, idx, sink, 512**-0.5)).max()) <= ROW_CALC_DIFF


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("consumers", [1, 2])
def test_ws_layouts_divide_like_the_triton_kernel_when_the_sink_dominates(consumers):
    """O / l takes one multiply by 1 / l when every head's sum is in fp32's normal range, else the plain division:
    sums between 2^126 and 2^128 (a sink ~88 above the max logit) and inf (no valid entry) take the second path,
    next to heads of ordinary sums. Both give the Triton kernel's ``div.full.f32`` results."""
    g = torch.Generator().manual_seed(31 + consumers)
    q = (torch.randn(6, 64, 512, generator=g) * 0.01).to(BF16)
    kv = torch.randn(500, 512, generator=g).to(BF16)
    idx = torch.randint(0, 500, (6, 200), generator=g).to(torch.int32)
    idx[4] = -1
    sink = torch.randn(64, generator=g)
    sink[::3] = 87.4 + torch.rand(22, generator=g)  # e^87.4 > 2^126, e^88.4 < 2^128
    args = [x.to(CUDA) for x in (q, kv, idx, sink)]
    got = sparse_attention.sparse_attention_cuda(*args, 512**-0.5, config={"consumers": consumers}).cpu()
    other = sparse_attention.sparse_attention_cuda(*args, 512**-0.5, config={"route": "triton"}).cpu()
    assert got[0, ::3].abs().max() < 1e-30 and got[0, 1].abs().max() > 1e-3  # the sink takes nearly all weight
    assert not got[4].abs().any()
    assert float(_row_calc_diff(got, other).max()) <= ROW_CALC_DIFF
    assert (got == other).float().mean() >= 0.99
    assert float(_row_calc_diff(got, ops.sparse_attention(q, kv, idx, sink, 512**-0.5)).max()) <= ROW_CALC_DIFF


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_route_is_the_default_and_masked_entries_read_no_row():
    """Attention at d = 512 takes ``ws`` (recorded in the route counts), a call with Triton launch parameters
    the Triton kernel; a -1 entry loads no row: a NaN row that no valid index names leaves the output finite and
    equal to the emulation's."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 64, 512, generator=g).to(BF16)
    kv = torch.randn(400, 512, generator=g).to(BF16)
    kv[0] = float("nan")
    idx = torch.randint(1, 400, (3, 200), generator=g).to(torch.int32)
    idx[:, ::3] = -1
    idx[2] = -1
    sink = torch.randn(64, generator=g)
    routes.reset()
    got = sparse_attention.sparse_attention_cuda(q.to(CUDA), kv.to(CUDA), idx.to(CUDA), sink.to(CUDA), 512**-0.5)
    assert routes.counts("sparse_attention") == {"ws": 1}
    assert torch.isfinite(got.float()).all() and not got[2].abs().any()
    assert float(_row_calc_diff(got.cpu(), ops.sparse_attention(q, kv, idx, sink, 512**-0.5)).max()) <= ROW_CALC_DIFF
    qp = torch.randn(300, 64, 512, generator=g).to(BF16).to(CUDA)
    prefill = (qp, kv.to(CUDA), idx[:1].expand(300, -1).to(CUDA), sink.to(CUDA), 0.04)
    two = sparse_attention.sparse_attention_cuda(*prefill)  # 300 tokens x 64 heads: two consumers save waves
    sparse_attention.sparse_attention_cuda(*prefill, config={"block_h": 64})
    assert routes.counts("sparse_attention") == {"ws": 2, "triton": 1}
    one = sparse_attention.sparse_attention_cuda(*prefill, config={"consumers": 1})
    assert float(_row_calc_diff(two.cpu(), one.cpu()).max()) <= ROW_CALC_DIFF
    assert (two == one).float().mean() >= 0.999


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_route_replays_in_a_cuda_graph():
    g = torch.Generator().manual_seed(12)
    q = torch.randn(8, 128, 512, generator=g).to(BF16).to(CUDA)
    kv = torch.randn(3000, 512, generator=g).to(BF16).to(CUDA)
    idx = torch.randint(-1, 3000, (8, 640), generator=g).to(torch.int32).to(CUDA)
    sink = torch.randn(128, generator=g).to(CUDA)
    eager = sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 0.04, config={"route": "ws"})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 0.04, config={"route": "ws"})
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _packed_rows(g: torch.Generator, m: int, extreme: bool = False) -> torch.Tensor:
    """uint8 [m, 584] FP8 cache rows: random e4m3 codes (NaN codes excluded) and rope dims; scale bytes near 127,
    or (``extreme``) over 1..160 with every seventh row's bytes 0 (2^-127)."""
    packed = torch.randint(0, 256, (m, 584), generator=g, dtype=torch.uint8)
    codes = packed[:, :448]
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    packed[:, 448:576] = torch.randn(m, 64, generator=g).to(BF16).view(torch.uint8).view(m, 128)
    lo, hi = (1, 160) if extreme else (120, 134)
    packed[:, 576:583] = torch.randint(lo, hi, (m, 7), generator=g, dtype=torch.uint8)
    if extreme:
        packed[::7, 576:583] = 0
    packed[:, 583] = 0
    return packed


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("topk", [1, 63, 65, 130, 320, 1152])
@pytest.mark.parametrize("ring", [(1, None, None), (1, 2, 0), (1, 3, 2), (2, None, None), (2, 2, 0)])
def test_fp8_kv_ws_route_equals_the_bf16_ws_kernel_on_the_unpacked_rows(heads, topk, ring):
    """The FP8 layout's ``ws`` route dequantizes in its producers into the tiles the bf16 ``ws`` kernel reads from
    ``unpack_kv_fp8`` rows, so each consumer layout, ring depth and prefetch distance gives the same bits, over 1 to
    18 blocks (the ring wraps; an odd count leaves the producers' two-block loop step half used), a ragged last
    block, 30% masked entries and a row with none valid (zero output); and meets the emulation's contract."""
    consumers, slots, prefetch = ring
    g = torch.Generator().manual_seed(heads * 10_000 + topk + 7 * consumers)
    q = (torch.randn(5, heads, 512, generator=g) * 2).to(BF16)
    packed = _packed_rows(g, 3000)
    idx = torch.randint(0, 3000, (5, topk), generator=g).to(torch.int32)
    idx[torch.rand(5, topk, generator=g) < 0.3] = -1
    idx[2] = -1
    sink = torch.randn(heads, generator=g)
    args = [x.to(CUDA) for x in (q, packed, idx, sink)]
    routes.reset()
    got = sparse_attention.sparse_attention_fp8kv(*args, 512**-0.5, config={
        "consumers": consumers, "slots": slots, "prefetch": prefetch})
    assert routes.counts("sparse_attention_fp8kv") == {"ws": 1}
    rows = sparse_attention.unpack_kv_fp8(args[1])
    bf16 = sparse_attention.sparse_attention_cuda(args[0], rows, *args[2:], 512**-0.5,
                                                  config={"consumers": consumers})
    assert torch.equal(got.view(torch.int16), bf16.view(torch.int16))
    assert not got[2].abs().any()
    ref = ops.sparse_attention(q, rows.cpu(), idx, sink, 512**-0.5)
    assert float(_row_calc_diff(got.cpu(), ref).max()) <= ROW_CALC_DIFF


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@PROPS
@given(case=attention_cases())
def test_fp8_kv_ws_route_meets_the_oracle_contract(case):
    """The FP8 layout's ``ws`` route against ``sparse_attention``'s contract (the fp64 oracle on the gathered
    rows), on DSv4-shaped cases whose KV rows are the values the layout stores (``kv_round``'s 1x64 FP8 nope
    dims, bf16 rope dims)."""
    a = case.args
    if a["q"].shape[-1] != 512:
        return
    stored = Case({**a, "kv": ops.kv_round(a["kv"], 64, "fp8")}, note=case.note)

    def fp8_route(q, kv, idx, sink, scale, fmt="bf16"):
        return sparse_attention.sparse_attention_fp8kv(q, sparse_attention.pack_kv_fp8(kv), idx, sink, scale,
                                                       config={"route": "ws"})

    check_case("sparse_attention", fp8_route, stored, device=CUDA)


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_fp8_kv_ws_route_dequantizes_extreme_scale_bytes_like_the_unpacking():
    """Scale bytes from 0 (2^-127, a subnormal factor) to 160: the tiles are ``unpack_kv_fp8``'s bit for bit, so
    the output is the bf16 ``ws`` kernel's on the unpacked rows, two queries per sequence (MTP) included."""
    g = torch.Generator().manual_seed(21)
    packed = _packed_rows(g, 2000, extreme=True).to(CUDA)
    q = (torch.randn(128, 64, 512, generator=g) * 0.05).to(BF16).to(CUDA)
    idx = torch.randint(0, 2000, (128, 640), generator=g).to(torch.int32).to(CUDA)
    sink = torch.randn(64, generator=g).to(CUDA)
    rows = sparse_attention.unpack_kv_fp8(packed)
    assert (rows[::7, :448] == 0).float().mean() < 1  # the 2^-127 rows are not all flushed to zero
    for consumers in (1, 2):
        got = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, 0.04, config={"consumers": consumers})
        bf16 = sparse_attention.sparse_attention_cuda(q, rows, idx, sink, 0.04, config={"consumers": consumers})
        assert torch.equal(got.view(torch.int16), bf16.view(torch.int16))


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_fp8_kv_ws_route_replays_in_a_cuda_graph_and_refuses_what_it_cannot_run():
    g = torch.Generator().manual_seed(22)
    q = torch.randn(2, 64, 512, generator=g).to(BF16).to(CUDA)
    packed = _packed_rows(g, 3000).to(CUDA)
    idx = torch.randint(-1, 3000, (2, 640), generator=g).to(torch.int32).to(CUDA)
    sink = torch.randn(64, generator=g).to(CUDA)
    eager = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, 0.04)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, 0.04)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    routes.reset()
    q48 = torch.randn(2, 48, 512, generator=g).to(BF16).to(CUDA)
    sparse_attention.sparse_attention_fp8kv(q48, packed, idx, sink[:48], 0.04)  # 48 heads: the Triton route
    assert routes.counts("sparse_attention_fp8kv") == {"triton": 1}
    with pytest.raises(ValueError, match="route 'ws' cannot run: needs a head count that is a multiple of 32"):
        sparse_attention.sparse_attention_fp8kv(q48, packed, idx, sink[:48], 0.04, config={"route": "ws"})
    with pytest.raises(ValueError, match=r"\['slots'\] is a parameter of route 'ws'"):
        sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, 0.04, config={"route": "triton", "slots": 2})


def test_sparse_attention_route_refusals_say_why():
    q = torch.randn(2, 64, 128).to(BF16).to(CUDA)
    kv = torch.randn(50, 128).to(BF16).to(CUDA)
    idx = torch.zeros((2, 10), dtype=torch.int32, device=CUDA)
    sink = torch.zeros(64, device=CUDA)
    with pytest.raises(ValueError, match="route 'ws' cannot run: .*head_dim 512"):
        sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 0.1, config={"route": "ws"})
    with pytest.raises(ValueError, match="route must be 'ws' or 'triton', found 'fast'"):
        sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 0.1, config={"route": "fast"})
    if _ws_runs_here():
        q5, kv5 = torch.randn(2, 64, 512).to(BF16).to(CUDA), torch.randn(50, 512).to(BF16).to(CUDA)
        with pytest.raises(ValueError, match=r"takes no Triton launch parameters, found \['block_h'\]"):
            sparse_attention.sparse_attention_cuda(q5, kv5, idx, sink, 0.1, config={"route": "ws", "block_h": 32})
        with pytest.raises(ValueError, match="consumers must be 1 or 2.*found consumers=3, heads=64"):
            sparse_attention.sparse_attention_cuda(q5, kv5, idx, sink, 0.1, config={"consumers": 3})


@PROPS
@given(case=attention_cases())
def test_fp8_kv_layout_matches_bf16_rows(case):
    """The 584 B/token layout dequantizes to exactly the kv_round rows; the Triton route's output matches the
    Triton kernel on those rows up to the MMA accumulation order (the K tile reaches the tensor cores from
    registers instead of shared memory, so fp32 sums may round differently: not bit-identical on the H200); the
    ``ws`` route (where it runs) equals the bf16 ``ws`` kernel on those rows bit for bit."""
    a = case.args
    if a["q"].shape[-1] != 512:
        return
    kv = ops.kv_round(a["kv"].to(CUDA), 64, "fp8")
    packed = sparse_attention.pack_kv_fp8(kv)
    assert packed.shape == (kv.shape[0], 584)
    assert torch.equal(sparse_attention.unpack_kv_fp8(packed).view(torch.int16), kv.view(torch.int16))
    q, idx, sink = a["q"].to(CUDA), a["idx"].to(CUDA), a["sink"].to(CUDA)
    if _ws_runs_here() and q.shape[1] % 32 == 0:
        ws = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, a["scale"])
        assert torch.equal(ws.view(torch.int16), sparse_attention.sparse_attention_cuda(
            q, kv, idx, sink, a["scale"], config={"route": "ws"}).view(torch.int16)), case.note
    got = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, a["scale"], config={"route": "triton"}).cpu()
    ref = sparse_attention.sparse_attention_cuda(q, kv, idx, sink, a["scale"], config={"route": "triton"}).cpu()
    assert float(_row_calc_diff(got, ref).max()) <= ROW_CALC_DIFF, case.note
    assert float(_row_calc_diff(got, ops.sparse_attention(a["q"], kv.cpu(), a["idx"], a["sink"], a["scale"])).max()
                 ) <= ROW_CALC_DIFF, case.note


def test_sparse_attention_default_stages_shrink_to_fit_an_override_but_explicit_stages_do_not():
    """64-head d=512 decode defaults to 3 pipeline stages; with split_d=2 those do not fit in shared memory, so
    the launcher drops stages (same numerics); a config that names its stage count is timed as named or fails."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 64, 512, generator=g).to(BF16).to(CUDA)
    kv = torch.randn(300, 512, generator=g).to(BF16).to(CUDA)
    idx = torch.randint(0, 300, (2, 200), generator=g).to(torch.int32).to(CUDA)
    sink = torch.randn(64, generator=g).to(CUDA)
    ref = ops.sparse_attention(q, kv, idx, sink, 512**-0.5)
    got = sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 512**-0.5, config={"split_d": 2})
    assert float(_row_calc_diff(got, ref).max()) <= ROW_CALC_DIFF
    with pytest.raises(sparse_attention.OutOfResources):
        sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 512**-0.5, config={"split_d": 2, "num_stages": 3})


def test_sparse_attention_all_masked_and_empty():
    q = torch.randn(3, 64, 512).to(BF16)
    kv = torch.randn(5, 512).to(BF16)
    sink = torch.randn(64)
    for idx in (torch.full((3, 130), -1, dtype=torch.int32), torch.zeros((3, 0), dtype=torch.int32)):
        out = sparse_attention.sparse_attention(q, kv, idx, sink, 512**-0.5)
        assert torch.equal(out, ops.sparse_attention(q, kv, idx, sink, 512**-0.5))
        assert not out.abs().any()


# ---------------------------------------------------------------------------------------------------------------
# indexer scores
# ---------------------------------------------------------------------------------------------------------------

_E_EDGES = (0, 1, 3, 4, 5, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097)


def _bound(q, keys, w) -> torch.Tensor:
    """The index_scores contract's elementwise bound (fidelity.testing), recomputed here in fp64."""
    q, keys, w = q.double(), keys.double(), w.double().abs()
    terms = torch.einsum("nhd,ed->nhe", q, keys).relu()
    absdots = torch.einsum("nhd,ed->nhe", q.abs(), keys.abs())
    return 4 * 2.0**-8 * (terms * w[..., None]).sum(1) + q.shape[-1] * 2.0**-23 * (absdots * w[..., None]).sum(1)


@st.composite
def indexer_cases(draw):
    h = draw(st.sampled_from((4, 64)))
    d = draw(st.sampled_from((64, 128)))
    n = draw(st.integers(1, 3))
    e = draw(st.one_of(st.sampled_from(_E_EDGES), st.integers(0, 5000)))
    g = _gen(draw)
    q = torch.randn(n, h, d, generator=g)
    keys = torch.randn(e, d, generator=g) * draw(st.sampled_from((0.1, 1.0, 8.0)))
    q = ops.indexer_round(q, "fp4", rotate=True).to(BF16)  # the production q: Hadamard + FP4, stored bf16
    w = (torch.randn(n, h, generator=g) * (d**-0.5 * h**-0.5)).to(BF16)
    return q, keys, w


@PROPS
@given(case=indexer_cases())
def test_index_scores_match_emulation(case):
    q, keys, w = case
    keys = keys.to(BF16)
    found = indexer.index_scores_cuda(q.to(CUDA), keys.to(CUDA), w.to(CUDA)).cpu()
    emulated = ops.index_scores(q, keys, w)
    assert found.shape == emulated.shape and found.dtype == BF16
    err = (found.double() - emulated.double()).abs()
    assert bool((err <= 2 * _bound(q, keys, w)).all())


@PROPS
@given(case=indexer_cases(), t0=st.sampled_from((0, 3, 4, 7, 8, 127, 128, 511, 4095, 4096)))
def test_index_scores_fp4_keys_and_causal_mask(case, t0):
    q, keys, w = case
    packed, scales = quantize_fp4(keys, 32)
    deq = dequantize_fp4(packed, scales).to(BF16)
    qc, wc, pc, sc = q.to(CUDA), w.to(CUDA), packed.to(CUDA), scales.to(CUDA)
    ref = indexer.index_scores_cuda(qc, deq.to(CUDA), wc)
    assert torch.equal(indexer.dequantize_fp4_keys(pc, sc).cpu().view(torch.int16), deq.view(torch.int16))
    assert torch.equal(ref.cpu().view(torch.int16), indexer.index_scores(q, deq, w).view(torch.int16))
    bf16_path = indexer.index_scores_fp4(qc, pc, sc, wc, mma="bf16")
    assert torch.equal(bf16_path.view(torch.int16), ref.view(torch.int16))  # same tile values, same MMA
    got, used = indexer.index_scores_fp4(qc, pc, sc, wc, mma="fp8", return_path=True)
    scored = int(q.shape[-1] == 128 and keys.shape[0] > 0)
    assert used.tolist() == [scored] * q.shape[0]  # FP4-simulated q: FP8 MMA where d = 128 (and keys to score)
    bound = 2 * _bound(q, deq, w)
    assert bool(((got.cpu().double() - ops.index_scores(q, deq, w).double()).abs() <= bound).all())
    if got.numel():  # FP8 MMA: exact per 32-dim block, so it differs only by fp32 summation order
        assert float((got == ref).float().mean()) >= 0.99
    positions = torch.arange(q.shape[0]) + t0
    masked = indexer.index_scores_fp4(qc, pc, sc, wc, positions=positions.to(CUDA), mma="fp8").cpu()
    hidden = torch.arange(keys.shape[0])[None, :] >= ((positions + 1) // 4)[:, None]
    auto = indexer.index_scores_fp4(qc, pc, sc, wc, positions=positions.to(CUDA)).cpu()
    assert torch.equal(auto[~hidden], ref.cpu()[~hidden])  # "auto" at these sizes: the bf16 path, bit-exact
    assert bool(torch.isneginf(masked[hidden]).all())
    assert torch.equal(masked[~hidden], got.cpu()[~hidden])


@pytest.mark.parametrize("n_keys", [1, 129, 5000, 70000])
@pytest.mark.parametrize("tiles", [None, 1, 3])
def test_index_scores_fp4_fp8_mma_falls_back_per_query_where_q_is_not_fp4(n_keys, tiles):
    g = torch.Generator().manual_seed(n_keys)
    q = ops.indexer_round(torch.randn(4, 64, 128, generator=g), "fp4", rotate=True).to(BF16)
    q[1] = torch.randn(64, 128, generator=g).to(BF16)  # a plain bf16 query: codes inexact -> bf16 path
    q[2, 5, 7] = math.nan
    keys = torch.randn(n_keys, 128, generator=g)
    packed, scales = (t.to(CUDA) for t in quantize_fp4(keys, 32))
    w = (torch.randn(4, 64, generator=g) / 64).to(BF16).to(CUDA)
    deq = indexer.dequantize_fp4_keys(packed, scales)
    got, used = indexer.index_scores_fp4(q.to(CUDA), packed, scales, w, config={"tiles": tiles}, mma="fp8",
                                         return_path=True)
    assert used.tolist() == [1, 0, 0, 1]
    ref = indexer.index_scores_cuda(q.to(CUDA), deq, w)
    assert torch.equal(got[1:3].view(torch.int16), ref[1:3].view(torch.int16))  # NaN row: NaN where ref is
    assert float((got[[0, 3]] == ref[[0, 3]]).float().mean()) >= 0.999
    bound = 2 * _bound(q[[0, 3]], deq.cpu(), w.cpu()[[0, 3]])
    assert bool(((got[[0, 3]].cpu().double() - ref[[0, 3]].cpu().double()).abs() <= bound).all())


@pytest.mark.parametrize("spread", [0, 70])
def test_index_scores_fp4_fp8_mma_both_rounding_routes_match_the_bf16_path(spread):
    """Programs whose key scales lie in [2^-60, 2^60] (for queries whose folded weights lie in [2^-40, 2^30])
    round to bf16 on the FP32 pipe, the others through the conversion unit: both equal the bf16 kernel up to fp32
    summation order."""
    g = torch.Generator().manual_seed(spread)
    q = ops.indexer_round(torch.randn(3, 64, 128, generator=g), "fp4", rotate=True).to(BF16)
    w = (torch.randn(3, 64, generator=g) / 64).to(BF16)
    w[2] *= 2.0**-60  # folded weights below 2^-40: this query rounds through the conversion unit
    keys = torch.randn(1000, 128, generator=g)
    keys[::7] *= 2.0**spread  # spread 70: every program holds keys with scales beyond 2^60
    packed, scales = (t.to(CUDA) for t in quantize_fp4(keys, 32))
    deq = indexer.dequantize_fp4_keys(packed, scales)
    got, used = indexer.index_scores_fp4(q.to(CUDA), packed, scales, w.to(CUDA), mma="fp8", return_path=True)
    assert used.tolist() == [1, 1, 1]
    ref = indexer.index_scores_cuda(q.to(CUDA), deq, w.to(CUDA))
    assert float((got == ref).float().mean()) >= 0.999
    bound = 2 * _bound(q, deq.cpu(), w)
    assert bool(((got.cpu().double() - ref.cpu().double()).abs() <= bound).all())


@pytest.mark.parametrize("n_keys, tiles, causal", [(129, None, False), (5000, 3, True), (70000, None, True),
                                                    (262144, None, False)])
def test_index_scores_fp4_packed_bf16x2_epilogue_gives_the_fp32_pipe_bits(n_keys, tiles, causal):
    """The default FP8-path epilogue rounds, ReLUs and weights two (key, head) values per bf16x2 instruction; the
    FP32-pipe epilogue (``packed=False``) does the same steps one value at a time. Same MMA, same fp32 head sum:
    the scores are bit-identical (a ReLU of -0 may give +0 in one and -0 in the other: equal values)."""
    g = torch.Generator().manual_seed(n_keys)
    q = ops.indexer_round(torch.randn(2, 64, 128, generator=g), "fp4", rotate=True).to(BF16).to(CUDA)
    w = (torch.randn(2, 64, generator=g) / 64).to(BF16).to(CUDA)
    packed, scales = (t.to(CUDA) for t in quantize_fp4(torch.randn(n_keys, 128, generator=g), 32))
    pos = (torch.tensor([n_keys * 2, n_keys * 4 + 3]) if causal else torch.tensor([0, 0])).to(CUDA)
    kw = {"positions": pos if causal else None, "mma": "fp8", "return_path": True}
    fast, used = indexer.index_scores_fp4(q, packed, scales, w, config={"tiles": tiles, "packed": True}, **kw)
    slow, _ = indexer.index_scores_fp4(q, packed, scales, w, config={"tiles": tiles, "packed": False}, **kw)
    assert used.tolist() == [1, 1]
    assert torch.equal(fast, slow)
    if causal:
        assert bool(torch.isneginf(fast[0, n_keys // 2:]).all()) and not bool(torch.isneginf(fast[1]).any())



def _ws_index_case(n_q, n_keys, heads=64, seed=0, spread=0):
    """FP4-simulated queries (query 1 a plain bf16 q where n_q >= 2, query 2 holding a NaN where n_q >= 3), FP4 keys
    (every 7th scaled by 2^spread), weights, and the bf16 kernel's scores on the dequantized keys."""
    g = torch.Generator().manual_seed(seed)
    q = ops.indexer_round(torch.randn(n_q, heads, 128, generator=g), "fp4", rotate=True).to(BF16)
    if n_q >= 2:
        q[1] = torch.randn(heads, 128, generator=g).to(BF16)
    if n_q >= 3:
        q[2, 5, 7] = math.nan
    keys = torch.randn(n_keys, 128, generator=g)
    keys[::7] *= 2.0**spread
    packed, scales = (t.to(CUDA) for t in quantize_fp4(keys, 32))
    w = (torch.randn(n_q, heads, generator=g) / heads).to(BF16).to(CUDA)
    deq = indexer.dequantize_fp4_keys(packed, scales)
    return q.to(CUDA), packed, scales, w, deq, indexer.index_scores_cuda(q.to(CUDA), deq, w)


def _assert_ws_scores(got, used, q, deq, w, ref, exact=None, min_equal=0.999):
    """``used`` = ``exact`` (default: 1 for the FP4-simulated queries of :func:`_ws_index_case`); NaN where the bf16
    kernel has NaN; >= ``min_equal`` equal to it (the head sum adds in the tensor core's order), all within twice
    the contract's bound."""
    exact = exact or [int(i == 0 or i >= 3) for i in range(q.shape[0])]
    assert used.tolist() == exact
    assert torch.equal(got.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert float((got[finite] == ref[finite]).float().mean()) >= min_equal
    rows = [i for i in range(q.shape[0]) if not bool(ref[i].isnan().any())]
    bound = 2 * _bound(q[rows].cpu(), deq.cpu(), w[rows].cpu())
    shown = ~ref[rows].isinf().cpu()  # masked by the causal rule: -inf in both (checked above)
    assert torch.equal(got[rows].isinf(), ref[rows].isinf())
    assert bool(((got[rows].cpu().double() - ref[rows].cpu().double()).abs() <= bound)[shown].all())


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_index_scores_fp4_meet_the_contract():
    def ws(q, codes, scales, weights, dtype):
        mma = "ws" if 1 <= q.shape[0] <= 4 else "fp8"
        return indexer.index_scores_fp4(q, codes, scales, weights, mma=mma)

    check_against_oracle("index_scores_fp4", ws, max_examples=40, device=CUDA,
                         strategy=strategies.index_scores_fp4_inputs(dims=(128,), max_heads=64))


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("n_q, n_keys, causal, config", [
    (1, 1, False, None), (1, 127, True, None), (2, 128, False, None), (3, 129, True, None),
    (4, 5000, False, {"ctas": 3}), (1, 70000, True, {"slots": 4}), (4, 70001, False, None),
    (1, 262144, False, None), (3, 262144, True, {"slots": 8}), (1, 70001, True, {"consumers": 2})])
def test_ws_index_scores_fp4_match_the_bf16_kernel(n_q, n_keys, causal, config):
    """The warp-specialized kernel over ragged last tiles, 1 to 4 queries (a plain bf16 query and a NaN query take
    its bf16 path), CTAs that walk many tiles (the slot ring wraps), and the causal mask."""
    q, packed, scales, w, deq, ref = _ws_index_case(n_q, n_keys, seed=n_keys)
    pos = (torch.arange(n_q) * 3 + n_keys * 2).to(CUDA) if causal else None
    got, used = indexer.index_scores_fp4(q, packed, scales, w, positions=pos, config=config, mma="ws",
                                         return_path=True)
    if causal:
        hidden = torch.arange(n_keys, device=CUDA)[None, :] >= ((pos + 1) // 4)[:, None]
        assert bool(torch.isneginf(got[hidden]).all())
        ref = ref.masked_fill(hidden, float("-inf"))
    _assert_ws_scores(got, used, q, deq, w, ref)


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_query_preparation_flags_exactly_the_queries_it_cannot_code():
    """The queries are coded inside the ws kernel (E from the amax over both consumers' halves): FP4-simulated
    queries stay exact, also with a value exactly 2^-9 of the code scale (an e4m3 subnormal); a plain bf16 query,
    one holding a NaN and one with a value 2^-10 of the code scale take the bf16 path (the Triton FP8 kernel codes
    per head, so it may keep that one on FP8). 40 heads (padded). The flags are written when there are no keys
    too."""
    g = torch.Generator().manual_seed(0)
    q = ops.indexer_round(torch.randn(6, 40, 128, generator=g), "fp4", rotate=True).to(BF16)
    q[1] = torch.randn(40, 128, generator=g).to(BF16)
    q[2, 3, 4] = float("nan")
    for i, k in ((3, 16), (4, 17)):  # amax in [2^E, 2^(E + 1)); the code scale is 2^(7 - E)
        e = int(torch.floor(torch.log2(q[i].float().abs().max())))
        q[i, 0, 0] = 2.0 ** (e - k)
    expected = [1, 0, 0, 1, 0, 1]
    packed, scales = (t.to(CUDA) for t in quantize_fp4(torch.randn(300, 128, generator=g), 32))
    q, w = q.to(CUDA), (torch.randn(6, 40, generator=g) / 40).to(BF16).to(CUDA)
    deq = indexer.dequantize_fp4_keys(packed, scales)
    for part in (slice(0, 4), slice(4, 6)):
        got, used = indexer.index_scores_fp4(q[part], packed, scales, w[part], mma="ws", return_path=True)
        assert used.tolist() == expected[part]
        ref = indexer.index_scores_cuda(q[part], deq, w[part])
        _assert_ws_scores(got, used, q[part], deq, w[part], ref, exact=expected[part], min_equal=0.99)
        empty, used = indexer.index_scores_fp4(q[part], packed[:0], scales[:0], w[part], mma="ws", return_path=True)
        assert empty.shape == (part.stop - part.start, 0) and used.tolist() == expected[part]


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("heads, spread, w_scale", [(64, 70, 1.0), (40, 0, 2.0**-60), (17, -60, 2.0**40)])
def test_ws_index_scores_fp4_extreme_scales_and_fewer_heads(heads, spread, w_scale):
    """Key scales far from 1, tiny or huge weights (bf16 products near the subnormal or overflow range), and
    fewer than 64 heads (padded with zero codes and weights)."""
    q, packed, scales, w, deq, _ = _ws_index_case(3, 3000, heads=heads, seed=heads, spread=spread)
    w = (w.float() * w_scale).to(BF16)
    ref = indexer.index_scores_cuda(q, deq, w)
    got, used = indexer.index_scores_fp4(q, packed, scales, w, mma="ws", return_path=True)
    _assert_ws_scores(got, used, q, deq, w, ref)


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("n_q, n_keys, count", [(1, 31, False), (1, 31, True), (2, 3, False), (2, 3, True)])
def test_ws_index_scores_fp4_with_one_head_match_the_bf16_kernel(n_q, n_keys, count):
    """One head (63 padded with zero codes and weights), with and without the ``paths`` counter (two builds each):
    the bf16 kernel's scores, all on the FP8 path. In a draft of this kernel (register operands, 2026-12-02,
    ``benchmarks/results/2026-12-02-h200-indexer-rega``) the builds specialized to n_heads == 1 stored stray bytes,
    NaN codes among them, into the padded heads' query codes (ptxas packed them from unrelated registers), and every
    score came out NaN; these are the shapes that showed it."""
    from fidelity.decoders.production.kernels import indexer_ws

    g = torch.Generator().manual_seed(n_keys + n_q)
    q = ops.indexer_round(torch.randn(n_q, 1, 128, generator=g), "fp4", rotate=True).to(BF16).to(CUDA)
    packed, scales = (t.to(CUDA) for t in quantize_fp4(torch.randn(n_keys, 128, generator=g), 32))
    w = (torch.randn(n_q, 1, generator=g) / 4).to(BF16).to(CUDA)
    deq = indexer.dequantize_fp4_keys(packed, scales)
    paths = torch.zeros(2, dtype=torch.int32, device=CUDA) if count else None
    got, used = indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=paths)
    if count:
        assert paths.tolist() == [2 * n_q, 0]  # both 64-key halves of the one tile, per query, on the FP8 path
    _assert_ws_scores(got, used, q, deq, w, indexer.index_scores_cuda(q, deq, w), exact=[1] * n_q)


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_half_tiles_fold_the_block_scales_or_take_the_bf16_path():
    """A 64-key half tile is scored with the block scales folded into the FP8 codes only when every key's scale
    bytes lie within SPREAD of their smallest and the key's power of two keeps the bf16 steps normal; otherwise
    the half tile takes the bf16 path for that query. Spreads of 11 (folds) and 12, a NaN scale byte, scale bytes
    near both ends of the e8m0 range, and a query whose weights are subnormal: the scores stay the bf16 kernel's
    (NaN where it has NaN) and ``paths`` counts each half tile on the path expected."""
    from fidelity.decoders.production.kernels import indexer_ws

    g = torch.Generator().manual_seed(3)
    q = ops.indexer_round(torch.randn(2, 64, 128, generator=g), "fp4", rotate=True).to(BF16).to(CUDA)
    packed, scales = (t.to(CUDA) for t in quantize_fp4(torch.randn(1000, 128, generator=g), 32))
    w = (torch.randn(2, 64, generator=g) / 64).to(BF16).to(CUDA)
    w[1, 5] = 2.0**-130  # subnormal weight: query 1 never folds
    spread = indexer_ws.SPREAD
    scales[10] = torch.tensor([120, 120 + spread, 121, 125], dtype=torch.uint8)  # half 0: folds
    scales[70] = torch.tensor([120, 121, 120 + spread + 1, 125], dtype=torch.uint8)  # half 1: too wide
    scales[200, 2] = 255  # half 3: NaN block
    scales[300] = 2  # half 4: 2^-125 scales, F below the range
    scales[450] = 250  # half 7: 2^123 scales, F above the range
    deq = indexer.dequantize_fp4_keys(packed, scales)
    ref = indexer.index_scores_cuda(q, deq, w)
    paths = torch.zeros(2, dtype=torch.int32, device=CUDA)
    got, used = indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=paths)
    assert used.tolist() == [1, 1]
    halves = 2 * math.ceil(1000 / 128)
    assert paths.tolist() == [halves - 4, halves + 4]  # query 0: halves 1, 3, 4, 7 on bf16; query 1: all
    _assert_ws_scores(got, used, q, deq, w, ref, exact=[1, 1])
    assert bool(got[:, 200].isnan().all())
    one = torch.zeros(2, dtype=torch.int32, device=CUDA)
    indexer_ws.index_scores_fp4_ws(q[:1], packed[:64], scales[:64], w[:1], paths=one)
    assert one.tolist() == [2, 0]  # both halves of the one tile fold (the second has no keys)
    with pytest.raises(ValueError, match="paths must be int32"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=torch.zeros(2, device=CUDA))


@pytest.mark.skipif(not _ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_index_scores_fp4_is_the_one_query_decode_default_and_replays_in_a_cuda_graph():
    """``auto`` takes ``ws`` for one query over >= ``WS_MIN_KEYS`` keys, the Triton FP8 kernel for more queries
    below ``WS_MIN_KEYS_QUERIES`` keys and ``ws`` above, the bf16 kernel below ``FP8_MMA_MIN_KEYS``; the launch
    replays in a CUDA graph with the eager scores; inputs the kernel cannot take are refused with the reason."""
    q, packed, scales, w, _, _ = _ws_index_case(2, 40000, seed=5)
    q, w = q[:1], w[:1]
    assert indexer.WS_MIN_KEYS <= 40000
    long = indexer.index_scores_fp4(q, packed, scales, w, mma="ws")
    routes.reset()
    assert torch.equal(indexer.index_scores_fp4(q, packed, scales, w), long)
    assert routes.counts("index_scores_fp4") == {"ws": 1}
    fp8 = indexer.index_scores_fp4(q.expand(2, -1, -1), packed, scales, w.expand(2, -1), mma="fp8")
    assert torch.equal(indexer.index_scores_fp4(q.expand(2, -1, -1), packed, scales, w.expand(2, -1)), fp8)
    short = min(indexer.WS_MIN_KEYS, indexer.FP8_MMA_MIN_KEYS) - 1
    assert torch.equal(indexer.index_scores_fp4(q, packed[:short], scales[:short], w),
                       indexer.index_scores_fp4(q, packed[:short], scales[:short], w, mma="bf16"))
    assert routes.counts("index_scores_fp4") == {"ws": 1, "fp8": 2, "bf16": 2}
    assert indexer.WS_MIN_KEYS_QUERIES > 40000
    more = torch.cat([packed, packed[:indexer.WS_MIN_KEYS_QUERIES - 40000]])
    more_scales = torch.cat([scales, scales[:indexer.WS_MIN_KEYS_QUERIES - 40000]])
    two = indexer.index_scores_fp4(q.expand(2, -1, -1), more, more_scales, w.expand(2, -1))
    assert routes.counts("index_scores_fp4") == {"ws": 2, "fp8": 2, "bf16": 2}
    assert torch.equal(two, indexer.index_scores_fp4(q.expand(2, -1, -1), more, more_scales, w.expand(2, -1),
                                                     mma="ws"))
    ws = indexer.index_scores_fp4(q, packed, scales, w, mma="ws")
    out = torch.empty_like(ws)
    graph = torch.cuda.CUDAGraph()
    indexer.index_scores_fp4(q, packed, scales, w, mma="ws")  # compiled before capture
    with torch.cuda.graph(graph):
        out.copy_(indexer.index_scores_fp4(q, packed, scales, w, mma="ws"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ws)
    with pytest.raises(ValueError, match="1 to 4 queries"):
        indexer.index_scores_fp4(q.expand(5, -1, -1), packed, scales, w.expand(5, -1), mma="ws")
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        indexer.index_scores_fp4(q, packed.view(-1)[8:8 + 39999 * 64].view(39999, 64), scales[1:], w, mma="ws")

# ---------------------------------------------------------------------------------------------------------------
# RMSNorm (+ FP8 quantization)
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def norm_cases(draw):
    n = draw(st.sampled_from((1, 2, 3, 5, 8, 1024)))  # 1024: the prefill launch (2 rows per program)
    d = draw(st.sampled_from((128, 512, 1024, 4096, 7168)))
    g = _gen(draw)
    scales = torch.exp2(torch.empty(n, 1).uniform_(-10, 10, generator=g))
    x = torch.randn(n, d, generator=g) * scales
    if draw(st.integers(0, 4)) == 4:
        x[int(torch.randint(0, n, (1,), generator=g))] = 0.0
    if draw(st.integers(0, 4)) == 4:
        x.view(-1)[int(torch.randint(0, n * d, (1,), generator=g))] = math.nan
    w = torch.randn(d, generator=g) * draw(st.sampled_from((0.1, 1.0, 30.0)))
    # the launch variants: the default (1024 rows of d = 4096 / 7168: persistent), one-shot with 2 rows per program
    # with and without cache hints, persistent with 2 rows per loop step (ragged tails at odd n)
    cfg = draw(st.sampled_from(({}, {"rows": 2, "stream": True}, {"rows": 2, "num_warps": 4, "stream": False},
                                {"per_sm": 1, "rows": 2, "num_warps": 8}, {"per_sm": 0})))
    return x.to(BF16), w, cfg


@PROPS
@given(case=norm_cases())
def test_rms_norm_fp8_quantizer_is_bit_exact(case):
    x, w, cfg = case
    codes, sbytes, y = rms_norm.rms_norm_fp8_cuda(x.to(CUDA), w.to(CUDA), 1e-6, return_y=True, **cfg)
    codes, sbytes, y = codes.cpu(), sbytes.cpu(), y.cpu()
    ref_codes, ref_bytes = quantize_fp8(y, 128)
    assert torch.equal(sbytes, ref_bytes)
    assert _same(codes.float(), ref_codes.float())
    assert torch.equal(rms_norm.rms_norm_fp8_cuda(x.to(CUDA), w.to(CUDA), 1e-6, **cfg)[0].cpu().view(torch.uint8),
                       codes.view(torch.uint8))
    emulated = ops.rms_norm(x, w, 1e-6)
    ulp = emulated.double().abs() * 2.0**-7
    ok = ((y.double() - emulated.double()).abs() <= ulp) | (y.isnan() & emulated.isnan())
    assert bool(ok.all())
    same = (emulated.view(torch.int16) == y.view(torch.int16)) | (y.isnan() & emulated.isnan())
    assert float(same.float().mean()) >= 0.99


@pytest.mark.parametrize("d", [4096, 7168])
def test_rms_norm_prefill_launch_is_within_one_ulp_of_the_emulation(d):
    """2 rows per program (the prefill launch; 4 warps at d = 4096, 8 at 7168): only the fp32 summation order of
    the mean differs from torch, so y is within one bf16 ulp and almost always equal."""
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(1024, d, generator=g) * 5).to(BF16).to(CUDA)
    w = torch.randn(d, generator=g).to(CUDA)
    y, ref = rms_norm.rms_norm_cuda(x, w, 1e-6).double(), ops.rms_norm(x, w, 1e-6).double()
    assert bool(((y - ref).abs() <= ref.abs() * 2.0**-7).all())
    assert float((y == ref).float().mean()) >= 0.999


@pytest.mark.parametrize("n, d, rows, warps", [(1031, 7168, 1, 8), (1031, 4096, 1, 4), (1031, 4096, 2, 8),
                                                (300, 512, 4, 4)])
def test_rms_norm_fp8_persistent_launch_gives_the_one_shot_bits(n, d, rows, warps):
    """The persistent kernel (programs looping over row groups, next group loaded ahead) runs the one-shot kernel's
    arithmetic on the same tiles: codes, scale bytes and y are bit-identical, ragged last group included."""
    g = torch.Generator().manual_seed(n + d)
    x = (torch.randn(n, d, generator=g) * 4).to(BF16).to(CUDA)
    w = torch.randn(d, generator=g).to(CUDA)
    one = rms_norm.rms_norm_fp8_cuda(x, w, 1e-6, True, rows=rows, num_warps=warps, per_sm=0, stream=True)
    for per_sm in (1, 2):
        got = rms_norm.rms_norm_fp8_cuda(x, w, 1e-6, True, rows=rows, num_warps=warps, per_sm=per_sm, stream=True)
        assert torch.equal(got[0].view(torch.uint8), one[0].view(torch.uint8))
        assert torch.equal(got[1], one[1]) and torch.equal(got[2].view(torch.int16), one[2].view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# mHC pre
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize(("n", "cfg"), [(37, {"precision": "tf32x3"}), (37, {"splits": 1, "precision": "tf32x3"}),
                                        (300, {"precision": "ieee"}), (5, {"splits": 7, "precision": "ieee"}),
                                        (37, {"precision": "bf16x3"}), (5, {"splits": 7, "precision": "bf16x3"}),
                                        (300, {"precision": "bf16x3", "bt": 64, "splits": 2, "num_warps": 8}),
                                        (300, {"precision": "bf16x3", "bt": 64, "splits": 1, "num_warps": 8}),
                                        (1100, {})])
def test_hc_pre_at_model_width(dim, n, cfg):
    """Each precision and launch (fused, split-K) against the emulation; ``{}`` is the default launch."""
    g = torch.Generator().manual_seed(dim + n)
    x = torch.randn(n, 4, dim, generator=g).to(BF16)
    fn = torch.randn(24, 4 * dim, generator=g) * (4 * dim) ** -0.5
    scale, base = torch.rand(3, generator=g) * 2, torch.randn(24, generator=g)
    found = mhc.hc_pre_cuda(x.to(CUDA), fn.to(CUDA), scale.to(CUDA), base.to(CUDA), 1e-6, 20, 1e-6, **cfg)
    emulated = ops.hc_pre(x, fn, scale, base, 1e-6, 20, 1e-6)
    assert float(_row_calc_diff(found[0].cpu(), emulated[0]).max()) <= (1.25 * 2.0**-8) ** 2 / 2
    for f, e in zip(found[1:], emulated[1:], strict=True):
        assert float(((f.cpu() - e).abs() / e.abs().clamp(min=1e-30)).max()) <= 2.0**-12  # 2 x (2^-14 vs fp64)
    again = mhc.hc_pre_cuda(x.to(CUDA), fn.to(CUDA), scale.to(CUDA), base.to(CUDA), 1e-6, 20, 1e-6, **cfg)
    assert all(torch.equal(a, b) for a, b in zip(found, again, strict=True))  # deterministic (no atomics)
    check_case("hc_pre", mhc.hc_pre, Case({"x": x[:4], "fn": fn, "scale": scale, "base": base, "norm_eps": 1e-6,
                                           "iters": 20, "hc_eps": 1e-6}), device=CUDA)


def test_hc_pre_fp32_streams_default_to_tf32x3_and_refuse_bf16x3():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 4, 512, generator=g)
    fn = torch.randn(24, 4 * 512, generator=g) * 2048**-0.5
    scale, base = torch.rand(3, generator=g) * 2, torch.randn(24, generator=g)
    args = (fn.to(CUDA), scale.to(CUDA), base.to(CUDA), 1e-6, 20, 1e-6)
    found = mhc.hc_pre_cuda(x.to(CUDA), *args)
    assert all(torch.equal(a, b) for a, b in zip(found, mhc.hc_pre_cuda(x.to(CUDA), *args, precision="tf32x3"),
                                                 strict=True))
    for f, e in zip(found[1:], ops.hc_pre(x, fn, scale, base, 1e-6, 20, 1e-6)[1:], strict=True):
        assert float(((f.cpu() - e).abs() / e.abs().clamp(min=1e-30)).max()) <= 2.0**-12
    with pytest.raises(ValueError, match="precision 'bf16x3' takes bf16 streams, found torch.float32"):
        mhc.hc_pre_cuda(x.to(CUDA), *args, precision="bf16x3")


# ---------------------------------------------------------------------------------------------------------------
# mHC post, KV path (norm + RoPE + FP8)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [4096, 7168, 100])
@pytest.mark.parametrize(("n", "res_dtype"), [(1, BF16), (37, BF16), (300, torch.float32)])
def test_hc_post_at_model_width(dim, n, res_dtype):
    g = torch.Generator().manual_seed(dim * 7 + n)
    f = torch.randn(n, dim, generator=g).to(BF16)
    res = (torch.randn(n, 4, dim, generator=g) * 3).to(res_dtype)
    post = torch.rand(n, 4, generator=g) * 2
    comb = torch.rand(n, 4, 4, generator=g)
    comb = comb / comb.sum(-1, keepdim=True)
    found = mhc.hc_post_cuda(f.to(CUDA), res.to(CUDA), post.to(CUDA), comb.to(CUDA), res_dtype).cpu()
    emulated = ops.hc_post(f, res, post, comb, res_dtype)
    assert found.dtype == res_dtype and found.shape == (n, 4, dim)
    # one output rounding (bf16: up to an ulp, 2^-7 relative, where fp32 FMA contraction moves the value across a
    # rounding boundary) plus fp32 rounding of the five terms (cancellation makes relative error meaningless)
    terms = (post[..., None] * f.double()[:, None]).abs() + (comb[..., None] * res.double()[:, :, None]).abs().sum(1)
    ulp = 2.0**-7 if res_dtype == BF16 else 2.0**-23
    bound = ulp * emulated.double().abs() + 8 * 2.0**-24 * terms
    assert bool(((found.double() - emulated.double()).abs() <= bound).all())
    if res_dtype == BF16:  # fp32 streams keep the fp32 summation-order differences
        assert float((found == emulated).float().mean()) >= 0.99
    check_case("hc_post", mhc.hc_post, Case({"f": f[:4, :64], "residual": res[:4, :, :64].to(BF16),
                                             "post": post[:4], "comb": comb[:4]}), device=CUDA)


@st.composite
def kv_cases(draw):
    n = draw(st.integers(1, 40))
    g = _gen(draw)
    x = (torch.randn(n, 512, generator=g) * draw(st.sampled_from((0.01, 1.0, 50.0)))).to(BF16)
    w = torch.randn(512, generator=g) * draw(st.sampled_from((0.1, 1.0, 8.0)))
    t0 = draw(st.sampled_from((0, 127, 128, 4095, 131071, 1 << 20)))
    positions = torch.arange(n) * draw(st.sampled_from((1, 4, 128))) + t0
    freqs = 1.0 / (10000.0 ** (torch.arange(32) / 32))
    return x, w, positions, freqs


@PROPS
@given(case=kv_cases())
def test_kv_norm_rope_fp8_matches_the_three_emulated_ops(case):
    x, w, positions, freqs = case
    args = (x.to(CUDA), w.to(CUDA), 1e-6, positions.to(CUDA), freqs.to(CUDA))
    rotated = kv_path.kv_norm_rope_fp8(*args, fmt="bf16").cpu()
    emulated = ops.apply_rope(ops.rms_norm(x, w, 1e-6), positions, freqs)
    row_max = emulated.double().abs().amax(-1, keepdim=True)
    assert bool(((rotated.double() - emulated.double()).abs() <= 2.0**-7 * row_max).all())
    assert float((rotated == emulated).float().mean()) >= 0.99
    kv, packed = kv_path.kv_norm_rope_fp8(*args, pack=True)
    kv, packed = kv.cpu(), packed.cpu()
    assert torch.equal(kv.view(torch.int16), ops.kv_round(rotated, 64, "fp8").view(torch.int16))  # bit-exact round
    codes, scales = quantize_fp8(rotated[:, :448], 64)  # act_quant's own scales (re-packing kv can halve one)
    expected = torch.cat((codes.view(torch.uint8), rotated[:, 448:].contiguous().view(torch.uint8), scales,
                          torch.zeros(len(kv), 1, dtype=torch.uint8)), dim=1)
    assert torch.equal(packed, expected)
    assert torch.equal(sparse_attention.unpack_kv_fp8(packed).view(torch.int16), kv.view(torch.int16))
    assert torch.equal(kv_path.kv_norm_rope_fp8(*args).cpu().view(torch.int16), kv.view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# FP8 activation quantization (act_linear, kv_round)
# ---------------------------------------------------------------------------------------------------------------


@PROPS
@given(case=norm_cases(), block=st.sampled_from((64, 128)), rows=st.sampled_from((1, 2)))
def test_fake_quant_fp8_is_bit_exact(case, block, rows):
    x, w, _ = case
    x = (x.float() * w.abs()).to(BF16)  # spread magnitudes across blocks; NaN rows / zero rows as drawn
    found = act_quant.fake_quant_fp8(x.to(CUDA), block, rows=rows).cpu()
    assert _same(found, fake_quant_fp8(x, block))
    kv = x[:, :512] if x.shape[1] >= 512 else None
    if kv is not None:
        assert _same(act_quant.kv_round_cuda(kv.to(CUDA), 64, "fp8").cpu(), ops.kv_round(kv, 64, "fp8"))


@pytest.mark.parametrize(("n", "k", "m"), [(1, 4096, 1024), (1, 1024, 32768 // 8), (7, 2048, 4096), (64, 8192, 512)])
def test_act_linear_equals_the_emulation_on_the_gpu(n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    x = (torch.randn(n, k, generator=g) * 3).to(BF16).to(CUDA)
    w = (torch.randn(m, k, generator=g) * k**-0.5).to(CUDA)
    assert torch.equal(act_quant.act_linear_cuda(x, w).view(torch.int16), ops.act_linear(x, w).view(torch.int16))
    assert torch.equal(act_quant.act_linear_cuda(x, w, "bf16"), ops.act_linear(x, w, "bf16"))


@pytest.mark.parametrize(("shape", "dtype"), [((16, 2048, 4096), torch.float32), ((3, 5, 7001), BF16), ((2, 0), BF16)])
def test_take_copies_the_slice_a_device_index_names(shape, dtype):
    stack = torch.randn(shape, device=CUDA).to(dtype)
    for i in (0, shape[0] - 1):
        got = take.take(stack, torch.tensor([i], device=CUDA))
        assert got.is_contiguous() and torch.equal(got, stack[i])
    with pytest.raises(ValueError, match="one-element index"):
        take.take(stack, torch.tensor([0, 1], device=CUDA))


# ---------------------------------------------------------------------------------------------------------------
# decode-step element-wise kernels (indexer_round, apply_rope): the emulation's bits on the GPU
# ---------------------------------------------------------------------------------------------------------------


def _decode_rows(g: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 rows of shape ``shape`` with magnitudes 2^-30..2^30 per row."""
    return (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-30, 31, (*shape[:-1], 1), generator=g))).to(
        BF16)


@pytest.mark.parametrize("shape", [(1, 64, 128), (1, 128), (4, 64, 128), (3, 512)])
@pytest.mark.parametrize("rotate", [True, False])
def test_indexer_round_kernel_gives_the_emulations_bits_on_the_gpu(shape, rotate):
    from fidelity.decoders.production.kernels.indexer_round import indexer_round_cuda

    x = _decode_rows(torch.Generator().manual_seed(sum(shape)), *shape).to(CUDA)
    x.view(-1, shape[-1])[0, :32] = -0.0
    want = ops.indexer_round(x, "fp4", rotate)  # the torch emulation on the same device
    assert torch.equal(indexer_round_cuda(x, "fp4", rotate).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("shape", [(1, 64, 512), (1, 512), (1, 64, 128), (1, 128), (5, 8, 512)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_kernel_gives_the_emulations_bits_on_the_gpu(shape, inverse):
    from fidelity.decoders.production.kernels.rope import apply_rope_cuda

    g = torch.Generator().manual_seed(sum(shape) + inverse)
    x = _decode_rows(g, *shape).to(CUDA)
    freqs = (torch.rand(32, generator=g) * torch.exp2(-torch.arange(32) / 2)).to(CUDA)
    positions = torch.randint(0, 2**20, (shape[0],), generator=g).to(CUDA)
    want = ops.apply_rope(x, positions, freqs, inverse)
    assert torch.equal(apply_rope_cuda(x, positions, freqs, inverse).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 1024), (2, 1024, 4096), (1, 2048, 512)])
def test_decode_gemvs_quantizing_in_their_launch_give_the_bits_of_a_separate_quantization(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, k), generator=g))).to(BF16).to(CUDA)
    codes = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn).to(CUDA)
    scales = torch.exp2(torch.randint(-8, 2, ((n + 127) // 128, k // 128), generator=g).float()).to(CUDA)
    want = weight_gemv.fp8_weight_linear(fake_quant_fp8(x, 128), codes, scales)  # formats' quantizer (torch)
    assert torch.equal(weight_gemv.fp8_weight_linear_cuda(x, codes, scales), want)
    packed = torch.randint(0, 256, (4, n, k // 2), generator=g, dtype=torch.uint8).to(CUDA)
    fp4_scales = torch.exp2(torch.randint(-8, 2, (4, n, k // 32), generator=g).float()).to(CUDA)
    picks = torch.tensor([3, 1, 3][: max(m, 2)], device=CUDA)
    xs = x[torch.arange(len(picks), device=CUDA) % m]
    want = weight_gemv.fp4_expert_linear(fake_quant_fp8(xs, 128), picks, packed, fp4_scales)
    assert torch.equal(weight_gemv.fp4_picked_linear_cuda(xs, picks, packed, fp4_scales), want)


@pytest.mark.parametrize(("ratio", "n_comp"), [(0, 0), (4, 512), (128, 1025)])
def test_decode_slots_kernel_gives_the_references_rows_and_local_indices(ratio, n_comp):
    from fidelity.decoders.production.decode_slots import decode_slots_reference
    from fidelity.decoders.production.kernels.decode_slots import decode_slots_cuda

    g = torch.Generator().manual_seed(ratio)
    for t in (0, 3, 126, 127, 128, 2047, 131071):
        pos = torch.tensor([t], device=CUDA)
        picks = torch.randperm(4 * n_comp, generator=g)[:n_comp][None].to(CUDA) if ratio == 4 else None
        want = decode_slots_reference(pos, picks, 128, ratio, n_comp)
        got = decode_slots_cuda(pos, picks, 128, ratio, n_comp)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), t


def test_gate_kernel_picks_the_emulations_experts_at_flash_width():
    from fidelity.decoders.production.kernels.gate import gate_cuda
    from fidelity.model.config import ModelConfig

    cfg = ModelConfig.preset("flash")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, cfg.dim, generator=g).to(BF16).float().to(CUDA)
    weight = (torch.randn(cfg.n_routed_experts, cfg.dim, generator=g) * cfg.dim**-0.5).to(CUDA)
    bias = (torch.randn(cfg.n_routed_experts, generator=g) * 0.1).to(CUDA)
    ids = torch.arange(8, device=CUDA)
    want_w, want_e = ops.gate(x, weight, bias, None, ids, cfg)
    got_w, got_e = gate_cuda(x, weight, bias, None, ids, cfg)
    assert torch.equal(got_e, want_e)  # distinct scores: the same experts in the same (descending) order
    torch.testing.assert_close(got_w, want_w, rtol=4 * 2.0**-24, atol=0)


@pytest.mark.parametrize(("ratio", "d"), [(4, 512), (4, 128), (128, 512)])
def test_compressor_decode_kernel_follows_the_emulation_over_consecutive_positions(ratio, d):
    """Both carries step by step from one fresh carry: the carried rows stay bit-equal (copies and one fp32 add), the
    entries where a block completes agree to the bf16 roundings (the contract pins them against the oracle)."""
    from fidelity.decoders.production.kernels.compressor import compressor_decode_cuda
    from fidelity.decoders.production.rope_freqs import rope_inv_freq
    from fidelity.model.config import ModelConfig

    coff = 2 if ratio == 4 else 1
    w, g = coff * d, torch.Generator().manual_seed(ratio + d)
    ape = torch.randn(ratio, w, generator=g).to(CUDA) * 0.5
    norm = (1 + 0.1 * torch.randn(d, generator=g)).to(CUDA)
    freqs = rope_inv_freq(ModelConfig.preset("flash"), ratio).to(CUDA)
    carries = [(torch.zeros(coff * ratio, w, device=CUDA), torch.full((coff * ratio, w), float("-inf"), device=CUDA))
               for _ in range(2)]
    for t in range(3 * ratio):
        kv, score = (torch.randn(1, w, generator=g) * 4).to(CUDA), (torch.randn(1, w, generator=g) * 3).to(CUDA)
        pos = torch.tensor([t], device=CUDA)
        want = ops.compressor_decode(kv, score, ape, *carries[0], pos, norm, freqs, 1e-6)
        got = compressor_decode_cuda(kv, score, ape, *carries[1], pos, norm, freqs, 1e-6)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), t
        if t % ratio == ratio - 1:
            cos = torch.nn.functional.cosine_similarity(got[0].double(), want[0].double(), dim=-1)
            assert cos.item() > 1 - 1e-4, (t, cos.item())


def test_rms_norm_weightless_kernel_rounds_as_the_bf16_emulation():
    from fidelity.decoders.production.kernels.rms_norm import rms_norm_weightless_cuda

    q = (torch.randn(2, 64, 512, generator=torch.Generator().manual_seed(0)) * 3).to(BF16).to(CUDA)
    same = rms_norm_weightless_cuda(q, 1e-6) == ops.rms_norm_weightless(q, 1e-6)
    assert same.float().mean().item() >= 0.999  # the mean's fp32 sum order may flip a bf16 rounding
