"""The attention KV path in one kernel (spec §4 Attention step 2): ``kv_norm`` (RMSNorm with weight), interleaved
RoPE on the last 64 dims, and the in-place ``act_quant(kv[..., :448], 64, "ue8m0")`` FP8 round of the nope dims.

:func:`kv_norm_rope_fp8` equals ``ops.kv_norm_rope_fp8`` (``kv_round(apply_rope(rms_norm(x, w, eps), positions,
freqs), 64, fmt)``: the three ops the production model runs unfused) up to the fp32 summation order of the mean and
FMA contraction in the rotation (a bf16 rounding flip on a small fraction of elements); given the normalized,
rotated row, the FP8 round is bit-exact (:func:`fidelity.decoders.production.kernels._common.e4m3_blocks`).
The rotation reads the same complex64 table as ``ops.apply_rope`` (``op_spec.rope_table``: fp32 angles, torch's cos /
sin), so no trig library differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    SCALE_FLOOR_FALLBACK,
    UNSUPPORTED,
    e4m3_blocks,
    on_device,
    wait_for_previous_kernel,
)
from fidelity.decoders.production.op_spec import rope_table


@triton.jit(do_not_specialize=["n"])
def _kv_path_kernel(x_ptr, w_ptr, cis_ptr, y_ptr, n, eps, stride_x, stride_y, ROWS: tl.constexpr,
                    FP8: tl.constexpr):
    """Rows of 512 as [8 blocks, 32 pairs, 2]: blocks 0..6 = nope (FP8 blocks of 64), block 7 = rope."""
    wait_for_previous_kernel()
    blk = tl.arange(0, 8)
    pair = tl.arange(0, 32)
    two = tl.arange(0, 2)
    cols = blk[:, None, None] * 64 + pair[None, :, None] * 2 + two[None, None, :]
    w = tl.load(w_ptr + cols).to(tl.float32)
    is_rope = blk == 7
    for r in range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + r
        if row < n:
            x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
            ms = tl.math.div_rn(tl.sum(tl.sum(tl.sum(x * x, axis=2), axis=1), axis=0), 512.0)
            rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
            y = (w * (x * rs)).to(tl.bfloat16).to(tl.float32)  # kv_norm output, bf16
            a, b = tl.split(y)  # [8, 32] each: x[2i], x[2i+1]
            c = tl.load(cis_ptr + row * 64 + pair * 2)[None, :]
            s = tl.load(cis_ptr + row * 64 + pair * 2 + 1)[None, :]
            ra = (a * c - b * s).to(tl.bfloat16).to(tl.float32)
            rb = (a * s + b * c).to(tl.bfloat16).to(tl.float32)
            a = tl.where(is_rope[:, None], ra, a)
            b = tl.where(is_rope[:, None], rb, b)
            y = tl.reshape(tl.join(a, b), [8, 64])  # element 2i = a, 2i+1 = b
            if FP8:
                codes, _, scale = e4m3_blocks(y)
                deq = codes.to(tl.float32) * scale[:, None]
                out = tl.where(is_rope[:, None], y, deq).to(tl.bfloat16)
            else:
                out = y.to(tl.bfloat16)
            c2 = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
            tl.store(y_ptr + row * stride_y + c2, out)


def takes_kv_norm_rope_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                           freqs: torch.Tensor, fmt: str = "fp8", scale_floor: str = "amax") -> str | None:
    """Why :func:`kv_norm_rope_fp8` cannot take these inputs (None: it can): bf16 x [n, 512], weight [512],
    freqs [32], positions [n], the official scale rule (``scale_floor`` "amax"; FlashMLA's "scale" runs the
    emulation, and says so)."""
    if scale_floor != "amax":
        return SCALE_FLOOR_FALLBACK
    ok = (on_device(x) and x.dim() == 2 and x.shape[1] == 512 and x.dtype == torch.bfloat16
          and weight.shape == (512,) and freqs.numel() == 32 and positions.shape == (x.shape[0],))
    return None if ok else UNSUPPORTED


def kv_norm_rope_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     freqs: torch.Tensor, fmt: str = "fp8", scale_floor: str = "amax", *, rows: int = 1,
                     num_warps: int = 2) -> torch.Tensor:
    """x [n, 512] bf16 (the ``wkv`` GEMM output), weight [512] (``kv_norm``), positions [n] int, freqs [32]
    -> kv bf16 [n, 512] as the emulation's three ops (the official scale rule only: ``takes_kv_norm_rope_fp8``)."""
    if scale_floor != "amax":
        raise ValueError(f"kv_norm_rope_fp8: implements scale_floor 'amax' only, found {scale_floor!r}")
    n = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((n, 512), dtype=torch.bfloat16, device=x.device)
    if n:
        cis = torch.view_as_real(rope_table(freqs, positions)).contiguous()  # [n, 32, 2] fp32
        _kv_path_kernel[(triton.cdiv(n, rows),)](x, weight.contiguous(), cis, y, n, float(eps), x.stride(0),
                                                 y.stride(0), ROWS=rows, FP8=fmt == "fp8", num_warps=num_warps,
                                                 **PDL_LAUNCH)
    return y
