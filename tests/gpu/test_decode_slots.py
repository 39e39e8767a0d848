"""``decode_slots``: the emulation's rows and local indices."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tests.gpu.kernel_helpers import CUDA  # noqa: E402


@pytest.mark.parametrize(("ratio", "n_comp"), [(0, 0), (4, 512), (128, 1025)])
def test_decode_slots_kernel_gives_the_references_rows_and_local_indices(ratio, n_comp):
    from fidelity.decoders.production.kernels.decode_slots import decode_slots_cuda
    from fidelity.decoders.production.ops import decode_slots

    g = torch.Generator().manual_seed(ratio)
    for t in (0, 3, 126, 127, 128, 2047, 131071):
        pos = torch.tensor([t], device=CUDA)
        picks = torch.randperm(4 * n_comp, generator=g)[:n_comp][None].to(CUDA) if ratio == 4 else None
        want = decode_slots(pos, picks, 128, ratio, n_comp)
        got = decode_slots_cuda(pos, picks, 128, ratio, n_comp)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), t
