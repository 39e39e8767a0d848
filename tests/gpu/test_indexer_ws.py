"""The warp-specialized FP4 indexer kernel (``index_scores_fp4``'s route ``ws``) against the bf16 kernel and the
oracle."""

import math

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops, routes  # noqa: E402
from fidelity.decoders.production.kernels import indexer  # noqa: E402
from fidelity.decoders.production.registry import dispatch  # noqa: E402
from fidelity.model.formats import quantize_fp4  # noqa: E402
from fidelity.testing import check_against_oracle, strategies  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, fp4_keys, index_scores_bound, ws_runs_here  # noqa: E402


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
    deq = fp4_keys(packed, scales)
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
    bound = 2 * index_scores_bound(q[rows].cpu(), deq.cpu(), w[rows].cpu())
    shown = ~ref[rows].isinf().cpu()  # masked by the causal rule: -inf in both (checked above)
    assert torch.equal(got[rows].isinf(), ref[rows].isinf())
    assert bool(((got[rows].cpu().double() - ref[rows].cpu().double()).abs() <= bound)[shown].all())


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_index_scores_fp4_meet_the_contract():
    def ws(q, codes, scales, weights, dtype):
        mma = "ws" if 1 <= q.shape[0] <= 4 else "fp8"
        return indexer.index_scores_fp4(q, codes, scales, weights, mma=mma)

    check_against_oracle("index_scores_fp4", ws, max_examples=40, device=CUDA,
                         strategy=strategies.index_scores_fp4_inputs(dims=(128,), max_heads=64))


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    deq = fp4_keys(packed, scales)
    for part in (slice(0, 4), slice(4, 6)):
        got, used = indexer.index_scores_fp4(q[part], packed, scales, w[part], mma="ws", return_path=True)
        assert used.tolist() == expected[part]
        ref = indexer.index_scores_cuda(q[part], deq, w[part])
        _assert_ws_scores(got, used, q[part], deq, w[part], ref, exact=expected[part], min_equal=0.99)
        empty, used = indexer.index_scores_fp4(q[part], packed[:0], scales[:0], w[part], mma="ws", return_path=True)
        assert empty.shape == (part.stop - part.start, 0) and used.tolist() == expected[part]


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("heads, spread, w_scale", [(64, 70, 1.0), (40, 0, 2.0**-60), (17, -60, 2.0**40)])
def test_ws_index_scores_fp4_extreme_scales_and_fewer_heads(heads, spread, w_scale):
    """Key scales far from 1, tiny or huge weights (bf16 products near the subnormal or overflow range), and
    fewer than 64 heads (padded with zero codes and weights)."""
    q, packed, scales, w, deq, _ = _ws_index_case(3, 3000, heads=heads, seed=heads, spread=spread)
    w = (w.float() * w_scale).to(BF16)
    ref = indexer.index_scores_cuda(q, deq, w)
    got, used = indexer.index_scores_fp4(q, packed, scales, w, mma="ws", return_path=True)
    _assert_ws_scores(got, used, q, deq, w, ref)


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    deq = fp4_keys(packed, scales)
    paths = torch.zeros(2, dtype=torch.int32, device=CUDA) if count else None
    got, used = indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=paths)
    if count:
        assert paths.tolist() == [2 * n_q, 0]  # both 64-key halves of the one tile, per query, on the FP8 path
    _assert_ws_scores(got, used, q, deq, w, indexer.index_scores_cuda(q, deq, w), exact=[1] * n_q)


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    deq = fp4_keys(packed, scales)
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


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_ws_index_scores_fp4_is_the_one_query_decode_default_and_replays_in_a_cuda_graph():
    """``auto`` takes ``ws`` for one query over >= ``WS_MIN_KEYS`` keys, the Triton FP8 kernel for more queries
    below ``WS_MIN_KEYS_QUERIES`` keys and ``ws`` above, the bf16 kernel below ``FP8_MMA_MIN_KEYS``; the launch
    replays in a CUDA graph with the eager scores; inputs the kernel cannot take are refused with the reason."""
    q, packed, scales, w, _, _ = _ws_index_case(2, 40000, seed=5)
    q, w = q[:1], w[:1]
    assert indexer.WS_MIN_KEYS <= 40000
    long = indexer.index_scores_fp4(q, packed, scales, w, mma="ws")
    scores = dispatch("index_scores_fp4")  # "auto", its route counted
    routes.reset()
    assert torch.equal(scores(q, packed, scales, w), long)
    assert routes.counts("index_scores_fp4") == {"ws": 1}
    fp8 = indexer.index_scores_fp4(q.expand(2, -1, -1), packed, scales, w.expand(2, -1), mma="fp8")
    assert torch.equal(scores(q.expand(2, -1, -1), packed, scales, w.expand(2, -1)), fp8)
    short = min(indexer.WS_MIN_KEYS, indexer.FP8_MMA_MIN_KEYS) - 1
    assert torch.equal(scores(q, packed[:short], scales[:short], w),
                       indexer.index_scores_fp4(q, packed[:short], scales[:short], w, mma="bf16"))
    assert routes.counts("index_scores_fp4") == {"ws": 1, "fp8": 1, "bf16": 1}
    assert indexer.WS_MIN_KEYS_QUERIES > 40000
    more = torch.cat([packed, packed[:indexer.WS_MIN_KEYS_QUERIES - 40000]])
    more_scales = torch.cat([scales, scales[:indexer.WS_MIN_KEYS_QUERIES - 40000]])
    two = scores(q.expand(2, -1, -1), more, more_scales, w.expand(2, -1))
    assert routes.counts("index_scores_fp4") == {"ws": 2, "fp8": 1, "bf16": 1}
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
