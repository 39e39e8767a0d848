"""``apply_rope``: the emulation's bits on the GPU."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from tests.gpu.kernel_helpers import CUDA, decode_rows  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 64, 512), (1, 512), (1, 64, 128), (1, 128), (5, 8, 512)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_kernel_gives_the_emulations_bits_on_the_gpu(shape, inverse):
    from fidelity.decoders.production.kernels.rope import apply_rope_cuda

    g = torch.Generator().manual_seed(sum(shape) + inverse)
    x = decode_rows(g, *shape).to(CUDA)
    freqs = (torch.rand(32, generator=g) * torch.exp2(-torch.arange(32) / 2)).to(CUDA)
    positions = torch.randint(0, 2**20, (shape[0],), generator=g).to(CUDA)
    want = ops.apply_rope(x, positions, freqs, inverse)
    assert torch.equal(apply_rope_cuda(x, positions, freqs, inverse).view(torch.int16), want.view(torch.int16))
