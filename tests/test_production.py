"""The production decoder (``fidelity.decoders.production``): official numerics per precision profile vs the fp32
oracle, incremental decode vs its own prefill, preallocated caches, visibility, op-level numerics, profiles.

Bounds are stated a little below measured values (torch 2.13 CPU, 2 and 1 threads; synthetic weights with the
shared-expert outlier channels); each docstring gives the measurement. Prompts are 256 tokens or fewer: the
module runs in ~30 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fidelity.decoders.base import ContextError
from fidelity.decoders.production import PROFILES, ProductionModel, ProductionSession, get_profile, ops
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.faults import inject
from fidelity.decoders.production.graph_decode import GraphDecodeSession
from fidelity.decoders.production.profiles import load_profile
from fidelity.decoders.production.registry import implementations_used
from fidelity.decoders.production.shapes import hca_prefill_idx, window_prefill_idx
from fidelity.model.config import ModelConfig
from fidelity.model.formats import dequantize_fp8, quantize_fp8
from fidelity.model.sites import Recorder, site_template
from fidelity.model.synthesize import synthesize
from oracles import OracleModel
from oracles import attention as oracle_attention
from oracles.moe import gate as oracle_gate

BF16 = torch.bfloat16
TINY = ModelConfig.preset("tiny")
# No discrete selection can flip: every compressed entry is selected (64 <= 128 at 256 tokens), every expert is
# active, no hash layers. What remains between profiles / the oracle is rounding only.
FLIP_FREE = TINY.replace(vocab_size=1024, n_hash_layers=0, n_routed_experts=4, n_activated_experts=4, index_topk=128)
# SWA + HCA only, narrow: visibility does not depend on the width
VIS = TINY.replace(
    vocab_size=256, dim=128, n_layers=2, compress_ratios=(0, 128), n_hash_layers=0, n_heads=2, o_groups=1,
    q_lora_rank=128, o_lora_rank=128, moe_inter_dim=128, n_routed_experts=2, n_activated_experts=1,
)  # fmt: skip
T = 256
SWA_HASHED = VIS.replace(compress_ratios=(0, 0), n_hash_layers=2)  # no compressed layer, no score-routed layer


def _ids(cfg: ModelConfig, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine (leading dim = positions), float64."""
    return F.cosine_similarity(a.double().flatten(1), b.double().flatten(1), dim=-1)


