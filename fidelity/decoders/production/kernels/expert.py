"""The SwiGLU expert with its element-wise middle in one launch (spec §4 MoE ``Expert``): the w1 / w3 GEMMs, then
``h = weight * silu(clamp(g)) * clamp(u)`` in fp32 stored bf16, then the w2 GEMM.

The middle takes the emulation's steps in its order: g and u from bf16, ``u`` clamped to [-limit, limit] and ``g``
to at most limit (NaN kept, as ``torch.clamp``), ``silu(g) = g / (1 + expf(-g))`` with libdevice's ``expf`` (the CUDA
``expf`` torch's ``silu`` calls) and an IEEE division, the product with u, then with the routing weight, one bf16
rounding; so it gives the emulation's bits on the GPU (``tests/gpu/test_kernels.py``). One launch replaces the
emulation's seven element-wise kernels per expert call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import fallbacks
from fidelity.decoders.production.kernels._common import INTERPRET, device_transparent, next_pow2, on_device
from fidelity.decoders.production.kernels.act_quant import act_linear_cuda
from fidelity.decoders.production.kernels.pdl import PDL_LAUNCH, wait_for_previous_kernel
from fidelity.decoders.production.kernels.rms_norm import _bf16_rne


@triton.jit
def _nan_clamp(v, lo, hi, LOWER: tl.constexpr):
    """``torch.clamp(v, min=lo if LOWER, max=hi)``: NaN stays NaN."""
    c = tl.minimum(v, hi)
    if LOWER:
        c = tl.maximum(c, lo)
    return tl.where(v != v, v, c)


@triton.jit(do_not_specialize=["n_cols"])
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, h_ptr, n_cols, limit, stride_g, stride_u, stride_h, BLOCK: tl.constexpr,
                   CLAMP: tl.constexpr, WEIGHTED: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Row pid0, columns pid1*BLOCK ..: h = (w_row *) silu(clamp(g)) * clamp(u) -> bf16."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        u = _nan_clamp(u, -limit, limit, True)
        g = _nan_clamp(g, -limit, limit, False)
    if LIBDEVICE:
        e = libdevice.exp(g * -1.0)
    else:  # Triton's CPU interpreter has no libdevice
        e = tl.exp(g * -1.0)
    h = tl.math.div_rn(g, 1.0 + e) * u
    if WEIGHTED:
        h = tl.load(w_ptr + row) * h
    tl.store(h_ptr + row * stride_h + cols, _bf16_rne(h).to(tl.bfloat16), mask=ok)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None, clamp: bool, *,
           block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """``ops.swiglu`` in one launch: g, u bf16 [n, f] (the w1 / w3 outputs), weight fp32 [n, 1] or None -> h bf16
    [n, f] (``clamp``: limit the values first)."""
    n, f = g.shape
    h = torch.empty((n, f), dtype=torch.bfloat16, device=g.device)
    w = weight.reshape(n).float().contiguous() if weight is not None else h
    if n and f:
        block = min(block, next_pow2(f))
        _swiglu_kernel[(n, triton.cdiv(f, block))](g, u, w, h, f, float(limit), g.stride(0), u.stride(0), h.stride(0),
                                                  BLOCK=block, CLAMP=clamp, WEIGHTED=weight is not None,
                                                  LIBDEVICE=not INTERPRET, num_warps=num_warps, **PDL_LAUNCH)
    return h


def expert_cuda(x: torch.Tensor, w1, w2, w3, limit: float, weight: torch.Tensor | None, act: str,
                linear: Callable | None = None) -> torch.Tensor:
    """Same signature and result as ``ops.expert`` (``linear`` defaults to the ``act_linear`` kernel; one with a
    ``pair(x, act) -> (g, u)`` attribute runs w1 and w3 in one call); the middle runs in :func:`swiglu` where g and
    u are bf16 matrices on the device, else as ``ops.swiglu``."""
    linear = linear or act_linear_cuda
    pair = getattr(linear, "pair", None)
    g, u = pair(x, act) if pair is not None else (linear(x, w1, act), linear(x, w3, act))
    clamp = ops.expert_clamps(limit, weight)
    rows_weight = weight is None or (weight.dim() == 2 and weight.shape == (g.shape[0], 1))
    if on_device(g) and g.dim() == 2 and g.dtype == u.dtype == torch.bfloat16 and g.shape == u.shape and rows_weight:
        h = swiglu(g, u, limit, weight, clamp)
    else:
        fallbacks.note("expert", fallbacks.UNSUPPORTED)
        h = ops.swiglu(g, u, limit, weight, clamp)
    return linear(h, w2, act)


expert = device_transparent(expert_cuda)
expert.__name__ = "triton_expert"
