"""Decode GEMMs that read the weights as the release stores them (memory-bound GEMV path, a few rows).

* ``fp8_weight_linear``: y [m, n] bf16 = xq [m, k] @ W^T with W held as e4m3 codes [n, k] and its 128x128 block
  scales (decoded to fp32, [n/128, k/128]): 1 byte per weight read instead of the 4 of the dequantized fp32 copy.
  Each weight is dequantized exactly in registers (code x 2^e) and the products accumulate in fp32, as the
  emulation's fp32 GEMM does, in another order (tolerance contract of ``act_linear``).
* ``fp4_expert_linear``: for slots s, y [s, n] bf16 = xq[s] @ W[e_s]^T with W[e] the FP4 e2m1 codes of expert e
  (two per byte, low nibble first, [E, n, k/2]) and its 1x32 scales (fp32 [E, n, k/32]); the expert ids stay on
  the device, so a captured CUDA graph picks the experts without copying their weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import fallbacks
from fidelity.decoders.production.kernels._common import device_transparent, next_pow2, on_device
from fidelity.decoders.production.kernels.act_quant import fake_quant_fp8

FP8_BLOCK = 128


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, n, k: tl.constexpr, stride_x, stride_w, stride_s, stride_y,
                     M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows pid*BN .. +BN of y for all M inputs (MP: M rounded up to a power of two); BK = 128, one scale block
    along k per step."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    ok = rows < n
    cols = tl.arange(0, BK)
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    for k0 in range(0, k, BK):
        w = tl.load(w_ptr + rows[:, None] * stride_w + (k0 + cols)[None, :], mask=ok[:, None], other=0)
        s = tl.load(s_ptr + (rows // 128) * stride_s + k0 // 128, mask=ok, other=0.0)
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]  # exact: code x 2^e
        for m in tl.static_range(M):
            x = tl.load(x_ptr + m * stride_x + k0 + cols)
            part = tl.sum(wf * x[None, :], axis=1)  # [BN]
            acc = tl.where(tl.arange(0, MP)[:, None] == m, acc + part[None, :], acc)
    for m in tl.static_range(M):
        y = tl.sum(tl.where(tl.arange(0, MP)[:, None] == m, acc, 0.0), axis=0)
        tl.store(y_ptr + m * stride_y + rows, y.to(tl.bfloat16), mask=ok)


def fp8_weight_linear(xq: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bn: int = 16,
                      stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """xq [m, k] (bf16 or fp32, on the e4m3 grid or not: multiplied as given) @ (codes [n, k] e4m3 / uint8 x
    scales fp32 [n/128, k/128])^T -> bf16 [m, n]; k a multiple of 128, m <= 8."""
    m, k = xq.shape
    n = codes.shape[0]
    if codes.shape[1] != k or k % FP8_BLOCK or scales.shape != ((n + 127) // 128, k // 128) or not 1 <= m <= 8:
        raise ValueError(f"fp8_weight_linear: expected xq [m<=8, k], codes [n, k], scales [n/128, k/128] with k % 128 "
                         f"== 0, found xq {tuple(xq.shape)}, codes {tuple(codes.shape)}, scales {tuple(scales.shape)}")
    x = xq.float().contiguous()
    w = codes.view(torch.uint8)
    s = scales.float().contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](x, w, s, y, n, k, x.stride(0), w.stride(0), s.stride(0), y.stride(0),
                                            M=m, MP=next_pow2(m), BN=bn, BK=FP8_BLOCK, num_stages=stages,
                                            num_warps=num_warps)
    return y


@triton.jit
def _fp4_value(c):
    """fp32 value of e2m1 nibble codes c (int32 0..15): exponent field e, mantissa bit m."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _fp4_expert_kernel(x_ptr, e_ptr, w_ptr, s_ptr, y_ptr, n, k: tl.constexpr, stride_x, stride_we, stride_wn, stride_se,
                       stride_sn, stride_y, BN: tl.constexpr, BK: tl.constexpr):
    """Rows pid0*BN .. +BN of slot pid1's output; BK packed bytes (2*BK weights) per step."""
    slot = tl.program_id(1)
    e = tl.load(e_ptr + slot).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    ok = rows < n
    cols = tl.arange(0, BK)
    acc = tl.zeros([BN], dtype=tl.float32)
    w_base = w_ptr + e * stride_we + rows[:, None] * stride_wn
    s_base = s_ptr + e * stride_se + rows[:, None] * stride_sn
    blocks = tl.arange(0, BK // 16)
    for b0 in range(0, k // 2, BK):
        byte = tl.load(w_base + (b0 + cols)[None, :], mask=ok[:, None], other=0).to(tl.int32)
        s = tl.load(s_base + (b0 // 16 + blocks)[None, :], mask=ok[:, None], other=0.0)  # one per 16 bytes
        x_lo = tl.load(x_ptr + slot * stride_x + 2 * (b0 + cols))
        x_hi = tl.load(x_ptr + slot * stride_x + 2 * (b0 + cols) + 1)
        part = _fp4_value(byte & 15) * x_lo[None, :] + _fp4_value(byte >> 4) * x_hi[None, :]  # [BN, BK]
        part = tl.sum(tl.reshape(part, [BN, BK // 16, 16]), axis=2)  # per 32-weight block
        acc += tl.sum(part * s, axis=1)
    tl.store(y_ptr + slot * stride_y + rows, acc.to(tl.bfloat16), mask=ok)


def fp4_expert_linear(xq: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
                      bn: int = 16, bk: int = 128, stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """For each slot s: xq[s] [k] @ W[experts[s]]^T -> bf16 [slots, n], W[e] = FP4 codes packed [E, n, k/2] (uint8)
    x scales fp32 [E, n, k/32]. ``experts`` int [slots] on the device (not read on the host)."""
    slots, k = xq.shape
    e_count, n, half = packed.shape
    if half * 2 != k or k % (2 * bk) or scales.shape != (e_count, n, k // 32) or experts.shape != (slots,):
        raise ValueError(f"fp4_expert_linear: expected xq [s, k], experts [s], packed [E, n, k/2], scales [E, n, "
                         f"k/32] with k % {2 * bk} == 0, found xq {tuple(xq.shape)}, experts "
                         f"{tuple(experts.shape)}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}")
    x = xq.float().contiguous()
    w = packed.view(torch.uint8)
    y = torch.empty((slots, n), dtype=torch.bfloat16, device=xq.device)
    grid = (triton.cdiv(n, bn), slots)
    _fp4_expert_kernel[grid](x, experts, w, scales, y, n, k, x.stride(0), w.stride(0), w.stride(1), scales.stride(0),
                             scales.stride(1), y.stride(0), BN=bn, BK=bk, num_stages=stages, num_warps=num_warps)
    return y


def fp8_weight_linear_cuda(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, act: str = "fp8"
                           ) -> torch.Tensor:
    """Same signature and result (within the ``act_linear`` contract) as ``ops.fp8_weight_linear``: the 1x128
    activation quantization in one launch, then the FP8 GEMV."""
    m, k = x.shape
    if act != "fp8" or x.dtype != torch.bfloat16 or not 1 <= m <= ops.GEMV_ROWS or k % FP8_BLOCK or not on_device(x):
        fallbacks.note("fp8_weight_linear", fallbacks.UNSUPPORTED)
        return ops.fp8_weight_linear(x, codes, scales, act)
    return fp8_weight_linear(fake_quant_fp8(x, 128), codes, scales)


def fp4_picked_linear_cuda(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                           act: str = "fp8") -> torch.Tensor:
    """Same signature and result (within the ``act_linear`` contract) as ``ops.fp4_picked_linear``."""
    s, k = x.shape
    if act != "fp8" or x.dtype != torch.bfloat16 or not 1 <= s <= 8 * ops.GEMV_ROWS or k % 256 or not on_device(x):
        fallbacks.note("fp4_picked_linear", fallbacks.UNSUPPORTED)
        return ops.fp4_picked_linear(x, experts, packed, scales, act)
    return fp4_expert_linear(fake_quant_fp8(x, 128), experts, packed, scales)


fp8_weight_linear_op = device_transparent(fp8_weight_linear_cuda)
fp8_weight_linear_op.__name__ = "triton_fp8_weight_linear"
fp4_picked_linear_op = device_transparent(fp4_picked_linear_cuda)
fp4_picked_linear_op.__name__ = "triton_fp4_picked_linear"