def _decode(session: ProductionSession, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """Prefill ids[:n_prefill], then one step per remaining id -> logits [len(ids), vocab]."""
    out = [session.prefill(ids[:n_prefill])]
    return torch.cat(out + [session.step(int(t))[None] for t in ids[n_prefill:]])


def _cache_tensors(session: ProductionSession) -> dict[str, torch.Tensor]:
    """Every tensor the session's layer caches hold (KV / key stores, carries, gather buffers), by path."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(session.layers):
        for name, obj in vars(layer).items():
            if isinstance(obj, torch.Tensor):
                out[f"{i}.{name}"] = obj
            elif isinstance(obj, (list, tuple)):
                out.update({f"{i}.{name}[{j}]": t for j, t in enumerate(obj) if isinstance(t, torch.Tensor)})
            elif obj is not None and hasattr(obj, "__dict__"):
                out.update({f"{i}.{name}.{k}": t for k, t in vars(obj).items() if isinstance(t, torch.Tensor)})
    return out


@pytest.fixture(scope="module")
def tiny():
    return synthesize(TINY, seed=0)


@pytest.fixture(scope="module")
def flip_free():
    return synthesize(FLIP_FREE, seed=0)


@pytest.fixture(scope="module")
def tiny_decoded(tiny):
    """profile -> logits of prefill 250 + 8 decode steps on tiny (memoized)."""
    memo: dict[str, torch.Tensor] = {}

    def run(profile: str) -> torch.Tensor:
        if profile not in memo:
            memo[profile] = _decode(ProductionModel(tiny, profile, max_context=258).session(), _ids(TINY, 258), 250)
        return memo[profile]

    return run


@pytest.fixture(scope="module")
def vis_ckpt():
    return synthesize(VIS, seed=0)


@pytest.fixture(scope="module")
def tiny_oracle(tiny):
    rec = Recorder([r"L\d+\.residual"])
    return OracleModel(tiny).logits(_ids(TINY, T), rec), rec


# ---- profiles that change storage only --------------------------------------------------------------------
@pytest.mark.parametrize(("profile", "base"), [("fp8-kv-storage", "reference"), ("fp4-indexer-packed", "reference"),
                                               ("fp8-indexer:indexer_storage=packed", "fp8-indexer")])
def test_packed_storage_is_bit_identical(tiny, tiny_decoded, profile, base):
    """FP8 KV rows (packed e4m3 codes + ue8m0 scales + bf16 rope) and packed FP4 / FP8 indexer keys hold exactly
    the values the bf16 rows hold (already FP8 / FP4 grid values), so logits are bit-identical in prefill and in decode
    (prefill 250, then 8 steps across a CSA entry and the HCA entry completed at position 255)."""
    packed = ProductionModel(tiny, profile, max_context=258).session()
    assert packed.cache_bytes() < ProductionModel(tiny, base, max_context=258).session().cache_bytes()
    assert torch.equal(_decode(packed, _ids(TINY, 258), 250), tiny_decoded(base))
    if profile == "fp4-indexer-packed":  # scored straight from the packed codes, not from dequantized rows
        assert implementations_used().get("index_scores_fp4") == "cpu"
    if profile == "fp8-kv-storage":  # decode attends the packed rows in place, not a gathered bf16 copy
        assert implementations_used().get("sparse_attention_fp8kv") == "cpu"


def test_packed_fp8_rows_are_attended_in_place_with_the_gather_paths_bits(tiny):
    """``kv_storage=fp8`` decode reads the packed rows where they lie: no bf16 gather workspace is allocated (an
    FMHA that rounds its inputs still gathers), and the logits equal those of the gather path (rows dequantized
    into a bf16 buffer, which the ``decode-buffer-kept`` fault still takes) bit for bit."""
    ids = _ids(TINY, 140)
    assert ProductionModel(tiny, "fp8-fmha:kv_storage=fp8", max_context=140).session().layers[0].gather.shape[0]
    runs = []
    for faults in ((), ("decode-buffer-kept",)):
        session = ProductionModel(tiny, "fp8-kv-storage", max_context=140).session()
        assert all(layer.gather.shape[0] == 0 for layer in session.layers)
        session.prefill(ids[:128])
        with inject(*faults):
            runs.append(torch.stack([session.step(int(t)) for t in ids[128:]]))
    assert torch.equal(runs[0], runs[1])


# ---- production vs the fp32 oracle --------------------------------------------------------------------------
def test_bf16_profile_matches_oracle_without_discrete_flips(flip_free):
    """Profile bf16 (no FP8/FP4 anywhere; bf16 storage and GEMM outputs) on the flip-free config: every
    position's logits cos >= 0.9995 (measured, 2 / 1 threads: min 0.999757 / 0.999762, mean 0.999929)."""
    ids = _ids(FLIP_FREE, T)
    cos = _cos(ProductionModel(flip_free, "bf16", max_context=T).logits(ids), OracleModel(flip_free).logits(ids))
    assert float(cos.min()) >= 0.9995


def test_bf16_profile_matches_oracle_on_tiny(tiny, tiny_oracle):
    """Profile bf16 on the tiny default: last-position logits cos >= 0.999 (measured 0.999949 / 0.999947 with
    2 / 1 threads). Earlier positions can be far off (min 0.86): index top-k and routing near-ties flip there
    (see the decode test)."""
    logits = ProductionModel(tiny, "bf16", max_context=T).logits(_ids(TINY, T))
    assert float(_cos(logits[-1:], tiny_oracle[0][-1:])) >= 0.999


# measured mean-over-positions cos of L{i}.residual, reference vs fp32 oracle, 256 tokens (seeds 0 / 1 / 2):
#   L0 .99913/.99918/.99921  L1 .99832/.99844/.99818  L2 .99745/.99760/.99707
#   L3 .99490/.99476/.99416  L4 .99099/.99198/.99070  L5 .98743/.98910/.98677
# (1 thread: within 0.0005 of these, lowest L3 .99397, L4 .99030, L5 .98648 on seed 2)
REFERENCE_LAYER_COS = (0.9985, 0.997, 0.995, 0.990, 0.984, 0.978)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_profile_per_layer_cosine(tiny, tiny_oracle, seed):
    """Profile reference (official QAT numerics) stays within REFERENCE_LAYER_COS of the oracle per layer
    (residual streams, mean over 256 positions). Layers 0-2 use hash routing; from layer 3 on, biased top-2
    routing and the layer-2 index top-k flip on near-ties, so the per-position minimum drops to ~0.86-0.93
    while the mean stays >= 0.986. Measured values in the comment above."""
    ckpt = tiny if seed == 0 else synthesize(TINY, seed=seed)
    ids = _ids(TINY, T, seed)
    if seed == 0:
        oracle = tiny_oracle[1]
    else:
        oracle = Recorder([r"L\d+\.residual"])
        OracleModel(ckpt).logits(ids, oracle)
    prod = Recorder([r"L\d+\.residual"])
    ProductionModel(ckpt, "reference", max_context=T).logits(ids, prod)
    got = [float(_cos(prod.get(f"L{i}.residual"), oracle.get(f"L{i}.residual")).mean()) for i in range(TINY.n_layers)]
    assert all(g >= b for g, b in zip(got, REFERENCE_LAYER_COS, strict=True)), got


# ---- incremental decode vs the model's own prefill ------------------------------------------------------------
@pytest.mark.parametrize(("profile", "bound"), [("reference", 0.98), ("bf16", 0.9995)])
def test_decode_matches_own_prefill(flip_free, profile, bound):
    """Prefill 232 tokens then 24 decode steps (ring wrap, CSA entries, the HCA entry at 255) vs one prefill
    of all 256, flip-free config: min logits cos >= bound (measured, 2 / 1 threads: reference 0.988819 / 0.986270, bf16
    0.999749 / 0.999795).

    The difference is rounding only: a decode step runs [1, k] GEMMs where the prefill runs [T, k] ones, so
    fp32 accumulation order differs, some bf16 outputs round the other way, and FP8 activation quantization
    (reference) turns those 1-ulp changes into whole e4m3 steps, growing layer by layer. On the tiny default
    config the same comparison has occasional large per-position deviations (measured min: reference 0.943 / 0.976,
    bf16 0.99978): bf16 index scores tie or nearly tie at the top-k boundary and MoE routing scores nearly
    tie, so a rounding difference flips a discrete choice (another entry or expert), not just a low bit.
    """
    ids = _ids(FLIP_FREE, T)
    model = ProductionModel(flip_free, profile, max_context=T)
    full = model.logits(ids)
    inc = _decode(model.session(), ids, 232)
    assert float(_cos(inc[231:], full[231:]).min()) >= bound


# ---- caches ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["reference", "reference:kv_storage=fp8,indexer_storage=packed"])
def test_caches_allocated_once(flip_free, profile):
    """Every cache tensor keeps its storage (data_ptr) over prefill + 20 decode steps; cache_bytes constant."""
    session = ProductionModel(flip_free, profile, max_context=160).session()
    tensors = _cache_tensors(session)
    ptrs = {k: t.data_ptr() for k, t in tensors.items()}
    nbytes = session.cache_bytes()
    ids = _ids(FLIP_FREE, 160)
    session.prefill(ids[:140])
    after_prefill = {k: t.clone() for k, t in tensors.items()}
    for t in ids[140:]:
        session.step(int(t))
        now = _cache_tensors(session)
        assert now.keys() == ptrs.keys()
        assert {k: v.data_ptr() for k, v in now.items()} == ptrs
        assert session.cache_bytes() == nbytes
    assert any(not torch.equal(after_prefill[k], t) for k, t in tensors.items() if ".kv." in k)  # caches used


WIDE_PROMPT, WIDE_TOTAL = 200, 208  # 50-52 compressed entries visible: more than index_topk (32), under twice it


@pytest.mark.parametrize("profile", ["reference", "fp8-kv-storage"])
def test_a_wider_topk_injected_after_the_session_was_made_takes_effect_in_its_decode(tiny, profile):
    """Fault ``index-topk-hardcoded`` (top-k 2 * index_topk) injected once the session's decode buffers are sized
    for index_topk: its decode steps attend every visible entry as a session made under the fault does (the
    buffers re-sized once, to the wider top-k), where they used to crash; without the fault nothing re-sizes."""
    ids = _ids(TINY, WIDE_TOTAL)
    clean = ProductionModel(tiny, profile, max_context=WIDE_TOTAL).session()
    late = ProductionModel(tiny, profile, max_context=WIDE_TOTAL).session()
    with inject("index-topk-hardcoded"):  # sized for the wider top-k from the start
        early = ProductionModel(tiny, profile, max_context=WIDE_TOTAL).session()
    width = {i: layer.slots.shape[1] for i, layer in enumerate(late.layers)}
    runs = {}
    for name, s in (("clean", clean), ("late", late), ("early", early)):
        s.prefill(ids[:WIDE_PROMPT])
        with inject(*(("index-topk-hardcoded",) if name != "clean" else ())):
            runs[name] = torch.stack([s.step(int(t)) for t in ids[WIDE_PROMPT:]])
    assert torch.equal(runs["late"], runs["early"])
    assert not torch.equal(runs["late"], runs["clean"])  # the fault shows in these steps
    assert {i: layer.slots.shape[1] for i, layer in enumerate(clean.layers)} == width
    grown = {i for i, layer in enumerate(late.layers) if layer.slots.shape[1] != width[i]}
    assert grown == {i for i, kind in enumerate(TINY.layer_kinds) if kind == "csa"}
    assert all(late.layers[i].slots.shape == early.layers[i].slots.shape for i in grown)


def test_a_wider_topk_is_recorded_whole_at_the_indexer_topk_site(tiny):
    """Under ``index-topk-hardcoded`` the decoder's ``indexer.topk`` records hold every pick it made (50-52 of the
    up to 64 columns here), where they used to be cut to index_topk (32) columns."""
    ids, rec = _ids(TINY, WIDE_TOTAL), Recorder([r"L\d+\.indexer\.topk"])
    with inject("index-topk-hardcoded"):
        session = ProductionModel(tiny, "reference", max_context=WIDE_TOTAL).session(rec)
        session.prefill(ids[:WIDE_PROMPT])
        session.step(int(ids[WIDE_PROMPT]))
    assert rec.records
    for site, records in rec.records.items():
        for _, picks in records:
            assert picks.shape[1] >= TINY.index_topk, site
        assert int((records[-1][1] >= 0).sum(-1).max()) > TINY.index_topk, site  # the decode step's 51 picks


def _snapshot(session: ProductionSession) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in _cache_tensors(session).items()}


