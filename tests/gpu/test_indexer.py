"""Indexer scores (bf16 keys; FP4 keys on bf16 or FP8 tensor cores) against the CPU emulation and the fp64 oracle:
within twice the contract's elementwise bound; FP4 keys equal their dequantized bf16 copy bit for bit (same tile values,
same MMA), and the causal mask is exact."""

import math

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import indexer  # noqa: E402
from fidelity.decoders.production.registry import dispatch  # noqa: E402
from fidelity.model.formats import dequantize_fp4, quantize_fp4  # noqa: E402
from fidelity.testing import check_against_oracle, strategies  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, PROPS, fp4_keys, gen, index_scores_bound  # noqa: E402


def test_index_scores_contract_64_heads():
    check_against_oracle("index_scores", dispatch("index_scores"), max_examples=25, device=CUDA,
                         strategy=strategies.index_scores_inputs(dims=(128,), max_heads=64))


def test_index_scores_fp4_contract_on_fp8_tensor_cores():
    def fp8_mma(q, codes, scales, weights, dtype):
        return indexer.index_scores_fp4(q, codes, scales, weights, mma="fp8")

    check_against_oracle("index_scores_fp4", fp8_mma, max_examples=40, device=CUDA,
                         strategy=strategies.index_scores_fp4_inputs(dims=(128,), max_heads=64))


_E_EDGES = (0, 1, 3, 4, 5, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097)


@st.composite
def indexer_cases(draw):
    h = draw(st.sampled_from((4, 64)))
    d = draw(st.sampled_from((64, 128)))
    n = draw(st.integers(1, 3))
    e = draw(st.one_of(st.sampled_from(_E_EDGES), st.integers(0, 5000)))
    g = gen(draw)
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
    assert bool((err <= 2 * index_scores_bound(q, keys, w)).all())


@PROPS
@given(case=indexer_cases(), t0=st.sampled_from((0, 3, 4, 7, 8, 127, 128, 511, 4095, 4096)))
def test_index_scores_fp4_keys_and_causal_mask(case, t0):
    q, keys, w = case
    packed, scales = quantize_fp4(keys, 32)
    deq = dequantize_fp4(packed, scales).to(BF16)
    qc, wc, pc, sc = q.to(CUDA), w.to(CUDA), packed.to(CUDA), scales.to(CUDA)
    ref = indexer.index_scores_cuda(qc, deq.to(CUDA), wc)
    assert torch.equal(fp4_keys(pc, sc).cpu().view(torch.int16), deq.view(torch.int16))
    assert torch.equal(ref.cpu().view(torch.int16), dispatch("index_scores")(q, deq, w).view(torch.int16))
    bf16_path = indexer.index_scores_fp4(qc, pc, sc, wc, mma="bf16")
    assert torch.equal(bf16_path.view(torch.int16), ref.view(torch.int16))  # same tile values, same MMA
    got, used = indexer.index_scores_fp4(qc, pc, sc, wc, mma="fp8", return_path=True)
    scored = int(q.shape[-1] == 128 and keys.shape[0] > 0)
    assert used.tolist() == [scored] * q.shape[0]  # FP4-simulated q: FP8 MMA where d = 128 (and keys to score)
    bound = 2 * index_scores_bound(q, deq, w)
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
    deq = fp4_keys(packed, scales)
    got, used = indexer.index_scores_fp4(q.to(CUDA), packed, scales, w, config={"tiles": tiles}, mma="fp8",
                                         return_path=True)
    assert used.tolist() == [1, 0, 0, 1]
    ref = indexer.index_scores_cuda(q.to(CUDA), deq, w)
    assert torch.equal(got[1:3].view(torch.int16), ref[1:3].view(torch.int16))  # NaN row: NaN where ref is
    assert float((got[[0, 3]] == ref[[0, 3]]).float().mean()) >= 0.999
    bound = 2 * index_scores_bound(q[[0, 3]], deq.cpu(), w.cpu()[[0, 3]])
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
    deq = fp4_keys(packed, scales)
    got, used = indexer.index_scores_fp4(q.to(CUDA), packed, scales, w.to(CUDA), mma="fp8", return_path=True)
    assert used.tolist() == [1, 1, 1]
    ref = indexer.index_scores_cuda(q.to(CUDA), deq, w.to(CUDA))
    assert float((got == ref).float().mean()) >= 0.999
    bound = 2 * index_scores_bound(q, deq.cpu(), w)
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
