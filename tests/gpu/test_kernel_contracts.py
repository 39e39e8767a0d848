"""The registered kernels (``registry.OPS``) against their ops' published contracts (fp64 oracle)."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.registry import OPS, REGISTRY, dispatch  # noqa: E402
from fidelity.testing import check_against_oracle  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, ROW_CALC_DIFF, row_calc_diff  # noqa: E402

REGISTERED = tuple(name for name, op in OPS.items() if op.kernel is not None)


def test_kernels_are_registered_under_the_cpu_op_names():
    for op in REGISTERED:
        assert "cpu" in REGISTRY[op] and "triton" in REGISTRY[op], op


@pytest.mark.parametrize("op", REGISTERED)
def test_kernel_meets_the_op_contract(op):
    check_against_oracle(op, REGISTRY[op]["triton"], max_examples=40, device=CUDA)


def test_registered_kernels_accept_cpu_tensors():
    q = torch.randn(2, 4, 128).to(BF16)
    kv = torch.randn(10, 128).to(BF16)
    idx = torch.tensor([[0, 1, -1], [2, -1, 3]], dtype=torch.int32)
    out = dispatch("sparse_attention")(q, kv, idx, torch.zeros(4), 128**-0.5)
    assert out.device.type == "cpu" and out.dtype == BF16
    assert row_calc_diff(out, ops.sparse_attention(q, kv, idx, torch.zeros(4), 128**-0.5)).max() <= ROW_CALC_DIFF


def test_sparse_attention_fp8kv_cuda_route_meets_the_op_contract():
    """Route ``cuda`` of ``sparse_attention_fp8kv`` (CUDA C++ CTA pairs) against the op's contract on its head_dim
    512 draws; head counts it does not take are padded to 64 with zero heads (heads are independent), then sliced."""
    from fidelity.decoders.production.kernels import sparse_attention
    from fidelity.testing.strategies import sparse_attention_fp8kv_inputs

    probe = (torch.zeros(1, 64, 512, dtype=BF16, device=CUDA), torch.zeros(1, 584, dtype=torch.uint8, device=CUDA),
             torch.zeros(1, 1, dtype=torch.int32, device=CUDA))
    why = sparse_attention._cuda_refusal(*probe, "fp8-kv")
    if why:
        pytest.skip(f"route 'cuda' does not run here: {why}")

    def cuda_route(q, kv_packed, idx, sink, scale, rope_dims=64):
        h, pad = q.shape[1], -q.shape[1] % 64
        q = torch.cat((q, q.new_zeros(q.shape[0], pad, q.shape[2])), 1)
        sink = torch.cat((sink, sink.new_zeros(pad)))
        return sparse_attention.sparse_attention_fp8kv(q, kv_packed, idx, sink, scale, config={"route": "cuda"})[:, :h]

    check_against_oracle("sparse_attention_fp8kv", cuda_route, max_examples=40, device=CUDA,
                         strategy=sparse_attention_fp8kv_inputs(head_dims=(512,)))
