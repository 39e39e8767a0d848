"""The routed experts of many tokens as two grouped GEMMs over the stored FP4 experts (spec §4 MoE, §2 formats):
op ``grouped_expert`` for a prefill chunk, a handful of launches per layer whatever the number of experts.

* The (token, slot) pairs are sorted by expert once on the device (``torch.sort``); M-tiles of ``block_m`` rows
  never straddle two experts. One host read per call (three integers: the smallest and largest expert id, for the
  range check, and the tile count, which sizes both grids).
* ``_w13_kernel``: per (M-tile, N-tile of f) the w1 and w3 GEMMs in one pass (two fp32 accumulators, ``tl.dot``
  on bf16 operands), the gathered token rows of x (FP8-quantized-dequantized first, one launch for all tokens),
  the FP4 codes and 1x32 scales read as stored (e8m0 scale bytes uint8, one per 32 weights, made into the fp32
  power of two by ``e8m0_scale``'s bit moves) and dequantized in the kernel to bf16 (exact: e2m1 x 2^k). Its
  epilogue is ``ops.swiglu`` (g, u rounded bf16, clamp, ``silu`` with libdevice ``expf`` and an IEEE division,
  times u, times the routing weight, one bf16 rounding, as ``kernels/expert.py``) and, for act "fp8", the 1x128
  e4m3 quantize-dequantize of w2's input (``e4m3_blocks``: one block per 128-column tile).
* ``_w2_kernel``: per (M-tile, N-tile of dim) the w2 GEMM on those rows, stored bf16 into each pair's slot of
  y [n, k, dim].

Contract (``fidelity.testing.contracts.grouped_expert``): expert's per-row bound. The products are exact in fp32
(bf16 x bf16), so the result differs from the per-expert cuBLAS path (``ops.grouped_expert`` on the GPU) only by
the fp32 accumulation order of the GEMMs, which the bf16 roundings of g, u and y then usually absorb; not bit-equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    UNSUPPORTED,
    bf16_rne,
    e4m3_blocks,
    e8m0_scale,
    on_device,
)
from fidelity.decoders.production.kernels.act_quant import fake_quant_fp8
from fidelity.decoders.production.op_spec import check_grouped_expert, expert_range_error

BLOCK_N = 128  # one 1x128 activation-quantization block per N-tile of the w1 / w3 outputs
BLOCK_K = 128
LAUNCH = {"block_m": 64, "num_warps": 8, "num_stages": 3}


@triton.jit
def _fp4_tile(codes_ptr, scales_ptr, rows, k0, stride_c, stride_s, BN: tl.constexpr, BK: tl.constexpr):
    """Rows ``rows`` [BN], columns k0 .. k0 + BK of one FP4 weight as stored (codes uint8 [out, in/2], low nibble
    first; e8m0 scale bytes uint8 [out, in/32], ``e8m0_scale``) -> bf16 [BN, BK], exactly code value x scale (NaN
    for a 255 byte)."""
    half = k0 // 2 + tl.arange(0, BK // 2)
    p = tl.load(codes_ptr + rows[:, None] * stride_c + half[None, :]).to(tl.int32)
    c = tl.reshape(tl.join(p & 15, p >> 4), [BN, BK])
    mag = c & 7  # e2m1: 0, 0.5, then (1 + m / 2) 2^(e - 1) from the exponent field e = mag >> 1
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
    v = (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    s = e8m0_scale(tl.load(scales_ptr + rows[:, None] * stride_s + (k0 // 32 + tl.arange(0, BK // 32))[None, :]))
    return tl.reshape(tl.reshape(v, [BN, BK // 32, 32]) * s[:, :, None], [BN, BK]).to(tl.bfloat16)


@triton.jit
def _dot(a, w, acc, F32: tl.constexpr):
    """acc + a @ w^T for bf16 a [BM, BK], w [BN, BK]; F32 (the interpreter, whose bf16 dot is wrong): the same
    exact products on their fp32 values."""
    if F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _tile(tile_ptr, pid, n_col_tiles, BM: tl.constexpr):
    """Program pid's (expert, rows [BM], row mask, column tile): tiles hold (expert, first row, end row)."""
    t, col = pid // n_col_tiles, pid % n_col_tiles
    e = tl.load(tile_ptr + 3 * t).to(tl.int64)
    rows = tl.load(tile_ptr + 3 * t + 1) + tl.arange(0, BM)
    return e, rows, rows < tl.load(tile_ptr + 3 * t + 2), col


