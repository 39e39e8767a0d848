"""The decode GEMVs reading the stored FP8 / FP4 / bf16 weights against their contracts and a separate quantization;
the FP4 expert GEMV on e8m0 scale bytes at the ends of the format (0, 1, 127, 254, 255) against the emulation's bits."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import weight_gemv  # noqa: E402
from fidelity.model.formats import fake_quant_fp8  # noqa: E402
from fidelity.testing import check_against_oracle  # noqa: E402
from tests import fp4_scale_bytes  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA  # noqa: E402


def test_weight_gemvs_meet_their_contracts_where_the_row_blocks_overhang():
    """Row blocks larger than the output (BN 256 over 128 / 384 rows; 256 over 64 / 128; 256 over 16 / 200 bf16
    rows): the masked rows; grouped FP8 cases with 64-row blocks inside 128-row groups."""
    def fp8(x, codes, scales, act, groups):
        xq = fake_quant_fp8(x, 128) if act == "fp8" else x
        return weight_gemv.fp8_weight_linear(xq, codes, scales, groups=groups, bn=256 if groups == 1 else 64)

    def f32(x, weight):
        return weight_gemv.bf16_weight_linear_f32(x, weight, bn=256)

    def fp4(x, experts, packed, scales, act):
        return weight_gemv.fp4_expert_linear(fake_quant_fp8(x, 128), experts, packed, scales, bn=256, bb=2) \
            if act == "fp8" else ops.fp4_picked_linear(x, experts, packed, scales, act)

    check_against_oracle("fp8_weight_linear", fp8, max_examples=25, device=CUDA)
    check_against_oracle("fp4_picked_linear", fp4, max_examples=25, device=CUDA)
    check_against_oracle("fp32_linear", f32, max_examples=25, device=CUDA)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 1024), (2, 1024, 4096), (1, 2048, 512)])
def test_decode_gemvs_quantizing_in_their_launch_give_the_bits_of_a_separate_quantization(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, k), generator=g))).to(BF16).to(CUDA)
    codes = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn).to(CUDA)
    scales = torch.exp2(torch.randint(-8, 2, ((n + 127) // 128, k // 128), generator=g).float()).to(CUDA)
    want = weight_gemv.fp8_weight_linear(fake_quant_fp8(x, 128), codes, scales)  # formats' quantizer (torch)
    assert torch.equal(weight_gemv.fp8_weight_linear_cuda(x, codes, scales), want)
    packed = torch.randint(0, 256, (4, n, k // 2), generator=g, dtype=torch.uint8).to(CUDA)
    fp4_scales = (127 + torch.randint(-8, 2, (4, n, k // 32), generator=g)).to(torch.uint8).to(CUDA)  # e8m0 bytes
    picks = torch.tensor([3, 1, 3][: max(m, 2)], device=CUDA)
    xs = x[torch.arange(len(picks), device=CUDA) % m]
    want = weight_gemv.fp4_expert_linear(fake_quant_fp8(xs, 128), picks, packed, fp4_scales)
    assert torch.equal(weight_gemv.fp4_picked_linear_cuda(xs, picks, packed, fp4_scales), want)


def test_fp4_gemv_reads_the_scale_bytes_at_the_ends_of_the_format_as_the_emulation():
    """The kernels' byte decode gives ``formats.decode_e8m0``'s bits for every byte; the FP4 expert GEMV on bytes 0,
    1, 2, 127, 250, 253, 254, 255 (``tests/fp4_scale_bytes.py``: exact by construction) gives the emulation's bits,
    NaN rows where it has them: x as given, over 2 slices of k, and quantized in the launch."""
    assert fp4_scale_bytes.decode_differs(CUDA) == ""
    case = {name: t.to(CUDA) for name, t in fp4_scale_bytes.gemv_case().items()}
    want = ops.fp4_picked_linear(**case, act="fp8")
    assert fp4_scale_bytes.gemv_case_lost(want.cpu()) == ""
    args = (case["x"], case["experts"], case["packed"], case["scales"])
    for got in (weight_gemv.fp4_expert_linear(*args), weight_gemv.fp4_expert_linear(*args, splits=2),
                weight_gemv.fp4_picked_linear_cuda(**case, act="fp8")):
        assert fp4_scale_bytes.nan_aware_differs(want, got) == ""
