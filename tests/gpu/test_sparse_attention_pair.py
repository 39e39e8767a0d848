"""Route ``cuda`` of ``sparse_attention_fp8kv`` (``kernels/sparse_attention_pair.py``, CUDA C++ CTA pairs sharing the
dequantized rows): the emulation's results within its contract over both pair layouts (64 heads: the pair splits the
output dims; 128 and 256 heads: the heads), ragged and masked blocks, extreme scale bytes and CUDA-graph replay."""

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
from tests.gpu.kernel_helpers import BF16, CUDA, PROPS, ROW_CALC_DIFF, attention_cases, row_calc_diff  # noqa: E402

WHY = sparse_attention._cuda_refusal(torch.zeros(1, 64, 512, dtype=BF16, device=CUDA),
                                     torch.zeros(1, 584, dtype=torch.uint8, device=CUDA),
                                     torch.zeros(1, 1, dtype=torch.int32, device=CUDA), "fp8-kv")
needs_route = pytest.mark.skipif(WHY is not None, reason=f"route 'cuda' does not run here: {WHY}")


def _packed_rows(g: torch.Generator, m: int, extreme: bool = False) -> torch.Tensor:
    """uint8 [m, 584] cache rows: random e4m3 codes (no NaN codes), bf16 rope dims, scale bytes near 127 or
    (``extreme``) over 1..160 with every seventh row's bytes 0 (2^-127)."""
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


def _cuda(q, packed, idx, sink, scale):
    return sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, scale, config={"route": "cuda"})


@needs_route
@pytest.mark.parametrize("heads", [64, 128, 256])
@pytest.mark.parametrize("topk", [0, 1, 63, 65, 130, 320, 1152])
def test_cuda_route_matches_the_emulation(heads, topk):
    """1 to 18 blocks (the two-slot ring wraps), a ragged last block, 30% masked entries and a row with none valid
    (zero output): per-row calc_diff against the emulation on the unpacked rows within the contract's bound, and
    most outputs bit-equal to it."""
    g = torch.Generator().manual_seed(heads * 10_000 + topk)
    q = (torch.randn(5, heads, 512, generator=g) * 2).to(BF16)
    packed = _packed_rows(g, 3000)
    idx = torch.randint(0, 3000, (5, topk), generator=g).to(torch.int32)
    idx[torch.rand(5, topk, generator=g) < 0.3] = -1
    idx[2] = -1
    sink = torch.randn(heads, generator=g)
    got = _cuda(q.to(CUDA), packed.to(CUDA), idx.to(CUDA), sink.to(CUDA), 512**-0.5).cpu()
    assert not got[2].abs().any()
    ref = ops.sparse_attention(q, kv_layout.unpack(packed, 512, 64), idx, sink, 512**-0.5)
    assert float(row_calc_diff(got, ref).max()) <= ROW_CALC_DIFF
    if topk:
        assert float((got == ref).float().mean()) > 0.9


@needs_route
def test_cuda_route_dequantizes_extreme_scale_bytes_like_the_unpacking():
    """Scale bytes from 0 (2^-127, subnormal products) to 160, two queries per sequence (MTP), both layouts."""
    g = torch.Generator().manual_seed(21)
    packed = _packed_rows(g, 2000, extreme=True)
    rows = kv_layout.unpack(packed, 512, 64)
    for heads in (64, 128):
        q = (torch.randn(128, heads, 512, generator=g) * 0.05).to(BF16)
        idx = torch.randint(0, 2000, (128, 640), generator=g).to(torch.int32)
        sink = torch.randn(heads, generator=g)
        got = _cuda(q.to(CUDA), packed.to(CUDA), idx.to(CUDA), sink.to(CUDA), 0.04).cpu()
        ref = ops.sparse_attention(q, rows, idx, sink, 0.04)
        assert float(row_calc_diff(got, ref).max()) <= ROW_CALC_DIFF


@needs_route
@PROPS
@given(case=attention_cases())
def test_cuda_route_meets_the_oracle_contract(case):
    """``sparse_attention``'s contract (the fp64 oracle on the gathered rows) on DSv4-shaped cases whose KV rows
    are the values the layout stores; head counts the route does not take are padded to 64 with zero heads (heads
    are independent) and sliced back."""
    a = case.args
    if a["q"].shape[-1] != 512:
        return
    stored = Case({**a, "kv": ops.kv_round(a["kv"], 64, "fp8")}, note=case.note)

    def cuda_route(q, kv, idx, sink, scale, fmt="bf16"):
        h = q.shape[1]
        pad = -h % 64
        qp = torch.cat((q, q.new_zeros(q.shape[0], pad, q.shape[2])), 1) if pad else q
        sp = torch.cat((sink, sink.new_zeros(pad))) if pad else sink
        return _cuda(qp, kv_layout.pack(kv, 64), idx, sp, scale)[:, :h]

    check_case("sparse_attention", cuda_route, stored, device=CUDA)


@needs_route
def test_cuda_route_replays_in_a_cuda_graph_and_refuses_what_it_cannot_run():
    g = torch.Generator().manual_seed(22)
    q = torch.randn(2, 128, 512, generator=g).to(BF16).to(CUDA)
    packed = _packed_rows(g, 3000).to(CUDA)
    idx = torch.randint(-1, 3000, (2, 640), generator=g).to(torch.int32).to(CUDA)
    sink = torch.randn(128, generator=g).to(CUDA)
    eager = _cuda(q, packed, idx, sink, 0.04)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _cuda(q, packed, idx, sink, 0.04)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    with pytest.raises(ValueError, match="route 'cuda' cannot run: needs a head count that is a multiple of 64"):
        _cuda(q[:, :32], packed, idx, sink[:32], 0.04)
    with pytest.raises(ValueError, match="route 'cuda' cannot run: fmt 'bf16'"):
        sparse_attention.sparse_attention_cuda(q, packed, idx, sink, 0.04, config={"route": "cuda"})
    routes.reset()
    dispatch("sparse_attention_fp8kv")(q[:, :48], packed, idx, sink[:48], 0.04)  # 48 heads: the Triton route
    assert routes.counts("sparse_attention_fp8kv") == {"triton": 1}