def _unchanged(session: ProductionSession, snap: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, snap[k]) for k, t in _cache_tensors(session).items())


def test_context_overflow_raises_before_state_changes(flip_free):
    model = ProductionModel(flip_free, "reference", max_context=130)
    ids = _ids(FLIP_FREE, 131)
    session = model.session()
    snap = _snapshot(session)
    with pytest.raises(ContextError, match="0 \\+ 131 tokens exceeds max_context 130"):
        session.prefill(ids)
    assert session.pos == 0 and _unchanged(session, snap)
    session.prefill(ids[:129])
    session.step(int(ids[129]))  # position 129: the last that fits
    snap, pos = _snapshot(session), session.pos
    with pytest.raises(ContextError, match="max_context 130"):
        session.step(int(ids[130]))
    assert session.pos == pos == 130 and _unchanged(session, snap)


def test_bad_calls_raise_without_state_change(flip_free):
    session = ProductionModel(flip_free, "reference", max_context=64).session()
    ids = _ids(FLIP_FREE, 8)
    with pytest.raises(ValueError, match="decode: expected one token after a prefill"):
        session.step(5)
    with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 1024\), found \[2, 1024\]"):
        session.prefill(torch.tensor([2, 1024]))
    with pytest.raises(ValueError, match="expected at least one token"):
        session.prefill(torch.tensor([], dtype=torch.long))
    assert session.pos == 0
    session.prefill(ids[:4])
    snap = _snapshot(session)
    with pytest.raises(ContextError, match="context: 4 \\+ 61 tokens exceeds max_context 64"):
        session.prefill(_ids(FLIP_FREE, 61))  # a prefill chunk past the caches
    with pytest.raises(ValueError, match=r"expected ids in \[0, 1024\), found \[-1, -1\]"):
        session.step(-1)
    assert session.pos == 4 and _unchanged(session, snap)


