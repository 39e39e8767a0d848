"""The attention KV path in one kernel (spec §4 Attention step 2): ``kv_norm`` (RMSNorm with weight), interleaved
RoPE on the last 64 dims, and the in-place ``act_quant(kv[..., :448], 64, "ue8m0")`` FP8 round of the nope dims.

:func:`kv_norm_rope_fp8` equals ``ops.kv_norm_rope_fp8`` (``kv_round(apply_rope(rms_norm(x, w, eps), positions,
freqs), 64, fmt)``: the three ops the production model runs unfused) up to the fp32 summation order of the mean and
FMA contraction in the rotation (a bf16 rounding flip on a small fraction of elements); given the normalized,
rotated row, the FP8 round is bit-exact (:func:`fidelity.decoders.production.kernels.rms_norm.e4m3_blocks`).
The rotation reads the same complex64 table as ``ops.apply_rope`` (``ops.rope_table``: fp32 angles, torch's cos /
sin), so no trig library differs.

Optionally the same launch writes the 584 B/token FP8 cache row that
:func:`fidelity.decoders.production.kernels.sparse_attention.sparse_attention_fp8kv` reads
(``[448 e4m3 | 64 bf16 rope | 7 ue8m0 | 1 pad]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import fallbacks
from fidelity.decoders.production.kernels._common import device_transparent, on_device
from fidelity.decoders.production.kernels.act_quant import kv_round_cuda
from fidelity.decoders.production.kernels.pdl import PDL_LAUNCH, wait_for_previous_kernel
from fidelity.decoders.production.kernels.rms_norm import e4m3_blocks, rms_norm_cuda
from fidelity.decoders.production.kernels.sparse_attention import pack_kv_fp8


@triton.jit(do_not_specialize=["n"])
def _kv_path_kernel(x_ptr, w_ptr, cis_ptr, y_ptr, p8_ptr, p16_ptr, n, eps, stride_x, stride_y,
                    ROWS: tl.constexpr, FP8: tl.constexpr, PACK: tl.constexpr):
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
                codes, sbyte, scale = e4m3_blocks(y)
                deq = codes.to(tl.float32) * scale[:, None]
                out = tl.where(is_rope[:, None], y, deq).to(tl.bfloat16)
            else:
                out = y.to(tl.bfloat16)
            c2 = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
            tl.store(y_ptr + row * stride_y + c2, out)
            if PACK:
                tl.store(p8_ptr + row * 584 + c2, codes.to(tl.uint8, bitcast=True), mask=c2 < 448)
                tl.store(p16_ptr + row * 292 + 224 + (c2 - 448), out, mask=c2 >= 448)
                tl.store(p8_ptr + row * 584 + 576 + blk, tl.where(is_rope, 0, sbyte).to(tl.uint8))


def kv_norm_rope_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     freqs: torch.Tensor, fmt: str = "fp8", *, pack: bool = False, rows: int = 1,
                     num_warps: int = 2):
    """x [n, 512] bf16 (the ``wkv`` GEMM output), weight [512] (``kv_norm``), positions [n] int, freqs [32]
    -> kv bf16 [n, 512] as the emulation's three ops; with ``pack`` also the uint8 [n, 584] FP8 cache rows
    (``fmt`` must be "fp8"). Other shapes, or CPU tensors without the interpreter, run the emulation."""
    if pack and fmt != "fp8":
        raise ValueError(f"pack: the 584 B layout holds FP8 nope dims, found fmt={fmt!r}")
    ok = (on_device(x) and x.dim() == 2 and x.shape[1] == 512 and x.dtype == torch.bfloat16
          and weight.shape == (512,) and freqs.numel() == 32 and positions.shape == (x.shape[0],))
    if not ok:  # the three ops as the unfused model runs them here (its kernels on CUDA), so an A/B sees no change
        fallbacks.note("kv_norm_rope_fp8", fallbacks.UNSUPPORTED)
        if on_device(x):
            kv = kv_round_cuda(ops.apply_rope(rms_norm_cuda(x, weight, eps), positions, freqs), 2 * freqs.numel(), fmt)
        else:
            kv = ops.kv_norm_rope_fp8(x, weight, eps, positions, freqs, fmt)
        return (kv, pack_kv_fp8(kv)) if pack else kv
    n = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((n, 512), dtype=torch.bfloat16, device=x.device)
    packed = torch.empty((n, 584), dtype=torch.uint8, device=x.device) if pack else y
    p16 = packed.view(torch.bfloat16) if pack else y
    if n:
        cis = torch.view_as_real(ops.rope_table(freqs, positions)).contiguous()  # [n, 32, 2] fp32
        _kv_path_kernel[(triton.cdiv(n, rows),)](x, weight.contiguous(), cis, y, packed, p16, n, float(eps),
                                                 x.stride(0), y.stride(0), ROWS=rows, FP8=fmt == "fp8", PACK=pack,
                                                 num_warps=num_warps, **PDL_LAUNCH)
    return (y, packed) if pack else y


kv_path = device_transparent(kv_norm_rope_fp8)
kv_path.__name__ = "triton_kv_path"
