"""The mHC kernels (``hc_pre``, ``hc_post``) at model widths against the emulation and their contracts."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import mhc  # noqa: E402
from fidelity.decoders.production.registry import dispatch  # noqa: E402
from fidelity.testing import Case, check_case  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, row_calc_diff  # noqa: E402


@pytest.mark.parametrize("dim", [4096, 7168])
@pytest.mark.parametrize(("n", "cfg"), [(37, {"precision": "tf32x3"}), (37, {"splits": 1, "precision": "tf32x3"}),
                                        (300, {"precision": "ieee"}), (5, {"splits": 7, "precision": "ieee"}),
                                        (37, {"precision": "bf16x3"}), (5, {"splits": 7, "precision": "bf16x3"}),
                                        (300, {"precision": "bf16x3", "bt": 64, "splits": 2, "num_warps": 8}),
                                        (300, {"precision": "bf16x3", "bt": 64, "splits": 1, "num_warps": 8}),
                                        (1100, {})])
def test_hc_pre_at_model_width(dim, n, cfg):
    """Each precision and launch (fused, split-K) against the emulation; ``{}`` is the default launch."""
    g = torch.Generator().manual_seed(dim + n)
    x = torch.randn(n, 4, dim, generator=g).to(BF16)
    fn = torch.randn(24, 4 * dim, generator=g) * (4 * dim) ** -0.5
    scale, base = torch.rand(3, generator=g) * 2, torch.randn(24, generator=g)
    found = mhc.hc_pre_cuda(x.to(CUDA), fn.to(CUDA), scale.to(CUDA), base.to(CUDA), 1e-6, 20, 1e-6, **cfg)
    emulated = ops.hc_pre(x, fn, scale, base, 1e-6, 20, 1e-6)
    assert float(row_calc_diff(found[0].cpu(), emulated[0]).max()) <= (1.25 * 2.0**-8) ** 2 / 2
    for f, e in zip(found[1:], emulated[1:], strict=True):
        assert float(((f.cpu() - e).abs() / e.abs().clamp(min=1e-30)).max()) <= 2.0**-12  # 2 x (2^-14 vs fp64)
    again = mhc.hc_pre_cuda(x.to(CUDA), fn.to(CUDA), scale.to(CUDA), base.to(CUDA), 1e-6, 20, 1e-6, **cfg)
    assert all(torch.equal(a, b) for a, b in zip(found, again, strict=True))  # deterministic (no atomics)
    check_case("hc_pre", dispatch("hc_pre"), Case({"x": x[:4], "fn": fn, "scale": scale, "base": base, "norm_eps": 1e-6,
                                           "iters": 20, "hc_eps": 1e-6}), device=CUDA)


def test_hc_pre_fp32_streams_default_to_tf32x3_and_refuse_bf16x3():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 4, 512, generator=g)
    fn = torch.randn(24, 4 * 512, generator=g) * 2048**-0.5
    scale, base = torch.rand(3, generator=g) * 2, torch.randn(24, generator=g)
    args = (fn.to(CUDA), scale.to(CUDA), base.to(CUDA), 1e-6, 20, 1e-6)
    found = mhc.hc_pre_cuda(x.to(CUDA), *args)
    assert all(torch.equal(a, b) for a, b in zip(found, mhc.hc_pre_cuda(x.to(CUDA), *args, precision="tf32x3"),
                                                 strict=True))
    for f, e in zip(found[1:], ops.hc_pre(x, fn, scale, base, 1e-6, 20, 1e-6)[1:], strict=True):
        assert float(((f.cpu() - e).abs() / e.abs().clamp(min=1e-30)).max()) <= 2.0**-12
    with pytest.raises(ValueError, match="precision 'bf16x3' takes bf16 streams, found torch.float32"):
        mhc.hc_pre_cuda(x.to(CUDA), *args, precision="bf16x3")


@pytest.mark.parametrize("dim", [4096, 7168, 100])
@pytest.mark.parametrize(("n", "res_dtype"), [(1, BF16), (37, BF16), (300, torch.float32)])
def test_hc_post_at_model_width(dim, n, res_dtype):
    g = torch.Generator().manual_seed(dim * 7 + n)
    f = torch.randn(n, dim, generator=g).to(BF16)
    res = (torch.randn(n, 4, dim, generator=g) * 3).to(res_dtype)
    post = torch.rand(n, 4, generator=g) * 2
    comb = torch.rand(n, 4, 4, generator=g)
    comb = comb / comb.sum(-1, keepdim=True)
    found = mhc.hc_post_cuda(f.to(CUDA), res.to(CUDA), post.to(CUDA), comb.to(CUDA), res_dtype).cpu()
    emulated = ops.hc_post(f, res, post, comb, res_dtype)
    assert found.dtype == res_dtype and found.shape == (n, 4, dim)
    # one output rounding (bf16: up to an ulp, 2^-7 relative, where fp32 FMA contraction moves the value across a
    # rounding boundary) plus fp32 rounding of the five terms (cancellation makes relative error meaningless)
    terms = (post[..., None] * f.double()[:, None]).abs() + (comb[..., None] * res.double()[:, :, None]).abs().sum(1)
    ulp = 2.0**-7 if res_dtype == BF16 else 2.0**-23
    bound = ulp * emulated.double().abs() + 8 * 2.0**-24 * terms
    assert bool(((found.double() - emulated.double()).abs() <= bound).all())
    if res_dtype == BF16:  # fp32 streams keep the fp32 summation-order differences
        assert float((found == emulated).float().mean()) >= 0.99
    check_case("hc_post", dispatch("hc_post"), Case({"f": f[:4, :64], "residual": res[:4, :, :64].to(BF16),
                                             "post": post[:4], "comb": comb[:4]}), device=CUDA)