# ---- visibility: window ring + HCA entries --------------------------------------------------------------------
def _sets(visible: torch.Tensor, lo: int, hi: int | None = None) -> list[set[int]]:
    return [{int(v) for v in row[lo:hi] if v >= 0} for row in visible]


@pytest.mark.parametrize(("n_prefill", "n_total"), [(127, 127), (128, 128), (129, 129), (255, 255), (256, 256),
                                                    (257, 257), (126, 130), (254, 258)])
def test_visible_sets_match_oracle(vis_ckpt, n_prefill, n_total):
    """``L{i}.attn.visible`` equals the oracle's per query as sets and the rule: window {t-127 .. t} (incl.
    self), HCA entries {j < (t+1)//128}; prefill of 127-129 / 255-257 tokens and decode through them."""
    ckpt = vis_ckpt
    ids, win = _ids(VIS, n_total), VIS.window_size
    prod, orac = Recorder([r"L\d+\.attn\.visible"]), Recorder([r"L\d+\.attn\.visible"])
    _decode(ProductionModel(ckpt, "reference", max_context=n_total).session(prod), ids, n_prefill)
    oracle = OracleModel(ckpt).session(orac)
    oracle.prefill(ids[:n_prefill])
    for t in ids[n_prefill:]:
        oracle.step(int(t))
    for i in range(VIS.n_layers):
        p, o = prod.get(f"L{i}.attn.visible"), orac.get(f"L{i}.attn.visible")
        assert len(p) == len(o) == n_total
        assert _sets(p, 0, win) == _sets(o, 0, win) == [set(range(max(0, t - win + 1), t + 1)) for t in range(n_total)]
        if VIS.ratio(i):
            rule = [set(range((t + 1) // VIS.ratio(i))) for t in range(n_total)]
            assert _sets(p, win) == _sets(o, win) == rule


# ---- official numerics, op level ------------------------------------------------------------------------------
def _attention_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, 64, generator=g).to(BF16)
    kv = torch.randn(50, 64, generator=g).to(BF16)
    idx = torch.randint(0, 50, (3, 40), generator=g)
    idx[:, 30:] = -1
    return q, kv, idx, torch.randn(4, generator=g), 64**-0.5


def _one_block_attention(q, kv, idx, sink, scale, round_p: bool) -> torch.Tensor:
    """``sparse_attn`` for <= 64 indices (one online-softmax block): fp32 logits, P (optionally bf16) . V."""
    valid = idx >= 0
    rows = kv.float()[idx.clamp(min=0)] * valid.unsqueeze(-1)
    logits = torch.einsum("nhd,nbd->nhb", q.float(), rows) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = logits.amax(dim=-1)
    p = torch.exp(logits - m.unsqueeze(-1))
    total = p.sum(dim=-1) + torch.exp(sink.unsqueeze(0) - m)
    acc = torch.einsum("nhb,nbd->nhd", p.to(BF16).float() if round_p else p, rows)
    return (acc / total.unsqueeze(-1)).to(BF16)


def test_sparse_attention_rounds_p_to_bf16_before_pv():
    q, kv, idx, sink, scale = _attention_inputs()
    got = ops.sparse_attention(q, kv, idx, sink, scale)
    assert torch.equal(got, _one_block_attention(q, kv, idx, sink, scale, round_p=True))
    assert not torch.equal(got, _one_block_attention(q, kv, idx, sink, scale, round_p=False))
    exact = oracle_attention.sparse_attention(q.float(), kv.float()[idx.clamp(min=0)], idx >= 0, sink, scale)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-3)


def test_sparse_attention_sink_only_in_denominator():
    """The sink adds exp(sink - m) to the softmax denominator and has no value row: the output is the sink-free
    output scaled by Z / (Z + exp(sink)) per head, and a huge sink drives it to 0."""
    q, kv, idx, sink, scale = _attention_inputs(1)
    no_sink = ops.sparse_attention(q, kv, idx, torch.full((4,), float("-inf")), scale).float()
    with_sink = ops.sparse_attention(q, kv, idx, sink, scale).float()
    valid = idx >= 0
    logits = torch.einsum("nhd,nbd->nhb", q.float(), kv.float()[idx.clamp(min=0)]) * scale
    z = logits.masked_fill(~valid.unsqueeze(1), float("-inf")).exp().sum(-1)  # [n, H]
    torch.testing.assert_close(with_sink, no_sink * (z / (z + sink.exp())).unsqueeze(-1), rtol=2e-2, atol=1e-3)
    assert not torch.allclose(with_sink, no_sink, rtol=1e-2, atol=1e-3)
    huge = ops.sparse_attention(q, kv, idx, torch.full((4,), 60.0), scale).float()
    assert float(huge.abs().max()) < 1e-6 and float(no_sink.abs().max()) > 0.1


def test_act_linear_is_fp8_1x128_then_fp32_gemm():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 256, generator=g) * torch.logspace(-2, 1, 256)).to(BF16)
    w = torch.randn(64, 256, generator=g) / 16
    want = (dequantize_fp8(*quantize_fp8(x, 128), 128) @ w.T).to(BF16)
    assert torch.equal(ops.act_linear(x, w), want)
    assert not torch.equal(ops.act_linear(x, w), (x.float() @ w.T).to(BF16))
    assert torch.equal(ops.act_linear(x, w, "bf16"), (x.float() @ w.T).to(BF16))


