"""``compressor_decode``: the emulation's carries and entries over consecutive positions."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from tests.gpu.kernel_helpers import CUDA  # noqa: E402


@pytest.mark.parametrize(("ratio", "d"), [(4, 512), (4, 128), (128, 512)])
def test_compressor_decode_kernel_follows_the_emulation_over_consecutive_positions(ratio, d):
    """Both carries step by step from one fresh carry: the carried rows stay bit-equal (copies and one fp32 add), the
    entries where a block completes agree to the bf16 roundings (the contract pins them against the oracle)."""
    from fidelity.decoders.production.kernels.compressor import compressor_decode_cuda
    from fidelity.decoders.production.rope_freqs import rope_inv_freq
    from fidelity.model.config import ModelConfig

    coff = 2 if ratio == 4 else 1
    w, g = coff * d, torch.Generator().manual_seed(ratio + d)
    ape = torch.randn(ratio, w, generator=g).to(CUDA) * 0.5
    norm = (1 + 0.1 * torch.randn(d, generator=g)).to(CUDA)
    freqs = rope_inv_freq(ModelConfig.preset("flash"), ratio).to(CUDA)
    carries = [(torch.zeros(coff * ratio, w, device=CUDA), torch.full((coff * ratio, w), float("-inf"), device=CUDA))
               for _ in range(2)]
    for t in range(3 * ratio):
        kv, score = (torch.randn(1, w, generator=g) * 4).to(CUDA), (torch.randn(1, w, generator=g) * 3).to(CUDA)
        pos = torch.tensor([t], device=CUDA)
        want = ops.compressor_decode(kv, score, ape, *carries[0], pos, norm, freqs, 1e-6)
        got = compressor_decode_cuda(kv, score, ape, *carries[1], pos, norm, freqs, 1e-6)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), t
        if t % ratio == ratio - 1:
            cos = torch.nn.functional.cosine_similarity(got[0].double(), want[0].double(), dim=-1)
            assert cos.item() > 1 - 1e-4, (t, cos.item())
