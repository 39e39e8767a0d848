"""The SwiGLU expert with its element-wise middle in one launch (spec §4 MoE ``Expert``): the w1 / w3 GEMMs, then
``h = weight * silu(clamp(g)) * clamp(u)`` in fp32 stored bf16, then the w2 GEMM.

The middle takes the emulation's steps in its order: g and u from bf16, ``u`` clamped to [-limit, limit] and ``g``
to at most limit (NaN kept, as ``torch.clamp``), ``silu(g) = g / (1 + expf(-g))`` with libdevice's ``expf`` (the CUDA
``expf`` torch's ``silu`` calls) and an IEEE division, the product with u, then with the routing weight, one bf16
rounding; so it gives the emulation's bits on the GPU (``tests/gpu/``). One launch replaces the
emulation's seven element-wise kernels per expert call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    PDL_LAUNCH,
    UNSUPPORTED,
    bf16_rne,
    next_pow2,
    wait_for_previous_kernel,
)
from fidelity.decoders.production.kernels.act_quant import act_linear_cuda, takes_act_linear


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
    tl.store(h_ptr + row * stride_h + cols, bf16_rne(h).to(tl.bfloat16), mask=ok)


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


def takes_expert(x, w1, w2, w3, limit: float, weight: torch.Tensor | None, act: str,
                 linear: Callable | None = None) -> str | None:
    """Why :func:`expert_cuda` cannot take these inputs (None: it can): x [n, k] on the device, a routing weight
    [n, 1] or None; without ``linear``, inputs ``act_linear``'s kernel takes, and w1 [f, k] with 128 | f."""
    rows = getattr(x, "shape", (0,))[0]
    if weight is not None and (weight.dim() != 2 or weight.shape != (rows, 1)):
        return UNSUPPORTED
    if linear is None:
        return takes_act_linear(x, w1, act) or (UNSUPPORTED if w1.shape[0] % 128 else None)
    return None


def expert_cuda(x: torch.Tensor, w1, w2, w3, limit: float, weight: torch.Tensor | None, act: str,
                linear: Callable | None = None) -> torch.Tensor:
    """Same signature and result as ``ops.expert`` (``linear`` defaults to the ``act_linear`` kernel; one with a
    ``pair(x, act) -> (g, u)`` attribute runs w1 and w3 in one call); the middle runs in :func:`swiglu`, g and u
    bf16 [n, f] on the device, clamped where ``limit`` > 0."""
    linear = linear or act_linear_cuda
    pair = getattr(linear, "pair", None)
    g, u = pair(x, act) if pair is not None else (linear(x, w1, act), linear(x, w3, act))
    return linear(swiglu(g, u, limit, weight, limit > 0), w2, act)