def _expert_weights(tiny, layer: int, e: int):
    return [tiny[f"layers.{layer}.ffn.experts.{e}.{k}.weight"].float() for k in ("w1", "w2", "w3")]


def test_routing_weight_applied_before_w2(tiny):
    """w2's FP8 activation quantization sees the weighted h: weight before w2 != weight after w2 for 0.7; for a
    power of two the orders agree (pow2 ue8m0 scales shift with h: same e4m3 codes)."""
    x = (torch.randn(6, TINY.dim, generator=torch.Generator().manual_seed(0))).to(BF16)
    w1, w2, w3 = _expert_weights(tiny, 3, 0)
    limit = TINY.swiglu_limit

    def before(weight: torch.Tensor) -> torch.Tensor:
        g, u = ops.act_linear(x, w1).float(), ops.act_linear(x, w3).float()
        h = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
        return ops.act_linear((weight * h).to(BF16), w2)

    def after(weight: torch.Tensor) -> torch.Tensor:
        return (ops.expert(x, w1, w2, w3, limit, None, "fp8").float() * weight).to(BF16)

    for value in (0.7, 0.5):
        weight = torch.full((6, 1), value)
        got = ops.expert(x, w1, w2, w3, limit, weight, "fp8")
        assert torch.equal(got, before(weight))
        assert torch.equal(got, after(weight)) == (value == 0.5)


def test_session_moe_uses_before_w2_experts(tiny):
    """The production MoE (gate, routed experts with their weights before w2, shared expert, fp32 sum)."""
    layer, n = 3, 6  # a non-hash layer
    x = torch.randn(n, TINY.dim, generator=torch.Generator().manual_seed(1)).to(BF16)
    ids = torch.arange(2, 2 + n)
    got = ProductionModel(tiny).layer(layer).moe.forward(ProductionModel(tiny).session(), x, ids)
    p = f"layers.{layer}.ffn."
    weights, experts = oracle_gate(x.float(), tiny[p + "gate.weight"].float(), tiny[p + "gate.bias"].float(), None,
                                   ids, TINY)
    assert bool((torch.log2(weights).frac() != 0).all())  # no routing weight is a power of two
    y = torch.zeros(n, TINY.dim)
    y_after = torch.zeros(n, TINY.dim)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        w1, w2, w3 = _expert_weights(tiny, layer, e)
        wt = weights[rows, slot, None]
        y.index_add_(0, rows, ops.expert(x[rows], w1, w2, w3, TINY.swiglu_limit, wt, "fp8").float())
        y_after.index_add_(0, rows, ops.expert(x[rows], w1, w2, w3, TINY.swiglu_limit, None, "fp8").float() * wt)
    shared = [tiny[f"{p}shared_experts.{k}.weight"].float() for k in ("w1", "w2", "w3")]
    y_shared = ops.expert(x, *shared, TINY.swiglu_limit, None, "fp8").float()
    assert torch.equal(got, (y + y_shared).to(BF16))
    assert not torch.equal(got, (y_after + y_shared).to(BF16))


# ---- profiles -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_builtin_profile_runs(tiny, profile):
    ids = _ids(TINY, 153)
    session = ProductionModel(tiny, profile, max_context=153).session()
    logits = _decode(session, ids, 150)
    assert logits.shape == (153, TINY.vocab_size) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(("config", "profile", "graphs"), [
    ("tiny", "reference", False), ("tiny", "fp8-kv-storage", False), ("tiny", "fp8-kv-storage", True),
    ("swa-hashed", "fp8-kv-storage", False), ("swa-hashed", "reference", True)])
def test_sites_lists_exactly_the_sites_a_prefill_and_decode_record(tiny, config, profile, graphs):
    """``ProductionDecoder.sites()`` against the site names a real prefill and two decode steps record, per layer
    index dropped (``site_template``): no ``attn.kv_cache`` under bf16 KV storage, no indexer, compressed-entry or
    gate-score sites on a config without CSA, compressed or score-routed layers; the same for graph decode."""
    cfg, ckpt = (TINY, tiny) if config == "tiny" else (SWA_HASHED, synthesize(SWA_HASHED, seed=0))
    dec = ProductionDecoder(ckpt, profile, max_context=24, graphs=graphs)
    dec.rec = Recorder()
    dec.prefill(_ids(cfg, 20))
    for t in _ids(cfg, 2, seed=1):
        dec.step(int(t))
    assert isinstance(dec.session, GraphDecodeSession) == graphs
    assert {site_template(name) for name in dec.rec.records} == dec.sites()
    assert ("L{i}.attn.kv_cache" in dec.sites()) == (profile == "fp8-kv-storage")


