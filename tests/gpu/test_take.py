"""``take``: the slice a device index names, copied."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production.kernels import take  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA  # noqa: E402


@pytest.mark.parametrize(("shape", "dtype"), [((16, 2048, 4096), torch.float32), ((3, 5, 7001), BF16), ((2, 0), BF16)])
def test_take_copies_the_slice_a_device_index_names(shape, dtype):
    stack = torch.randn(shape, device=CUDA).to(dtype)
    for i in (0, shape[0] - 1):
        got = take.take(stack, torch.tensor([i], device=CUDA))
        assert got.is_contiguous() and torch.equal(got, stack[i])
    with pytest.raises(ValueError, match="one-element index"):
        take.take(stack, torch.tensor([0, 1], device=CUDA))
