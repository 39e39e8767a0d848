"""Sparse attention (bf16 KV; routes ``ws`` and ``triton``) against the CPU emulation and the fp64 oracle:
per (query, head) row ``calc_diff <= (2 * 1.25 * 2^-8)^2 / 2`` (P's bf16 rounding may flip where fp32 exp / summation
order differ), on DSv4-shaped cases (window of 128 incl. self, compressed picks, -1 padding)."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st

from fidelity.decoders.production import fallbacks, ops, routes  # noqa: E402
from fidelity.decoders.production.faults import inject  # noqa: E402
from fidelity.decoders.production.kernels import sparse_attention  # noqa: E402
from fidelity.decoders.production.registry import REGISTRY, dispatch, implementation  # noqa: E402
from fidelity.testing import check_against_oracle, check_case, strategies  # noqa: E402
from tests.gpu.kernel_helpers import (  # noqa: E402
    BF16,
    CUDA,
    PROPS,
    ROW_CALC_DIFF,
    ROW_CALC_DIFF_E4M3,
    attention_cases,
    row_calc_diff,
    ws_runs_here,
)


def test_sparse_attention_contract_wide_heads():
    check_against_oracle("sparse_attention", dispatch("sparse_attention"), max_examples=25, device=CUDA,
                         strategy=strategies.sparse_attention_inputs(head_dims=(128, 512), max_heads=128))


@PROPS
@given(case=attention_cases())
def test_sparse_attention_matches_emulation_and_oracle(case):
    a = case.args
    found = sparse_attention.sparse_attention_cuda(*(v.to(CUDA) if isinstance(v, torch.Tensor) else v
                                                     for v in a.values())).cpu()
    emulated = ops.sparse_attention(*a.values())
    worst = float(row_calc_diff(found, emulated).max())
    assert worst <= ROW_CALC_DIFF, f"calc_diff vs emulation {worst:.3g} > {ROW_CALC_DIFF:.3g}; {case.note}"
    check_case("sparse_attention", dispatch("sparse_attention"), case, device=CUDA)


@PROPS
@given(case=attention_cases())
def test_sparse_attention_e4m3_profile_runs_the_kernel_and_matches_its_emulation(case):
    """``fmt="fp8"`` (profile fp8-fmha: e4m3 Q, K/V and P) runs in the kernel, not the emulation fallback, and
    matches ``ops.sparse_attention(..., "fp8")`` on the same device: an e4m3 P flip from the fp32 summation order
    moves a weight by up to 2^-4 relative (the per-row bound), and almost every output is bit-equal (which a
    kernel that ignored the format would not be)."""
    args = [v.to(CUDA) if isinstance(v, torch.Tensor) else v for v in dict(case.args, fmt="fp8").values()]
    fallbacks.reset()
    found = dispatch("sparse_attention")(*args)
    assert fallbacks.counts() == {}, case.note
    emulated = ops.sparse_attention(*args)
    worst = float(row_calc_diff(found, emulated).max())
    assert worst <= ROW_CALC_DIFF_E4M3, f"calc_diff vs emulation {worst:.3g}; {case.note}"
    assert float((found == emulated).float().mean()) >= 0.9, case.note


def test_sparse_attention_fallbacks_are_logged_with_their_reason():
    q = torch.randn(2, 4, 96).to(BF16).to(CUDA)  # head_dim 96: no kernel launch for it
    kv = torch.randn(10, 96).to(BF16).to(CUDA)
    idx = torch.tensor([[0, 1, -1], [2, -1, 3]], dtype=torch.int32, device=CUDA)
    sink = torch.zeros(4, device=CUDA)
    fallbacks.reset()
    dispatch("sparse_attention")(q, kv, idx, sink, 96**-0.5)
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
    assert float(row_calc_diff(found, ops.sparse_attention(*a.values())).max()) <= ROW_CALC_DIFF, case.note
    if split_d == 1 and a["idx"].shape[1] <= 64:  # a single index block: the unsplit launch's arithmetic
        assert torch.equal(found, sparse_attention.sparse_attention_cuda(*args, config={"route": "triton"}).cpu())


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    assert float(row_calc_diff(got, ops.sparse_attention(*a.values())).max()) <= ROW_CALC_DIFF, case.note
    other = sparse_attention.sparse_attention_cuda(*args, config={"route": "triton"}).cpu()
    assert float(row_calc_diff(got, other).max()) <= ROW_CALC_DIFF, case.note
    assert (got == other).float().mean() >= 0.99, case.note
    if a["q"].shape[1] % 64 == 0:
        two = sparse_attention.sparse_attention_cuda(*args, config={"route": "ws", "consumers": 2}).cpu()
        assert float(row_calc_diff(two, ops.sparse_attention(*a.values())).max()) <= ROW_CALC_DIFF, case.note
        assert (two == got).float().mean() >= 0.999, case.note


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    assert float(row_calc_diff(got, ops.sparse_attention(q, kv, idx, sink, 512**-0.5)).max()) <= ROW_CALC_DIFF


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    assert float(row_calc_diff(got, other).max()) <= ROW_CALC_DIFF
    assert (got == other).float().mean() >= 0.99
    assert float(row_calc_diff(got, ops.sparse_attention(q, kv, idx, sink, 512**-0.5)).max()) <= ROW_CALC_DIFF


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    attend = dispatch("sparse_attention")
    routes.reset()
    got = attend(q.to(CUDA), kv.to(CUDA), idx.to(CUDA), sink.to(CUDA), 512**-0.5)
    assert routes.counts("sparse_attention") == {"ws": 1}
    assert torch.isfinite(got.float()).all() and not got[2].abs().any()
    assert float(row_calc_diff(got.cpu(), ops.sparse_attention(q, kv, idx, sink, 512**-0.5)).max()) <= ROW_CALC_DIFF
    qp = torch.randn(300, 64, 512, generator=g).to(BF16).to(CUDA)
    prefill = (qp, kv.to(CUDA), idx[:1].expand(300, -1).to(CUDA), sink.to(CUDA), 0.04)
    two = attend(*prefill)  # 300 tokens x 64 heads: two consumers save waves
    sparse_attention.sparse_attention_cuda(*prefill, config={"block_h": 64})
    assert routes.counts("sparse_attention") == {"ws": 2}
    assert sparse_attention._route(*prefill[:3], "bf16", {"block_h": 64})[0] == "triton"
    one = sparse_attention.sparse_attention_cuda(*prefill, config={"consumers": 1})
    assert float(row_calc_diff(two.cpu(), one.cpu()).max()) <= ROW_CALC_DIFF
    assert (two == one).float().mean() >= 0.999


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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


def test_sparse_attention_route_refusals_say_why():
    q = torch.randn(2, 64, 128).to(BF16).to(CUDA)
    kv = torch.randn(50, 128).to(BF16).to(CUDA)
    idx = torch.zeros((2, 10), dtype=torch.int32, device=CUDA)
    sink = torch.zeros(64, device=CUDA)
    with pytest.raises(ValueError, match="route 'ws' cannot run: .*head_dim 512"):
        sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 0.1, config={"route": "ws"})
    with pytest.raises(ValueError, match="route must be 'cuda', 'ws' or 'triton', found 'fast'"):
        sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 0.1, config={"route": "fast"})
    if ws_runs_here():
        q5, kv5 = torch.randn(2, 64, 512).to(BF16).to(CUDA), torch.randn(50, 512).to(BF16).to(CUDA)
        with pytest.raises(ValueError, match=r"takes no Triton launch parameters, found \['block_h'\]"):
            sparse_attention.sparse_attention_cuda(q5, kv5, idx, sink, 0.1, config={"route": "ws", "block_h": 32})
        with pytest.raises(ValueError, match="consumers must be 1 or 2.*found consumers=3, heads=64"):
            sparse_attention.sparse_attention_cuda(q5, kv5, idx, sink, 0.1, config={"consumers": 3})


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
    assert float(row_calc_diff(got, ref).max()) <= ROW_CALC_DIFF
    with pytest.raises(sparse_attention.OutOfResources):
        sparse_attention.sparse_attention_cuda(q, kv, idx, sink, 512**-0.5, config={"split_d": 2, "num_stages": 3})


def test_sparse_attention_all_masked_and_empty():
    q = torch.randn(3, 64, 512).to(BF16)
    kv = torch.randn(5, 512).to(BF16)
    sink = torch.randn(64)
    for idx in (torch.full((3, 130), -1, dtype=torch.int32), torch.zeros((3, 0), dtype=torch.int32)):
        out = dispatch("sparse_attention")(q, kv, idx, sink, 512**-0.5)
        assert torch.equal(out, ops.sparse_attention(q, kv, idx, sink, 512**-0.5))
        assert not out.abs().any()
