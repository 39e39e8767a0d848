"""Interleaved RoPE in one launch (spec §4 Attention step 3, ``apply_rotary_emb``): the pairs (x[2i], x[2i+1]) of
the last ``2 * len(freqs)`` dims rotated by ``fp32(position) * fp32(freq_i)``, the other dims copied.

``ops.apply_rope`` builds a complex64 table (``torch.polar``: CUDA's ``cosf`` / ``sinf`` of the fp32 angle) and
multiplies in complex64; this kernel takes the same angle, the same ``cosf`` / ``sinf`` (Triton compiles ``tl.cos`` /
``tl.sin`` to libdevice's ``__nv_cosf`` / ``__nv_sinf``: ``tests/test_decode_kernels_ptx.py``), the complex product
rounded as torch's CUDA kernel rounds it (``ROTATION``) and one bf16 rounding, so it gives the emulation's bits on the
GPU. One launch replaces the emulation's eight kernels per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    ROTATION,
    UNSUPPORTED,
    bf16_rne,
    next_pow2,
    on_device,
    rotated,
    wait_for_previous_kernel,
)


@triton.jit(do_not_specialize=["n_rows"])
def _rope_kernel(x_ptr, pos_ptr, f_ptr, y_ptr, n_rows, heads, stride_x, stride_y, D: tl.constexpr,
                 HALF: tl.constexpr, FIRST: tl.constexpr, ROWS: tl.constexpr, INVERSE: tl.constexpr,
                 ROTATION: tl.constexpr):
    """Rows [ROWS, HALF pairs, 2] of x [n_rows, D]; pairs from FIRST on rotate (row r at positions[r // heads])."""
    wait_for_previous_kernel()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    pair = tl.arange(0, HALF)
    two = tl.arange(0, 2)
    cols = pair[None, :, None] * 2 + two[None, None, :]
    mask = (rows < n_rows)[:, None, None] & (cols < D)
    x = tl.load(x_ptr + rows[:, None, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    a, b = tl.split(x)
    rope = pair >= FIRST
    freq = tl.load(f_ptr + (pair - FIRST), mask=rope, other=0.0)
    pos = tl.load(pos_ptr + rows // heads, mask=rows < n_rows, other=0).to(tl.float32)
    angle = pos[:, None] * freq[None, :]
    c, s = tl.cos(angle), tl.sin(angle)  # libdevice __nv_cosf / __nv_sinf on the GPU, as torch.polar
    if INVERSE:
        s = s * -1.0  # the conjugate (-0 kept)
    ra, rb = rotated(a, b, c, s, ROTATION)
    y = tl.join(tl.where(rope[None, :], ra, a), tl.where(rope[None, :], rb, b))
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_rne(y)  # exact in bf16 now: the store below does not round again
    tl.store(y_ptr + rows[:, None, None] * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def takes_apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                     inverse: bool = False) -> str | None:
    """Why :func:`apply_rope_cuda` cannot take these inputs (None: it can): x bf16 / fp32 [n, d] or [n, H, d]."""
    d, rd = x.shape[-1], 2 * freqs.numel()
    ok = (on_device(x) and x.dim() in (2, 3) and positions.shape == (x.shape[0],) and d % 2 == 0 and 0 < rd <= d
          and x.dtype in (torch.bfloat16, torch.float32))
    return None if ok else UNSUPPORTED


def apply_rope_cuda(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, *,
                    rows: int = 4, num_warps: int = 4, rotation: int | None = None) -> torch.Tensor:
    """Same signature as ``ops.apply_rope``: x [n, d] or [n, H, d] (bf16 / fp32), positions [n], freqs [rd/2]."""
    d, rd = x.shape[-1], 2 * freqs.numel()
    heads = x.shape[1] if x.dim() == 3 else 1
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rope_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, positions.contiguous(), freqs.to(torch.float32).contiguous(), y, x2.shape[0], heads, x2.stride(0),
            y.stride(0), D=d, HALF=next_pow2(d // 2), FIRST=(d - rd) // 2, ROWS=rows, INVERSE=inverse,
            ROTATION=ROTATION if rotation is None else rotation, num_warps=num_warps, enable_fp_fusion=False,
            **PDL_LAUNCH)
    return y.reshape(x.shape)
