"""The KV FP8 round under FlashMLA's scale rule (profile field ``kv_scale_floor = "scale"``) on a GPU: the Triton
``kv_round`` / ``kv_norm_rope_fp8`` kernels implement the official rule only, so the registry's wrappers run the
emulation for the other and count it under ``kernel_fallbacks``; a production run on CUDA under that rule passes."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import fallbacks, ops  # noqa: E402
from fidelity.decoders.production.kernels._common import SCALE_FLOOR_FALLBACK  # noqa: E402
from fidelity.decoders.production.registry import REGISTRY  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA  # noqa: E402


def _kv(n: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + d)
    x = torch.randn(n, d, generator=g) * 10 ** torch.empty(n, 1).uniform_(-5, 1, generator=g)
    return x.to(BF16).to(CUDA)


def test_the_kernels_leave_the_flashmla_rule_to_the_emulation_and_say_so():
    fallbacks.reset()
    kv = _kv(64, 512)
    for rule in ("amax", "scale"):
        got = REGISTRY["kv_round"]["triton"](kv, 64, "fp8", rule)
        assert torch.equal(got.view(torch.int16), ops.kv_round(kv, 64, "fp8", rule).view(torch.int16)), rule
    x, w = _kv(16, 512), (torch.rand(512) + 0.5).to(BF16).to(CUDA)
    pos, freqs = torch.arange(16, device=CUDA), torch.rand(32, device=CUDA) * 0.1
    got = REGISTRY["kv_norm_rope_fp8"]["triton"](x, w, 1e-6, pos, freqs, "fp8", "scale")
    want = ops.kv_norm_rope_fp8(x, w, 1e-6, pos, freqs, "fp8", "scale")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    counts = fallbacks.counts()
    assert counts["kv_round"] == {SCALE_FLOOR_FALLBACK: 1} and counts["kv_norm_rope_fp8"] == {SCALE_FLOOR_FALLBACK: 1}


def test_a_cuda_run_under_the_flashmla_rule_passes_and_records_the_fallback(tmp_path):
    import fidelity

    res = fidelity.run("production", None, prompt=40, decode_steps=3, modes=("op",), out=tmp_path, device="cuda",
                       profile="reference:kv_storage=fp8,kv_scale_floor=scale")
    assert res.verdict == "PASS", res.first_divergence
    assert SCALE_FLOOR_FALLBACK in res.manifest["kernel_fallbacks"]["kv_round"]