def test_user_profiles_parse(tmp_path, flip_free):
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nbase = "fp8-kv-storage"\nresidual = "fp32"\n')
    mine = get_profile(str(path))
    assert (mine.name, mine.kv_storage, mine.residual, mine.changes()) == (
        "mine", "fp8", "fp32", {"kv_storage": "fp8", "residual": "fp32"})
    assert load_profile(path) == mine
    cli = get_profile("reference:kv_storage=fp8")
    assert cli.kv_storage == "fp8" and cli.changes() == {"kv_storage": "fp8"}
    assert ProductionModel(flip_free, str(path)).profile == mine
    (tmp_path / "j.json").write_text('{"base": "bf16", "index_scores": "fp32"}')
    assert get_profile(str(tmp_path / "j.json")).changes()["index_scores"] == "fp32"


def test_fused_norm_profile_quantizes_each_norm_once_and_keeps_the_reference_bits_on_cpu(tiny, tiny_decoded,
                                                                                         monkeypatch):
    """``fused-norm``: the attention / ffn / q norms hand their FP8 GEMM input to every GEMM they feed
    (op ``rms_norm_act_quant``, then ``ops.quantized_linear``) and the KV path runs as op ``kv_norm_rope_fp8``; on
    the CPU both are the emulation's own ops, so prefill and decode logits equal ``reference`` bit for bit, eager
    and graph decode alike (on CUDA the fused kernels run: tests/gpu/test_production_cuda.py)."""
    from fidelity.decoders.production import registry

    calls = []
    quantized_linear = ops.quantized_linear
    monkeypatch.setattr(ops, "quantized_linear", lambda xq, w: calls.append(xq.shape) or quantized_linear(xq, w))
    registry.reset_used()
    fused = tiny_decoded("fused-norm")
    assert {"rms_norm_act_quant", "kv_norm_rope_fp8"} <= set(registry.implementations_used())
    # at least, per model call (prefill + 8 steps) and layer: wq_a, wkv, wq_b, the shared expert's w1 and w3
    assert len(calls) >= 9 * TINY.n_layers * 5
    assert torch.equal(fused, tiny_decoded("reference"))
    ids = _ids(TINY, 258)
    graph = _decode(GraphDecodeSession(ProductionModel(tiny, "fused-norm", max_context=258), graphs=False), ids, 250)
    assert torch.equal(graph, fused)


def test_each_session_counts_its_own_calls_whatever_runs_beside_it(tiny):
    """Two sessions interleaved: each one's ``counts`` (what its run's manifest records) holds its own op
    implementations only; the process-wide tally holds both."""
    from fidelity.decoders.production import registry

    ids = _ids(TINY, 40)
    registry.reset_used()
    plain = ProductionModel(tiny, "reference", max_context=42).session()
    packed = ProductionModel(tiny, "fp4-indexer-packed", max_context=42).session()
    plain.prefill(ids)
    packed.prefill(ids)
    plain.step(3)
    assert "index_scores_fp4" not in plain.counts["implementations"]
    assert packed.counts["implementations"]["index_scores_fp4"] == {"cpu": TINY.compress_ratios.count(4)}
    assert plain.counts["implementations"]["rms_norm"]["cpu"] > packed.counts["implementations"]["rms_norm"]["cpu"]
    assert {"index_scores", "index_scores_fp4"} <= set(registry.implementations_used())


def test_fp32_residual_for_chosen_layers_stores_those_streams_in_fp32(tiny, tmp_path):
    from fidelity.model.sites import Recorder

    ids = _ids(TINY, 40)
    rec = Recorder([r"L\d+\.residual"], device=None)
    ProductionModel(tiny, "reference:residual=fp32@0-1+4", max_context=40).session(rec).prefill(ids)
    assert [rec.get(f"L{i}.residual").dtype for i in range(6)] == [torch.float32] * 2 + [torch.bfloat16] * 2 + \
        [torch.float32, torch.bfloat16]
    path = tmp_path / "some.toml"
    path.write_text('residual = "fp32@0,2-3"\n')  # in a file a comma lists layers too
    assert [get_profile(str(path)).residual_fp32(i) for i in range(5)] == [True, False, True, True, False]


@pytest.mark.parametrize(("spec", "message"), [
    ("reference:kv_storage=fp16", r"kv_storage: expected one of \('bf16', 'fp8'\), found 'fp16'"),
    ("reference:colour=red", r"unknown profile field\(s\) \['colour'\]; fields are \['fmha', 'gemm_act'"),
    ("fastest", r"profile: expected one of \['bf16', .*'reference'\].*found 'fastest'"),
    ("reference:kv_storage", r"expected field=value, found 'kv_storage'"),
    ("bf16:kv_storage=fp8", r"kv_storage: 'fp8' stores FP8 codes, so kv_nope must be 'fp8' too"),
    ("reference:indexer_qk=bf16,indexer_storage=packed", r"indexer_storage: 'packed' needs indexer_qk"),
    ("reference:residual=fp16", r"residual: expected 'bf16', 'fp32' or 'fp32@LAYERS' .*found 'fp16'"),
    ("reference:residual=fp32@3-1", r"residual: a layer range runs backwards in 'fp32@3-1'"),
])  # fmt: skip
def test_bad_profiles_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        get_profile(spec)


def test_bad_profile_file_names_the_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('base = "reference"\nfmha = "fp16"\n')
    with pytest.raises(ValueError, match=r"fmha: expected one of \('bf16', 'fp8', 'fp8-nope'\), found 'fp16'"):
        get_profile(str(path))
    with pytest.raises(ValueError, match="profile file not found"):
        get_profile(str(tmp_path / "missing.toml"))


