"""Fused mHC ``hc_pre`` in Triton (spec §4 mHC block, §3 ``hc_split_sinkhorn``): one launch for the mixes
projection, the RMS factor, the sigmoid / Sinkhorn split (20 rounds) and the collapse ``y = sum_i pre_i x_i``.

One program handles ``BT`` tokens: pass 1 streams ``x`` [BT, 4*dim] against ``fn`` [24, 4*dim] (fp32 FMA,
``input_precision="ieee"``: the reference's fp32 ``F.linear``, no TF32) and the sum of squares; the 24 mixes
then go through the split and Sinkhorn in registers; pass 2 re-reads the token's streams (L2-resident) for the
fp32 collapse, rounded once to bf16. Outputs as ``ops.hc_pre``: (y bf16 [n, dim], pre [n, 4], post [n, 4],
comb [n, 4, 4] fp32). fp32 summation order differs from torch (tolerance contract of ``hc_pre``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.production import ops
from fidelity.production.faults import on
from fidelity.production.kernels._common import device_transparent, on_device


@triton.jit(do_not_specialize=["n", "iters"])
def _hc_pre_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
                   n, dim, norm_eps, hc_eps, iters, stride_xn,
                   BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    toks = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tmask = toks < n
    K = 4 * dim
    r32 = tl.arange(0, 32)
    mix = tl.zeros([BT, 32], tl.float32)
    ssq = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < K
        xk = tl.load(x_ptr + toks[:, None] * stride_xn + ks[None, :], mask=tmask[:, None] & km[None, :],
                     other=0.0).to(tl.float32)
        ssq += tl.sum(xk * xk, axis=1)
        fk = tl.load(fn_ptr + r32[None, :] * K + ks[:, None], mask=(r32[None, :] < 24) & km[:, None], other=0.0)
        mix += tl.dot(xk, fk, input_precision=PREC)
    rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ssq, K.to(tl.float32)) + norm_eps))
    mix = mix * rs[:, None]
    # split: one-hot selections (exact) of columns 0..3, 4..7, 8..23
    r4 = tl.arange(0, 4)
    r16 = tl.arange(0, 16)
    sel_pre = (r32[None, :] == r4[:, None]).to(tl.float32)  # [4, 32]
    sel_post = (r32[None, :] == r4[:, None] + 4).to(tl.float32)
    sel_comb = (r32[None, :] == r16[:, None] + 8).to(tl.float32)  # [16, 32]
    m_pre = tl.sum(mix[:, None, :] * sel_pre[None, :, :], axis=2)  # [BT, 4]
    m_post = tl.sum(mix[:, None, :] * sel_post[None, :, :], axis=2)
    m_comb = tl.sum(mix[:, None, :] * sel_comb[None, :, :], axis=2)  # [BT, 16]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + r4)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + 4 + r4)[None, :])
    c = tl.reshape(m_comb * s2 + tl.load(base_ptr + 8 + r16)[None, :], [BT, 4, 4])
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(pre_ptr + toks[:, None] * 4 + r4[None, :], pre, mask=tmask[:, None])
    tl.store(post_ptr + toks[:, None] * 4 + r4[None, :], post, mask=tmask[:, None])
    tl.store(comb_ptr + toks[:, None] * 16 + r16[None, :], tl.reshape(c, [BT, 16]), mask=tmask[:, None])
    # collapse: y = sum_i pre_i * x_i in fp32 -> bf16
    for d0 in range(0, dim, BD):
        ds = d0 + tl.arange(0, BD)
        dm = ds < dim
        xs = tl.load(x_ptr + toks[:, None, None] * stride_xn + r4[None, :, None] * dim + ds[None, None, :],
                     mask=tmask[:, None, None] & dm[None, None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, :, None] * xs, axis=1)
        tl.store(y_ptr + toks[:, None] * dim + ds[None, :], y.to(tl.bfloat16), mask=tmask[:, None] & dm[None, :])


def hc_pre_cuda(x, fn, scale, base, norm_eps, iters, hc_eps, *, bt: int = 16, bk: int = 128, bd: int = 256,
                num_warps: int = 4, precision: str = "ieee"):
    """Same signature and outputs as ``ops.hc_pre``; x [n, 4, dim] (bf16 or fp32 streams) on CUDA (injected
    Sinkhorn faults run the torch emulation). ``precision="tf32x3"`` does the mixes GEMM on the tensor cores
    with three TF32 products (about fp32 accuracy, not fp32's rounding); the default ``"ieee"`` is fp32 FMA."""
    if not (on_device(x) and x.dim() == 3 and x.shape[1] == 4 and fn.shape == (24, 4 * x.shape[2])
            and x.dtype in (torch.bfloat16, torch.float32)) or on("sinkhorn-3-iters") or on("comb-transposed"):
        return ops.hc_pre(x, fn, scale, base, norm_eps, iters, hc_eps)
    n, _, dim = x.shape
    x = x.contiguous()
    dev = x.device
    y = torch.empty((n, dim), dtype=torch.bfloat16, device=dev)
    pre = torch.empty((n, 4), dtype=torch.float32, device=dev)
    post = torch.empty((n, 4), dtype=torch.float32, device=dev)
    comb = torch.empty((n, 4, 4), dtype=torch.float32, device=dev)
    if n:
        _hc_pre_kernel[(triton.cdiv(n, bt),)](
            x, fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous(), y, pre, post, comb,
            n, dim, float(norm_eps), float(hc_eps), int(iters), x.stride(0), BT=bt, BK=bk, BD=bd, PREC=precision,
            num_warps=num_warps)
    return y, pre, post, comb


hc_pre = device_transparent(hc_pre_cuda)
hc_pre.__name__ = "triton_hc_pre"
