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
