"""RMSNorm kernels: ``y`` within one bf16 ulp of the emulation; the FP8 quantizer of ``rms_norm_fp8`` (codes and
scale bytes, given the kernel's ``y``) bit-exact."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import given  # noqa: E402

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import rms_norm  # noqa: E402
from fidelity.model.formats import quantize_fp8  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, PROPS, norm_cases, same_values  # noqa: E402


@PROPS
@given(case=norm_cases())
def test_rms_norm_fp8_quantizer_is_bit_exact(case):
    x, w, cfg = case
    codes, sbytes, y = rms_norm.rms_norm_fp8_cuda(x.to(CUDA), w.to(CUDA), 1e-6, return_y=True, **cfg)
    codes, sbytes, y = codes.cpu(), sbytes.cpu(), y.cpu()
    ref_codes, ref_bytes = quantize_fp8(y, 128)
    assert torch.equal(sbytes, ref_bytes)
    assert same_values(codes.float(), ref_codes.float())
    assert torch.equal(rms_norm.rms_norm_fp8_cuda(x.to(CUDA), w.to(CUDA), 1e-6, **cfg)[0].cpu().view(torch.uint8),
                       codes.view(torch.uint8))
    emulated = ops.rms_norm(x, w, 1e-6)
    ulp = emulated.double().abs() * 2.0**-7
    ok = ((y.double() - emulated.double()).abs() <= ulp) | (y.isnan() & emulated.isnan())
    assert bool(ok.all())
    same = (emulated.view(torch.int16) == y.view(torch.int16)) | (y.isnan() & emulated.isnan())
    assert float(same.float().mean()) >= 0.99


@pytest.mark.parametrize("d", [4096, 7168])
def test_rms_norm_prefill_launch_is_within_one_ulp_of_the_emulation(d):
    """2 rows per program (the prefill launch; 4 warps at d = 4096, 8 at 7168): only the fp32 summation order of
    the mean differs from torch, so y is within one bf16 ulp and almost always equal."""
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(1024, d, generator=g) * 5).to(BF16).to(CUDA)
    w = torch.randn(d, generator=g).to(CUDA)
    y, ref = rms_norm.rms_norm_cuda(x, w, 1e-6).double(), ops.rms_norm(x, w, 1e-6).double()
    assert bool(((y - ref).abs() <= ref.abs() * 2.0**-7).all())
    assert float((y == ref).float().mean()) >= 0.999


@pytest.mark.parametrize("n, d, rows, warps", [(1031, 7168, 1, 8), (1031, 4096, 1, 4), (1031, 4096, 2, 8),
                                                (300, 512, 4, 4)])
def test_rms_norm_fp8_persistent_launch_gives_the_one_shot_bits(n, d, rows, warps):
    """The persistent kernel (programs looping over row groups, next group loaded ahead) runs the one-shot kernel's
    arithmetic on the same tiles: codes, scale bytes and y are bit-identical, ragged last group included."""
    g = torch.Generator().manual_seed(n + d)
    x = (torch.randn(n, d, generator=g) * 4).to(BF16).to(CUDA)
    w = torch.randn(d, generator=g).to(CUDA)
    one = rms_norm.rms_norm_fp8_cuda(x, w, 1e-6, True, rows=rows, num_warps=warps, per_sm=0, stream=True)
    for per_sm in (1, 2):
        got = rms_norm.rms_norm_fp8_cuda(x, w, 1e-6, True, rows=rows, num_warps=warps, per_sm=per_sm, stream=True)
        assert torch.equal(got[0].view(torch.uint8), one[0].view(torch.uint8))
        assert torch.equal(got[1], one[1]) and torch.equal(got[2].view(torch.int16), one[2].view(torch.int16))


def test_rms_norm_weightless_kernel_rounds_as_the_bf16_emulation():
    from fidelity.decoders.production.kernels.rms_norm import rms_norm_weightless_cuda

    q = (torch.randn(2, 64, 512, generator=torch.Generator().manual_seed(0)) * 3).to(BF16).to(CUDA)
    same = rms_norm_weightless_cuda(q, 1e-6) == ops.rms_norm_weightless(q, 1e-6)
    assert same.float().mean().item() >= 0.999  # the mean's fp32 sum order may flip a bf16 rounding