# ---- chunked prefill ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["reference", "fp8-kv-storage", "fp4-indexer-packed", "fp32-residual"])
def test_a_prefill_in_chunks_of_128_gives_the_whole_prefills_bits(tiny, profile):
    """Chunks on 128-token boundaries (the window and the HCA block) run every GEMM on the same row tiles as
    the whole prefill here, so the logits and the later decode steps are the same bits."""
    ids = _ids(TINY, 700)
    whole = ProductionModel(tiny, profile, max_context=704).session()
    chunked = ProductionModel(tiny, profile, max_context=704).session()
    a = torch.cat((whole.prefill(ids), *(whole.step(t)[None] for t in (5, 6, 7))))
    b = torch.cat([chunked.prefill(c) for c in ids.split([128, 256, 128, 188])] +
                  [chunked.step(t)[None] for t in (5, 6, 7)])
    assert torch.equal(a, b)


def test_a_prefill_in_any_chunks_sees_what_the_whole_prefill_sees(tiny):
    """Chunks that split blocks and the window (3 + 129 + 2 + 255 + 311 tokens): the same visible sets and
    compressed entries as one prefill at every layer. (GEMMs over other row counts round differently, and the
    random model amplifies such bits, so values are compared op by op by the runner's op mode instead.)"""
    ids = _ids(TINY, 700)
    sites = [r"L\d+\.attn\.(visible|compressed_kv)", r"L\d+\.indexer\.keys"]
    whole_rec, chunk_rec = Recorder(sites), Recorder(sites)
    ProductionModel(tiny, "reference", max_context=704).session(whole_rec).prefill(ids)
    chunked = ProductionModel(tiny, "reference", max_context=704).session(chunk_rec)
    for part in ids.split([3, 129, 2, 255, 311]):
        chunked.prefill(part)
    assert len(whole_rec.records) == 6 + 4 + 2  # visible per layer, compressed_kv per HCA/CSA, keys per CSA
    for site in whole_rec.records:
        a, b = whole_rec.get(site), chunk_rec.get(site)
        assert a.shape == b.shape, site  # as many entries and keys, emitted once each
        if site.endswith("visible"):  # the window part always; HCA / SWA layers have no selection
            assert torch.equal(a[:, :TINY.window_size], b[:, :TINY.window_size]), site
            if TINY.ratio(int(site[1])) != 4:
                assert torch.equal(a, b), site


def test_split_fp8_fmha_rounds_only_the_nope_dims_of_q_and_kv():
    """fmha "fp8-nope": e4m3 Q and K/V on the nope dims, the 64 rope dims bf16, P e4m3. With zero rope dims it is
    "fp8" bit for bit; with zero nope dims it differs from "fp8" (whose rope dims are rounded) and equals the core
    on the bf16 rope dims with e4m3 P."""
    from fidelity.model.formats import fake_quant_fp8

    g = torch.Generator().manual_seed(3)
    n, h, d, m = 3, 4, 128, 40
    q, kv = torch.randn(n, h, d, generator=g).to(BF16), torch.randn(m, d, generator=g).to(BF16)
    idx, sink = torch.randint(0, m, (n, 70), generator=g), torch.randn(h, generator=g)
    no_rope = (q.clone(), kv.clone())
    no_rope[0][..., -64:], no_rope[1][..., -64:] = 0, 0
    a = ops.sparse_attention(*no_rope, idx, sink, d**-0.5, "fp8-nope")
    assert torch.equal(a, ops.sparse_attention(*no_rope, idx, sink, d**-0.5, "fp8"))
    rope_only = (q.clone(), kv.clone())
    rope_only[0][..., :-64], rope_only[1][..., :-64] = 0, 0
    split = ops.sparse_attention(*rope_only, idx, sink, d**-0.5, "fp8-nope")
    assert not torch.equal(split, ops.sparse_attention(*rope_only, idx, sink, d**-0.5, "fp8"))
    assert torch.equal(ops.fmha_round(rope_only[1], "fp8-nope"), rope_only[1])
    assert torch.equal(ops.fmha_round(kv, "fp8-nope")[:, :64], fake_quant_fp8(kv[:, :64], 64))
    with pytest.raises(ValueError, match="fmha: expected"):
        ops.fmha_round(kv, "fp7")


def test_decode_on_stored_weights_gives_graph_and_eager_the_same_bits_and_the_dequantized_paths_values(
        flip_free, monkeypatch):
    """The decode GEMV path (as on a GPU; here on the ops' CPU emulations): steps read the FP8 weights and FP4
    experts as stored (``fp8_weight_linear``, ``fp4_picked_linear``, experts picked on the device). Eager and
    graph decode give the same bits, and both agree with the dequantized-weight path to rounding; the weights that
    read the same input in one GEMV (wq_a and wkv; a CSA layer's wq_b and its indexer's wq_b; its compressors and index
    weights)."""
    ids = _ids(FLIP_FREE, 40)
    plain = _decode(ProductionModel(flip_free, max_context=64).session(), ids, 32)
    monkeypatch.setattr(ProductionModel, "_gemv_ready", lambda self: True)
    model = ProductionModel(flip_free, max_context=64)
    eager, graph = model.session(), GraphDecodeSession(model, graphs=False)
    stored = _decode(eager, ids, 32)
    assert torch.equal(_decode(graph, ids, 32), stored)
    used = eager.counts["implementations"]
    assert used["fp8_weight_linear"]["cpu"] > 0 and used["fp4_picked_linear"]["cpu"] > 0
    assert used["fp32_linear"]["cpu"] > 0  # the compressors' projections on the stacked bf16 wkv / wgate
    pair = "layers.0.attn.wq_a.weight+layers.0.attn.wkv.weight"
    assert model._gemv[pair] is not None  # wq_a and wkv in one GEMV over their stacked rows
    q_pair = "layers.2.attn.wq_b.weight+layers.2.attn.indexer.wq_b.weight"
    assert model._gemv[q_pair] is not None  # a CSA layer's wq_b and its indexer's wq_b, both reading qr
    csa = "+".join(f"layers.2.attn.{n}.weight" for n in ("compressor.wkv", "compressor.wgate",
                                                           "indexer.compressor.wkv", "indexer.compressor.wgate",
                                                           "indexer.weights_proj"))
    assert model._gemv[csa] is not None  # a CSA layer's bf16 projections of the attention input: one GEMV
    assert torch.equal(stored[0], plain[0])  # the prefill (32 rows) reads the dequantized weights
    assert _cos(stored[1:], plain[1:]).min() > 0.9999  # on this CPU the bits agree too (same products and sums)


