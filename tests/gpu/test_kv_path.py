"""The fused KV path (``kv_norm_rope_fp8``: RMSNorm + RoPE + the FP8 round) against the three emulated ops."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st

from fidelity.decoders.production import kv_layout, ops  # noqa: E402
from fidelity.decoders.production.kernels import kv_path  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, PROPS, gen  # noqa: E402


@st.composite
def kv_cases(draw):
    n = draw(st.integers(1, 40))
    g = gen(draw)
    x = (torch.randn(n, 512, generator=g) * draw(st.sampled_from((0.01, 1.0, 50.0)))).to(BF16)
    w = torch.randn(512, generator=g) * draw(st.sampled_from((0.1, 1.0, 8.0)))
    t0 = draw(st.sampled_from((0, 127, 128, 4095, 131071, 1 << 20)))
    positions = torch.arange(n) * draw(st.sampled_from((1, 4, 128))) + t0
    freqs = 1.0 / (10000.0 ** (torch.arange(32) / 32))
    return x, w, positions, freqs


@PROPS
@given(case=kv_cases())
def test_kv_norm_rope_fp8_matches_the_three_emulated_ops(case):
    x, w, positions, freqs = case
    args = (x.to(CUDA), w.to(CUDA), 1e-6, positions.to(CUDA), freqs.to(CUDA))
    rotated = kv_path.kv_norm_rope_fp8(*args, fmt="bf16").cpu()
    emulated = ops.apply_rope(ops.rms_norm(x, w, 1e-6), positions, freqs)
    row_max = emulated.double().abs().amax(-1, keepdim=True)
    assert bool(((rotated.double() - emulated.double()).abs() <= 2.0**-7 * row_max).all())
    assert float((rotated == emulated).float().mean()) >= 0.99
    kv = kv_path.kv_norm_rope_fp8(*args).cpu()
    assert torch.equal(kv.view(torch.int16), ops.kv_round(rotated, 64, "fp8").view(torch.int16))  # bit-exact round
    assert torch.equal(kv_layout.unpack(kv_layout.pack(kv, 64), 512, 64).view(torch.int16), kv.view(torch.int16))
