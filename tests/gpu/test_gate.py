"""The gate kernel: the emulation's experts at V4-Flash width."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA  # noqa: E402


def test_gate_kernel_picks_the_emulations_experts_at_flash_width():
    from fidelity.decoders.production.kernels.gate import gate_cuda
    from fidelity.model.config import ModelConfig

    cfg = ModelConfig.preset("flash")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, cfg.dim, generator=g).to(BF16).float().to(CUDA)
    weight = (torch.randn(cfg.n_routed_experts, cfg.dim, generator=g) * cfg.dim**-0.5).to(CUDA)
    bias = (torch.randn(cfg.n_routed_experts, generator=g) * 0.1).to(CUDA)
    ids = torch.arange(8, device=CUDA)
    want_w, want_e = ops.gate(x, weight, bias, None, ids, cfg)
    got_w, got_e = gate_cuda(x, weight, bias, None, ids, cfg)
    assert torch.equal(got_e, want_e)  # distinct scores: the same experts in the same (descending) order
    torch.testing.assert_close(got_w, want_w, rtol=4 * 2.0**-24, atol=0)
