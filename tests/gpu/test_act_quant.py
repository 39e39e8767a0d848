"""FP8 activation quantization (``act_linear``, ``kv_round``): the emulation's bits on the GPU."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import act_quant  # noqa: E402
from fidelity.model.formats import fake_quant_fp8  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, PROPS, norm_cases, same_values  # noqa: E402


@PROPS
@given(case=norm_cases(), block=st.sampled_from((64, 128)), rows=st.sampled_from((1, 2)))
def test_fake_quant_fp8_is_bit_exact(case, block, rows):
    x, w, _ = case
    x = (x.float() * w.abs()).to(BF16)  # spread magnitudes across blocks; NaN rows / zero rows as drawn
    found = act_quant.fake_quant_fp8(x.to(CUDA), block, rows=rows).cpu()
    assert same_values(found, fake_quant_fp8(x, block))
    kv = x[:, :512] if x.shape[1] >= 512 else None
    if kv is not None:
        assert same_values(act_quant.kv_round_cuda(kv.to(CUDA), 64, "fp8").cpu(), ops.kv_round(kv, 64, "fp8"))


@pytest.mark.parametrize(("n", "k", "m"), [(1, 4096, 1024), (1, 1024, 32768 // 8), (7, 2048, 4096), (64, 8192, 512)])
def test_act_linear_equals_the_emulation_on_the_gpu(n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    x = (torch.randn(n, k, generator=g) * 3).to(BF16).to(CUDA)
    w = (torch.randn(m, k, generator=g) * k**-0.5).to(CUDA)
    assert torch.equal(act_quant.act_linear_cuda(x, w).view(torch.int16), ops.act_linear(x, w).view(torch.int16))
    assert torch.equal(act_quant.act_linear_cuda(x, w, "bf16"), ops.act_linear(x, w, "bf16"))