@triton.jit
def _swiglu(g, u, w, limit, CLAMP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``ops.swiglu`` on fp32 g, u (bf16 values) and the rows' routing weights w [BM, 1] -> fp32 (not rounded)."""
    if CLAMP:
        u = tl.where(u != u, u, tl.maximum(tl.minimum(u, limit), -limit))
        g = tl.where(g != g, g, tl.minimum(g, limit))
    if LIBDEVICE:
        e = libdevice.exp(g * -1.0)
    else:  # Triton's CPU interpreter has no libdevice
        e = tl.exp(g * -1.0)
    return w * (tl.math.div_rn(g, 1.0 + e) * u)


@triton.jit
def _w13_kernel(x_ptr, token_ptr, weight_ptr, tile_ptr, codes_ptr, scales_ptr, h_ptr, limit, stride_x, stride_ce,
                stride_cr, stride_se, stride_sr, stride_h, DIM: tl.constexpr, F: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, CLAMP: tl.constexpr, QUANT: tl.constexpr, LIBDEVICE: tl.constexpr,
                F32: tl.constexpr):
    """h[rows, cols] = swiglu(x[token] @ W1^T, x[token] @ W3^T, weight) bf16 (FP8 grid when QUANT)."""
    e, rows, ok, col = _tile(tile_ptr, tl.program_id(0), F // BN, BM)
    tok = tl.load(token_ptr + rows, mask=ok, other=0).to(tl.int64)
    cols = col * BN + tl.arange(0, BN)
    codes, scales = codes_ptr + e * stride_ce, scales_ptr + e * stride_se
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, DIM, BK):
        xa = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + tl.arange(0, BK))[None, :], mask=ok[:, None], other=0.0)
        acc_g = _dot(xa, _fp4_tile(codes, scales, cols, k0, stride_cr, stride_sr, BN, BK), acc_g, F32)
        acc_u = _dot(xa, _fp4_tile(codes, scales, cols + F, k0, stride_cr, stride_sr, BN, BK), acc_u, F32)
    w = tl.load(weight_ptr + rows, mask=ok, other=0.0)
    h = bf16_rne(_swiglu(bf16_rne(acc_g), bf16_rne(acc_u), w[:, None], limit, CLAMP, LIBDEVICE))
    if QUANT:
        q, _, s = e4m3_blocks(h)
        h = q.to(tl.float32) * s[:, None]
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h.to(tl.bfloat16), mask=ok[:, None])


@triton.jit
def _w2_kernel(h_ptr, slot_ptr, tile_ptr, codes_ptr, scales_ptr, y_ptr, stride_h, stride_ce, stride_cr, stride_se,
               stride_sr, stride_y, DIM: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, F32: tl.constexpr):
    """y[slot[rows], cols] = h[rows] @ W2^T -> bf16."""
    e, rows, ok, col = _tile(tile_ptr, tl.program_id(0), DIM // BN, BM)
    cols = col * BN + tl.arange(0, BN)
    codes, scales = codes_ptr + e * stride_ce, scales_ptr + e * stride_se
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, F, BK):
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + (k0 + tl.arange(0, BK))[None, :],
                    mask=ok[:, None], other=0.0)
        acc = _dot(a, _fp4_tile(codes, scales, cols, k0, stride_cr, stride_sr, BN, BK), acc, F32)
    slot = tl.load(slot_ptr + rows, mask=ok, other=0).to(tl.int64)
    tl.store(y_ptr + slot[:, None] * stride_y + cols[None, :], bf16_rne(acc).to(tl.bfloat16), mask=ok[:, None])