def test_stacked_wq_a_and_wkv_split_at_the_q_lora_rank_when_head_dim_differs(monkeypatch):
    """wq_a [q_lora, dim] and wkv [head_dim, dim] stacked for one decode GEMV are split back at q_lora_rank, also
    where head_dim is not q_lora_rank (head_dim 256 here; the GPU tests widen it to 512): a split into chunks of
    q_lora_rank rows gave three parts and stopped the step."""
    cfg = FLIP_FREE.replace(head_dim=256)
    ckpt = synthesize(cfg, seed=0)
    ids = _ids(cfg, 36)
    plain = _decode(ProductionModel(ckpt, max_context=64).session(), ids, 32)
    monkeypatch.setattr(ProductionModel, "_gemv_ready", lambda self: True)
    model = ProductionModel(ckpt, max_context=64)
    stored = _decode(model.session(), ids, 32)
    assert model._gemv["layers.0.attn.wq_a.weight+layers.0.attn.wkv.weight"] is not None
    assert _cos(stored[1:], plain[1:]).min() > 0.9999


@pytest.mark.parametrize("start", [0, 5, 300])
def test_prefill_index_tables_are_built_on_the_given_device_with_the_causal_rule(start):
    """A prefill chunk's window and HCA index tables are made on the device that attends with them (a 16K-token
    chunk's HCA table at 1M context is 1 GB of int64; made on the host it was copied over every chunk), with the
    causal rule's values: window positions max(0, p - win + 1) .. p then -1; HCA entries j < (p + 1) // ratio."""
    t, win, ratio = 40, 16, 8
    assert window_prefill_idx(t, win, start, device="meta").device.type == "meta"
    assert hca_prefill_idx(t, ratio, start, device="meta").device.type == "meta"
    p = torch.arange(start, start + t)[:, None]
    j = torch.arange((start + t) // ratio)[None]
    assert torch.equal(hca_prefill_idx(t, ratio, start), torch.where(j < (p + 1) // ratio, j, -1))
    window = window_prefill_idx(t, win, start)
    for row, pos in zip(window.tolist(), range(start, start + t), strict=True):
        seen = list(range(max(0, pos - win + 1), pos + 1))
        assert row == seen + [-1] * (window.shape[1] - len(seen))


def test_a_prefill_read_at_its_last_row_runs_the_head_on_the_kept_rows_and_the_last(flip_free):
    """``prefill(ids, last_only=True)`` returns the last row's logits [1, vocab] and records the rows the recorder
    keeps of ``logits``, the head multiplying those and the last alone; the values are the full prefill's."""
    ids = _ids(FLIP_FREE, 40)
    full = ProductionModel(flip_free, max_context=64).session().prefill(ids)
    session = ProductionModel(flip_free, max_context=64).session()
    rows = torch.tensor([3, 17])
    session.rec = Recorder(rows=rows, rows_only=frozenset({"logits"}))
    assert torch.equal(session.logit_rows(40), torch.tensor([3, 17, 39]))
    last = session.prefill(ids, last_only=True)
    assert last.shape == (1, FLIP_FREE.vocab_size)
    torch.testing.assert_close(last, full[-1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(session.rec.get("logits"), full[rows], rtol=1e-6, atol=1e-6)
    session.rec = Recorder(rows=torch.tensor([5, 39]), rows_only=frozenset({"logits"}))
    assert torch.equal(session.logit_rows(40), torch.tensor([5, 39]))  # the last row already kept
    session.rec = Recorder()
    assert session.logit_rows(40) is None  # every row recorded: the head runs on all of them


def test_weights_not_stored_in_fp8_or_fp4_keep_the_dequantized_decode_path(monkeypatch):
    """A checkpoint in bf16 (no FP8 / FP4 storage): with the GEMV path available, decode steps still multiply the
    weights as read (``act_linear``) and give the same bits as without it."""
    cfg = FLIP_FREE.replace(dtype="bf16", expert_dtype=None)
    ckpt = synthesize(cfg, seed=0)
    ids = _ids(cfg, 36)
    plain = _decode(ProductionModel(ckpt, max_context=64).session(), ids, 32)
    monkeypatch.setattr(ProductionModel, "_gemv_ready", lambda self: True)
    session = ProductionModel(ckpt, max_context=64).session()
    assert torch.equal(_decode(session, ids, 32), plain)
    used = session.counts["implementations"]
    assert "fp8_weight_linear" not in used and "fp4_picked_linear" not in used
    assert session.model.gemv_weight("layers.0.attn.wq_a.weight") is None and session.model.stored_experts(0) is None
