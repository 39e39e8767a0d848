"""``indexer_round`` (Hadamard + FP4 round): the emulation's bits on the GPU."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from tests.gpu.kernel_helpers import CUDA, decode_rows  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 64, 128), (1, 128), (4, 64, 128), (3, 512)])
@pytest.mark.parametrize("rotate", [True, False])
def test_indexer_round_kernel_gives_the_emulations_bits_on_the_gpu(shape, rotate):
    from fidelity.decoders.production.kernels.indexer_round import indexer_round_cuda

    x = decode_rows(torch.Generator().manual_seed(sum(shape)), *shape).to(CUDA)
    x.view(-1, shape[-1])[0, :32] = -0.0
    want = ops.indexer_round(x, "fp4", rotate)  # the torch emulation on the same device
    assert torch.equal(indexer_round_cuda(x, "fp4", rotate).view(torch.int16), want.view(torch.int16))