def takes_grouped_expert(x, weights, experts, w13, w13_scales, w2, w2_scales, limit: float, act: str = "fp8",
                         quantized: bool = False) -> str | None:
    """Why :func:`grouped_expert_cuda` cannot take these inputs (None: it can): tensors on the device, act "fp8"
    or "bf16", dim and f multiples of 128. Inputs of a wrong dtype or shape raise (``check_grouped_expert``)."""
    check_grouped_expert(x, weights, experts, w13, w13_scales, w2, w2_scales)
    if act not in ("fp8", "bf16") or not on_device(x) or x.shape[1] % BLOCK_K or w2.shape[2] % (BLOCK_N // 2):
        return UNSUPPORTED
    return None


def expert_tiles(experts: torch.Tensor, e_count: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The (token, slot) pairs of experts [n, k] sorted by expert (ascending pair within each): (order int64
    [n k], the flat pair of each sorted row; tiles int32 [T, 3]: expert, first row, end row of each M-tile of at
    most ``block_m`` rows of one expert; T). One host read (ids range and T); raises on ids outside [0, e_count)."""
    ids, order = experts.flatten().long().sort(stable=True)
    bounds = torch.searchsorted(ids, torch.arange(e_count + 1, device=ids.device))
    per_expert = (bounds.diff() + block_m - 1) // block_m
    ends = per_expert.cumsum(0)
    lo, hi, n_tiles = torch.stack((ids[0], ids[-1], ends[-1])).tolist()
    error = expert_range_error(lo, hi, e_count)
    if error:
        raise ValueError(error)
    t = torch.arange(n_tiles, device=ids.device)
    e = torch.searchsorted(ends, t, right=True)
    first = bounds[e] + (t - (ends - per_expert)[e]) * block_m
    return order, torch.stack((e, first, bounds[e + 1]), dim=1).to(torch.int32), n_tiles


def grouped_expert_cuda(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                        w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor, limit: float,
                        act: str = "fp8", quantized: bool = False, *, launch: dict | None = None) -> torch.Tensor:
    """Same signature and contract as ``ops.grouped_expert`` (y bf16 [n, k, dim]): x quantized once (act "fp8",
    not ``quantized``), the pairs sorted by expert (:func:`expert_tiles`), then ``_w13_kernel`` and
    ``_w2_kernel``. ``launch``: block_m, num_warps, num_stages (default :data:`LAUNCH`)."""
    check_grouped_expert(x, weights, experts, w13, w13_scales, w2, w2_scales)
    cfg = {**LAUNCH, **(launch or {})}
    (n, k), dim, f = experts.shape, x.shape[1], w2.shape[2] * 2
    y = torch.empty((n * k, dim), dtype=torch.bfloat16, device=x.device)
    if not y.shape[0]:
        return y.unflatten(0, (n, k))
    order, tiles, n_tiles = expert_tiles(experts, w13.shape[0], cfg["block_m"])
    xq = (fake_quant_fp8(x, 128) if act == "fp8" and not quantized else x).contiguous()
    token, weight = order // k, weights.flatten()[order].contiguous()
    h = torch.empty((n * k, f), dtype=torch.bfloat16, device=x.device)
    blocks = {"BM": cfg["block_m"], "BN": BLOCK_N, "BK": BLOCK_K, "num_warps": cfg["num_warps"],
              "num_stages": cfg["num_stages"], "DIM": dim, "F": f, "F32": INTERPRET}
    _w13_kernel[(n_tiles * (f // BLOCK_N),)](
        xq, token, weight, tiles, w13, w13_scales, h, float(limit), xq.stride(0), w13.stride(0),
        w13.stride(1), w13_scales.stride(0), w13_scales.stride(1), h.stride(0), CLAMP=limit > 0,
        QUANT=act == "fp8", LIBDEVICE=not INTERPRET, **blocks)
    _w2_kernel[(n_tiles * (dim // BLOCK_N),)](
        h, order, tiles, w2, w2_scales, y, h.stride(0), w2.stride(0), w2.stride(1), w2_scales.stride(0),
        w2_scales.stride(1), y.stride(0), **blocks)
    return y.unflatten(0, (n, k))
