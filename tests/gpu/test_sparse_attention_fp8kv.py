"""Sparse attention on the 584 B/token FP8 KV layout (``kv_layout``): the rows unpack to exactly ``ops.kv_round``'s;
the ``ws`` route equals the bf16 ``ws`` kernel on the unpacked rows bit for bit, the Triton route the Triton kernel up
to the MMA's fp32 summation order (its K tile reaches the tensor cores from registers)."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import given  # noqa: E402

from fidelity.decoders.production import kv_layout, ops, routes  # noqa: E402
from fidelity.decoders.production.kernels import sparse_attention  # noqa: E402
from fidelity.decoders.production.registry import dispatch  # noqa: E402
from fidelity.testing import Case, check_case  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, PROPS, ROW_CALC_DIFF, attention_cases, row_calc_diff, ws_runs_here  # noqa: E402


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


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("topk", [1, 63, 65, 130, 320, 1152])
@pytest.mark.parametrize("ring", [(1, None, None, None), (1, 2, 0, None), (1, 3, 2, None), (2, None, None, False),
                                  (2, 2, 0, False), (2, None, None, True), (2, 2, 0, True), (2, 3, 2, True)])
def test_fp8_kv_ws_route_equals_the_bf16_ws_kernel_on_the_unpacked_rows(heads, topk, ring):
    """The FP8 layout's ``ws`` route dequantizes in its producers into the tiles the bf16 ``ws`` kernel reads from
    ``kv_layout.unpack`` rows, so each consumer layout, ring depth and prefetch distance gives the same bits, over 1 to
    18 blocks (the ring wraps; an odd count leaves the producers' two-block loop step half used), a ragged last
    block, 30% masked entries and a row with none valid (zero output), with the two-consumer producer filling the
    halves in turn or one ahead; and meets the emulation's contract."""
    consumers, slots, prefetch, ahead = ring
    g = torch.Generator().manual_seed(heads * 10_000 + topk + 7 * consumers)
    q = (torch.randn(5, heads, 512, generator=g) * 2).to(BF16)
    packed = _packed_rows(g, 3000)
    idx = torch.randint(0, 3000, (5, topk), generator=g).to(torch.int32)
    idx[torch.rand(5, topk, generator=g) < 0.3] = -1
    idx[2] = -1
    sink = torch.randn(heads, generator=g)
    args = [x.to(CUDA) for x in (q, packed, idx, sink)]
    config = {"consumers": consumers, "slots": slots, "prefetch": prefetch, "ahead": ahead}
    got = sparse_attention.sparse_attention_fp8kv(*args, 512**-0.5, config=config)
    assert sparse_attention._route(*args[:3], "fp8-kv", config)[0] == "ws"
    rows = kv_layout.unpack(args[1], 512, 64)
    bf16 = sparse_attention.sparse_attention_cuda(args[0], rows, *args[2:], 512**-0.5,
                                                  config={"consumers": consumers})
    assert torch.equal(got.view(torch.int16), bf16.view(torch.int16))
    assert not got[2].abs().any()
    ref = ops.sparse_attention(q, rows.cpu(), idx, sink, 512**-0.5)
    assert float(row_calc_diff(got.cpu(), ref).max()) <= ROW_CALC_DIFF


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
        return sparse_attention.sparse_attention_fp8kv(q, kv_layout.pack(kv, 64), idx, sink, scale,
                                                       config={"route": "ws"})

    check_case("sparse_attention", fp8_route, stored, device=CUDA)


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
def test_fp8_kv_ws_route_dequantizes_extreme_scale_bytes_like_the_unpacking():
    """Scale bytes from 0 (2^-127, a subnormal factor) to 160: the tiles are ``kv_layout.unpack``'s bit for bit, so
    the output is the bf16 ``ws`` kernel's on the unpacked rows, two queries per sequence (MTP) included."""
    g = torch.Generator().manual_seed(21)
    packed = _packed_rows(g, 2000, extreme=True).to(CUDA)
    q = (torch.randn(128, 64, 512, generator=g) * 0.05).to(BF16).to(CUDA)
    idx = torch.randint(0, 2000, (128, 640), generator=g).to(torch.int32).to(CUDA)
    sink = torch.randn(64, generator=g).to(CUDA)
    rows = kv_layout.unpack(packed, 512, 64)
    assert (rows[::7, :448] == 0).float().mean() < 1  # the 2^-127 rows are not all flushed to zero
    for consumers in (1, 2):
        got = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, 0.04, config={"consumers": consumers})
        bf16 = sparse_attention.sparse_attention_cuda(q, rows, idx, sink, 0.04, config={"consumers": consumers})
        assert torch.equal(got.view(torch.int16), bf16.view(torch.int16))


@pytest.mark.skipif(not ws_runs_here(), reason="the warp-specialized kernel needs sm_90 and Triton 3.6")
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
    dispatch("sparse_attention_fp8kv")(q48, packed, idx, sink[:48], 0.04)  # 48 heads: the Triton route
    assert routes.counts("sparse_attention_fp8kv") == {"triton": 1}
    with pytest.raises(ValueError, match="route 'ws' cannot run: needs a head count that is a multiple of 32"):
        sparse_attention.sparse_attention_fp8kv(q48, packed, idx, sink[:48], 0.04, config={"route": "ws"})
    with pytest.raises(ValueError, match=r"\['slots'\] is a parameter of route 'ws'"):
        sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, 0.04, config={"route": "triton", "slots": 2})


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
    packed = kv_layout.pack(kv, 64)
    assert packed.shape == (kv.shape[0], 584)
    assert torch.equal(kv_layout.unpack(packed, 512, 64).view(torch.int16), kv.view(torch.int16))
    q, idx, sink = a["q"].to(CUDA), a["idx"].to(CUDA), a["sink"].to(CUDA)
    if ws_runs_here() and q.shape[1] % 32 == 0:
        ws = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, a["scale"])
        assert torch.equal(ws.view(torch.int16), sparse_attention.sparse_attention_cuda(
            q, kv, idx, sink, a["scale"], config={"route": "ws"}).view(torch.int16)), case.note
    got = sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, a["scale"], config={"route": "triton"}).cpu()
    ref = sparse_attention.sparse_attention_cuda(q, kv, idx, sink, a["scale"], config={"route": "triton"}).cpu()
    assert float(row_calc_diff(got, ref).max()) <= ROW_CALC_DIFF, case.note
    assert float(row_calc_diff(got, ops.sparse_attention(a["q"], kv.cpu(), a["idx"], a["sink"], a["scale"])).max()
                 ) <= ROW_CALC_DIFF, case.note
