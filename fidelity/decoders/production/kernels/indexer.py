"""Lightning-indexer scoring (spec §4 Indexer) in Triton: ``score[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])``.

Numerics follow :func:`fidelity.decoders.production.ops.index_scores` with ``dtype=bf16`` (the official path is bf16
throughout): the q.k dot accumulates in fp32 and is rounded to bf16, ReLU, the product with the bf16 head
weight is rounded to bf16, the head sum accumulates in fp32 and is rounded once to bf16. Only the fp32
summation order differs from torch, so a result can differ from the emulation by a bf16 rounding flip.

Keys are bf16 [e, d], or packed FP4 (uint8 [e, d/2], low nibble = element 2i, plus ue8m0 scale bytes
[e, d/32]: the ``fp4_act_quant`` cache of spec §3). FP4 keys take one of two paths:

* FP8 tensor cores (d = 128; by default for decode over >= 32K keys): each packed byte becomes two e4m3 codes
  by a bit shuffle (inline PTX, four bytes per instruction group; the e4m3 value is the e2m1 value times 2^-6),
  and q, FP4-simulated by the reference (Hadamard + ``fp4_act_quant``), becomes e4m3 codes with one
  power-of-two scale per head (folded into the head's weight). One K = 32 e4m3 MMA per 32-dim block is exact
  (products of e2m1 values summed over 32 need 13 bits), and the four block results are scaled by the key's
  block scales and summed in fp32. Where the program's scale and weight ranges keep every value normal, the
  epilogue's round / ReLU / weight / round steps run two (key, head) values per packed bf16x2 instruction
  (default; or one value at a time on the FP32 pipe, Veltkamp's split), else through the conversion unit. A query
  whose codes are not exact (a plain bf16 q, NaN) is scored on the bf16 path inside the same launch;
  ``return_path`` reports which ran.
* bf16 tensor cores: the tile dequantized in registers (``e2m1 * 2^(b-127)`` is exact in bf16, so FP4 keys
  score bit-identically to their dequantized bf16 copy: same tile values, same MMA; checked on the H200).

One program scores ``BLOCK_E`` keys (``TILES`` tiles on the FP8 path) for ``Q_PER_PROG`` queries. Optional causal
mask for compressed entries (``positions``: entry j visible to the query at position t iff
``j < (t + 1) // ratio``, else -inf). Top-k stays in torch (``torch.topk`` on the bf16 scores; tie order is
implementation-defined in the reference too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    PDL_LAUNCH,
    UNSUPPORTED,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
    with_overrides,
    ws_refusal,
)

# e2m1 nibbles ``s e1 e0 m`` -> e4m3 bytes ``s 0 0 e1 e0 m 0 0`` (value x 2^-6): 4 packed bytes in, the 4 low nibbles'
# codes ($0) and the 4 high nibbles' codes ($1) out
FP4_TO_E4M3_ASM = tl.constexpr(
    "{ .reg .b32 a, b; and.b32 a, $2, 0x08080808; shl.b32 a, a, 4; and.b32 b, $2, 0x07070707; "
    "shl.b32 b, b, 2; or.b32 $0, a, b; and.b32 a, $2, 0x80808080; and.b32 b, $2, 0x70707070; "
    "shr.b32 b, b, 2; or.b32 $1, a, b; }")


@triton.jit
def _e2m1(c):
    """FP4 e2m1 nibble codes (int32 0..15) -> fp32 values (sign bit 3, magnitudes 0 .5 1 1.5 2 3 4 6)."""
    m = c & 7
    e = m >> 1
    man = (m & 1).to(tl.float32)
    pw = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * man, pw * (1.0 + 0.5 * man))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit(do_not_specialize=["n_q", "n_keys", "n_heads", "ratio"])
def _index_scores_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, pos_ptr, out_ptr, n_q, n_keys, n_heads, ratio,
                         stride_qn, stride_qh, stride_k, stride_ks, stride_wn, stride_on,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, Q_PER_PROG: tl.constexpr,
                         FP4: tl.constexpr, CAUSAL: tl.constexpr):
    wait_for_previous_kernel()
    pid_e = tl.program_id(0)
    pid_q = tl.program_id(1)
    keys = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    kmask = keys < n_keys
    krow = keys.to(tl.int64)
    if FP4:
        k = _k_tile_bf16(k_ptr, ks_ptr, krow, kmask, stride_k, stride_ks, D, BLOCK_E)
    else:
        dk = tl.arange(0, D)
        k = tl.load(k_ptr + krow[:, None] * stride_k + dk[None, :], mask=kmask[:, None], other=0.0)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dq = tl.arange(0, D)
    for qi in range(Q_PER_PROG):
        i = pid_q * Q_PER_PROG + qi
        if i < n_q:
            i64 = i.to(tl.int64)
            q = tl.load(q_ptr + i64 * stride_qn + heads[:, None] * stride_qh + dq[None, :], mask=hmask[:, None],
                        other=0.0)
            w = tl.load(w_ptr + i64 * stride_wn + heads, mask=hmask, other=0.0).to(tl.float32)
            _score_epilogue(tl.dot(k, tl.trans(q)), w, hmask, keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on,
                            CAUSAL)


@triton.jit
def _q_block_codes(q_ptr, row, heads, hmask, b, inv, back, stride_qh):
    """Query dims 32b .. 32b+31 of every head as e4m3 codes, transposed [32, BLOCK_H]: ``q * inv`` (``inv`` the
    head's power of two), and whether every code is exact (``code * back == q``)."""
    dq = b * 32 + tl.arange(0, 32)
    q = tl.load(q_ptr + row + heads[:, None] * stride_qh + dq[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(tl.float32)
    codes = tl.minimum(tl.maximum(q * inv[:, None], -448.0), 448.0).to(tl.float8e4nv)
    exact = tl.min(tl.min(((codes.to(tl.float32) * back[:, None]) == q).to(tl.int32), axis=1), axis=0)
    return tl.trans(codes), exact


@triton.jit
def _block_amax(q_ptr, row, heads, hmask, b, stride_qh):
    dq = b * 32 + tl.arange(0, 32)
    q = tl.load(q_ptr + row + heads[:, None] * stride_qh + dq[None, :], mask=hmask[:, None], other=0.0)
    return tl.max(tl.abs(q.to(tl.float32)), axis=1)


@triton.jit
def _k_block_fp8(k_ptr, ks_ptr, krow, kmask, b, stride_k, stride_ks, BLOCK_E: tl.constexpr, ASM: tl.constexpr):
    """Key dims 32b .. 32b+31 of packed FP4 keys as e4m3 [BLOCK_E, 32] by a bit shuffle (no table, no branch):
    nibble ``s e1 e0 m`` -> byte ``s 0 0 e1 e0 m 0 0``, whose e4m3 value is the e2m1 value times 2^-6 (exact,
    the half-unit code lands on the e4m3 subnormal 2^-7); plus the ue8m0 block scale 2^(byte - 127) [BLOCK_E]."""
    pk = tl.load(k_ptr + krow[:, None] * stride_k + b * 16 + tl.arange(0, 16)[None, :], mask=kmask[:, None], other=0)
    if ASM:  # four packed bytes per 32-bit register: 8 e4m3 codes in 10 integer instructions
        lo, hi = tl.inline_asm_elementwise(FP4_TO_E4M3_ASM, "=r,=r,r", [pk], dtype=(tl.uint8, tl.uint8), is_pure=True,
                                           pack=4)
    else:
        lo = ((pk & 0x08) << 4) | ((pk & 0x07) << 2)  # element 2i
        hi = (pk & 0x80) | ((pk & 0x70) >> 2)  # element 2i + 1
    k8 = tl.reshape(tl.join(lo, hi), [BLOCK_E, 32]).to(tl.float8e4nv, bitcast=True)
    sb = tl.load(ks_ptr + krow * stride_ks + b, mask=kmask, other=127)
    return k8, (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _k_tile_bf16(k_ptr, ks_ptr, krow, kmask, stride_k, stride_ks, D: tl.constexpr, BLOCK_E: tl.constexpr):
    """Packed FP4 keys [BLOCK_E, D] dequantized to bf16 (exact)."""
    j = tl.arange(0, D // 2)
    pk = tl.load(k_ptr + krow[:, None] * stride_k + j[None, :], mask=kmask[:, None], other=0).to(tl.int32)
    sc_i = tl.arange(0, D // 32)
    sb = tl.load(ks_ptr + krow[:, None] * stride_ks + sc_i[None, :], mask=kmask[:, None], other=127)
    scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    vals = tl.reshape(tl.join(_e2m1(pk & 15), _e2m1(pk >> 4)), [BLOCK_E, D])
    vals = tl.reshape(tl.reshape(vals, [BLOCK_E, D // 32, 32]) * scale[:, :, None], [BLOCK_E, D])
    return vals.to(tl.bfloat16)


@triton.jit
def _store_scores(score, keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on, CAUSAL: tl.constexpr):
    """Head-summed scores [BLOCK_E] fp32 -> bf16 at ``out[i, keys]``; with CAUSAL, -inf where
    ``keys >= (position + 1) // ratio``."""
    if CAUSAL:
        limit = (tl.load(pos_ptr + i64) + 1) // ratio
        score = tl.where(keys < limit, score, float("-inf"))
    tl.store(out_ptr + i64 * stride_on + keys, score.to(tl.bfloat16), mask=kmask)


@triton.jit
def _score_epilogue(s, w, hmask, keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on, CAUSAL: tl.constexpr):
    """The official bf16 steps on q.k [BLOCK_E, BLOCK_H] fp32: round, ReLU, times w, round, head sum, round."""
    s = s.to(tl.bfloat16).to(tl.float32)
    s = tl.where(s < 0, 0.0, s)  # ReLU that keeps NaN (torch.relu does)
    t = (s * w[None, :]).to(tl.bfloat16).to(tl.float32)
    _store_scores(tl.sum(tl.where(hmask[None, :], t, 0.0), axis=1), keys, kmask, pos_ptr, i64, ratio, out_ptr,
                  stride_on, CAUSAL)


@triton.jit
def _round_bf16(x, ASM: tl.constexpr):
    """x rounded to the nearest bf16 value (ties to even), kept in fp32, on the FP32 pipe instead of the
    4x-slower conversion unit: Veltkamp's split ``t = x * (2^16 + 1); x_hi = t - (t - x)`` with each step rounded
    (``.rn``: no FMA contraction). Equal to the cast for normal |x| < 2^110, ties included (checked against
    ml_dtypes in ``tests/test_formats.py``); callers guarantee that range."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t, d; mul.rn.f32 t, $1, 0f47800080; sub.rn.f32 d, t, $1; sub.rn.f32 $0, t, d; }",
            "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    t = x * 65537.0
    return t - (t - x)


@triton.jit
def _relu_times_w_bf16x2(s, w):
    """``round_bf16(relu(round_bf16(s)) * w)`` kept in fp32, two elements per step in packed bf16x2 arithmetic:
    ``cvt.rn.bf16x2.f32`` (both roundings of s at once), ``max.bf16x2`` with 0 (ReLU), ``mul.rn.bf16x2`` with w
    packed by a byte permute (w must hold bf16 values; the exact product of two bf16 values is rounded once, as
    the fp32 product then the cast), then both halves widened back to fp32 by a shift and a mask. Callers
    guarantee no NaN and normal values (a NaN input would come back as the canonical NaN; -0 as +0, equal)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 p, q, z; cvt.rn.bf16x2.f32 p, $3, $2; mov.b32 z, 0; max.bf16x2 p, p, z; "
        "prmt.b32 q, $4, $5, 0x7632; mul.rn.bf16x2 p, p, q; shl.b32 $0, p, 16; and.b32 $1, p, 0xffff0000; }",
        "=r,=r,r,r,r,r", [s, w], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _score_epilogue_fast(s, w, keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on, CAUSAL: tl.constexpr,
                         ASM: tl.constexpr, PACKED: tl.constexpr):
    """:func:`_score_epilogue` for programs whose q.k values and their products with ``w`` are provably 0 or
    normal below 2^110 (padded heads carry w = 0: no head mask), without the conversion unit: PACKED, two values
    per bf16x2 instruction (:func:`_relu_times_w_bf16x2`); else one at a time on the FP32 pipe
    (:func:`_round_bf16`). Same values, same fp32 head sum: the same scores."""
    if PACKED:
        t = _relu_times_w_bf16x2(s, tl.broadcast_to(w[None, :], s.shape))
    else:
        s = _round_bf16(s, ASM)
        s = tl.where(s < 0, 0.0, s)
        t = _round_bf16(s * w[None, :], ASM)
    _store_scores(tl.sum(t, axis=1), keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on, CAUSAL)


@triton.jit
def _in_range(v, lo: tl.constexpr, hi: tl.constexpr):
    """1 where every element of v is 0 or lo <= |v| <= hi (an int32 scalar)."""
    a = tl.abs(v)
    return tl.min(((a == 0) | ((a >= lo) & (a <= hi))).to(tl.int32), axis=0)


@triton.jit
def _fp8_tile(k_ptr, ks_ptr, q0, q1, q2, q3, tile, n_keys, stride_k, stride_ks, BLOCK_E: tl.constexpr,
              ASM: tl.constexpr):
    """sum_b (k_b . q_b) * ks_b for the keys of one tile: four exact K = 32 e4m3 MMAs -> fp32 [BLOCK_E, BLOCK_H]."""
    keys = tile * BLOCK_E + tl.arange(0, BLOCK_E)
    kmask = keys < n_keys
    krow = keys.to(tl.int64)
    k8, ks = _k_block_fp8(k_ptr, ks_ptr, krow, kmask, 0, stride_k, stride_ks, BLOCK_E, ASM)
    acc = tl.dot(k8, q0) * ks[:, None]
    k8, ks = _k_block_fp8(k_ptr, ks_ptr, krow, kmask, 1, stride_k, stride_ks, BLOCK_E, ASM)
    acc += tl.dot(k8, q1) * ks[:, None]
    k8, ks = _k_block_fp8(k_ptr, ks_ptr, krow, kmask, 2, stride_k, stride_ks, BLOCK_E, ASM)
    acc += tl.dot(k8, q2) * ks[:, None]
    k8, ks = _k_block_fp8(k_ptr, ks_ptr, krow, kmask, 3, stride_k, stride_ks, BLOCK_E, ASM)
    acc += tl.dot(k8, q3) * ks[:, None]
    return acc, keys, kmask


@triton.jit
def _scales_in_range(ks_ptr, first, n_keys, stride_ks, BLOCK_E: tl.constexpr, TILES: tl.constexpr,
                     SPAN: tl.constexpr):
    """1 where every key scale of the program's tiles lies in [2^-60, 2^60] (bytes 67 .. 187), so that q.k
    values are 0 or in [2^-76, 2^73] (e4m3 products are multiples of 2^-16, four blocks of 32 below 2^13).
    One load of all the program's scale bytes (SPAN = TILES * BLOCK_E rounded up to a power of two): a loop over
    the tiles would wait out one load latency per tile before the first tile is scored."""
    span = tl.arange(0, SPAN)
    keys = first * BLOCK_E + span
    kmask = (span < TILES * BLOCK_E) & (keys < n_keys)
    sb = tl.load(ks_ptr + keys.to(tl.int64)[:, None] * stride_ks + tl.arange(0, 4)[None, :],
                 mask=kmask[:, None], other=127).to(tl.int32)
    return tl.min(tl.min(((sb >= 67) & (sb <= 187)).to(tl.int32), axis=1), axis=0)


@triton.jit
def _head_exponent(q_ptr, row, heads, hmask, stride_qh):
    """floor(log2(amax)) of each head's 128 query dims, clamped to [-110, 120] (int32 [BLOCK_H]) so that every
    power of two derived from it below is a normal fp32; out-of-range heads make their query inexact."""
    amax = tl.maximum(tl.maximum(_block_amax(q_ptr, row, heads, hmask, 0, stride_qh),
                                 _block_amax(q_ptr, row, heads, hmask, 1, stride_qh)),
                      tl.maximum(_block_amax(q_ptr, row, heads, hmask, 2, stride_qh),
                                 _block_amax(q_ptr, row, heads, hmask, 3, stride_qh)))
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.minimum(tl.maximum(e, -110), 120)


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _query_fp8(q_ptr, w_ptr, row, wrow, heads, hmask, stride_qh):
    """One query's e4m3 codes, four [32, BLOCK_H] blocks, at ``2^(7 - e_h)`` per head; its weights as fp32 and
    with the head's scale ``2^(e_h - 1)`` folded in; and whether codes and folded weights are exact."""
    e = _head_exponent(q_ptr, row, heads, hmask, stride_qh)
    inv, back = _pow2(7 - e), _pow2(e - 7)
    q0, x0 = _q_block_codes(q_ptr, row, heads, hmask, 0, inv, back, stride_qh)
    q1, x1 = _q_block_codes(q_ptr, row, heads, hmask, 1, inv, back, stride_qh)
    q2, x2 = _q_block_codes(q_ptr, row, heads, hmask, 2, inv, back, stride_qh)
    q3, x3 = _q_block_codes(q_ptr, row, heads, hmask, 3, inv, back, stride_qh)
    w = tl.load(w_ptr + wrow + heads, mask=hmask, other=0.0).to(tl.float32)
    wq = w * _pow2(e - 1)
    xw = tl.min((wq * _pow2(1 - e) == w).to(tl.int32), axis=0)
    return q0, q1, q2, q3, w, wq, x0 * x1 * x2 * x3 * xw


@triton.jit(do_not_specialize=["n_q", "n_keys", "n_heads", "ratio"])
def _index_scores_fp8mma_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, pos_ptr, out_ptr, used_ptr, n_q, n_keys, n_heads,
                                ratio, stride_qn, stride_qh, stride_k, stride_ks, stride_wn, stride_on,
                                BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, TILES: tl.constexpr,
                                Q_PER_PROG: tl.constexpr, CAUSAL: tl.constexpr, ASM: tl.constexpr,
                                PACKED: tl.constexpr, SPAN: tl.constexpr):
    """FP4 keys (d = 128) on FP8 tensor cores. A query's codes are ``q * 2^(7 - e_h)`` with one exponent per head
    (from the head's amax), so the four 32-dim blocks share the head's scale; per block one e4m3 MMA (K = 32,
    exact: e2m1 x e2m1 products summed over 32 fit the MMA's accumulator) is scaled by the key's block scale and
    summed in fp32; the head's scale ``2^(e_h - 1)`` (codes and the keys' 2^-6) is folded into its weight, exact
    for powers of two (``round(relu(round(a * 2^k)) * w) == round(relu(round(a)) * (w * 2^k))`` while values stay
    in fp32's normal range). A query whose codes or folded weights are not exact (not FP4-simulated, NaN,
    a block 2^13 below its head's amax, extreme range) is scored on the bf16 path instead, so every query gets the
    bf16 kernel's result up to fp32 summation order. The branch is taken once per program, outside the tile
    loops, so each loop can be software-pipelined. ``used[i]`` = 1 where FP8 ran."""
    wait_for_previous_kernel()
    pid_e = tl.program_id(0)
    pid_q = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    first = pid_e * TILES
    for qi in range(Q_PER_PROG):
        i = pid_q * Q_PER_PROG + qi
        if i < n_q:
            i64 = i.to(tl.int64)
            row = i64 * stride_qn
            q0, q1, q2, q3, w, wq, exact = _query_fp8(q_ptr, w_ptr, row, i64 * stride_wn, heads, hmask, stride_qh)
            if pid_e == 0:
                tl.store(used_ptr + i64, exact.to(tl.int8))
            if exact != 0:
                # packed bf16x2 (or FP32-pipe) roundings where every value is provably 0 or normal below 2^110:
                # folded weights in [2^-40, 2^30] and key scales in [2^-60, 2^60]; else the conversion unit
                fast = _in_range(wq, 9.094947017729282e-13, 1073741824.0)
                fast *= _scales_in_range(ks_ptr, first, n_keys, stride_ks, BLOCK_E, TILES, SPAN)
                if fast != 0:
                    for t in range(TILES):
                        acc, keys, kmask = _fp8_tile(k_ptr, ks_ptr, q0, q1, q2, q3, first + t, n_keys, stride_k,
                                                     stride_ks, BLOCK_E, ASM)
                        _score_epilogue_fast(acc, wq, keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on, CAUSAL,
                                             ASM, PACKED)
                else:
                    for t in range(TILES):
                        acc, keys, kmask = _fp8_tile(k_ptr, ks_ptr, q0, q1, q2, q3, first + t, n_keys, stride_k,
                                                     stride_ks, BLOCK_E, ASM)
                        _score_epilogue(acc, wq, hmask, keys, kmask, pos_ptr, i64, ratio, out_ptr, stride_on,
                                        CAUSAL)
            else:
                dq = tl.arange(0, 128)
                qb = tl.load(q_ptr + row + heads[:, None] * stride_qh + dq[None, :], mask=hmask[:, None], other=0.0)
                for t in range(TILES):
                    keys = (first + t) * BLOCK_E + tl.arange(0, BLOCK_E)
                    kmask = keys < n_keys
                    krow = keys.to(tl.int64)
                    k = _k_tile_bf16(k_ptr, ks_ptr, krow, kmask, stride_k, stride_ks, 128, BLOCK_E)
                    _score_epilogue(tl.dot(k, tl.trans(qb)), w, hmask, keys, kmask, pos_ptr, i64, ratio, out_ptr,
                                    stride_on, CAUSAL)


def default_config(n_q: int, n_keys: int, n_heads: int, d: int) -> dict:
    """Launch parameters (from the sweep in ``benchmarks/bench_kernels.py``; see BENCHMARKS.md)."""
    block_e = 64 if n_keys <= 64 * 264 else 128
    q_per_prog = 1 if n_q <= 4 else 8
    return {"block_e": block_e, "q_per_prog": q_per_prog, "num_warps": 4, "num_stages": 1}


def default_config_fp4(n_q: int, n_keys: int, n_heads: int, d: int) -> dict:
    return dict(default_config(n_q, n_keys, n_heads, d), block_e=128, num_warps=8 if n_keys > 64 * 264 else 4)


def _operands(q, weights, positions, out):
    """Contiguous q, bf16 weights, int64 positions (``out`` stands in for the pointer without a causal mask)."""
    pos = positions.to(torch.int64).contiguous() if positions is not None else out
    return q.contiguous(), weights.to(torch.bfloat16).contiguous(), pos


def _launch(q, k, ks, weights, positions, ratio, d, fp4, cfg):
    n, h, _ = q.shape
    e = k.shape[0]
    out = torch.empty((n, e), dtype=torch.bfloat16, device=q.device)
    if n == 0 or e == 0:
        return out
    c = with_overrides((default_config_fp4 if fp4 else default_config)(n, e, h, d), cfg)
    q, weights, pos = _operands(q, weights, positions, out)
    causal = positions is not None
    grid = (triton.cdiv(e, c["block_e"]), triton.cdiv(n, c["q_per_prog"]))
    _index_scores_kernel[grid](
        q, k, ks, weights, pos, out, n, e, h, int(ratio),
        q.stride(0), q.stride(1), k.stride(0), ks.stride(0), weights.stride(0), out.stride(0),
        D=d, BLOCK_H=max(16, next_pow2(h)), BLOCK_E=c["block_e"], Q_PER_PROG=c["q_per_prog"], FP4=fp4,
        CAUSAL=causal, num_warps=c["num_warps"], num_stages=c["num_stages"], **PDL_LAUNCH)
    return out


def takes_index_scores(q, keys, weights, dtype=torch.bfloat16) -> str | None:
    """Why :func:`index_scores_cuda` cannot take these inputs (None: it can): bf16 scores, q [n, H <= 128, d],
    keys [e, d], d a power of two in 16..256."""
    d = q.shape[-1]
    ok = (dtype == torch.bfloat16 and on_device(q) and q.dim() == 3 and keys.dim() == 2 and keys.shape[1] == d
          and d in (16, 32, 64, 128, 256) and q.shape[1] <= 128)
    return None if ok else UNSUPPORTED


def index_scores_cuda(q, keys, weights, dtype=torch.bfloat16, *, positions=None, ratio=4, config=None):
    """CUDA-tensor entry point with the signature of ``ops.index_scores`` (plus an optional causal mask:
    ``positions`` [n] int, entry j visible iff ``j < (t + 1) // ratio``) for the inputs
    :func:`takes_index_scores` takes."""
    d = q.shape[-1]
    keys = keys.to(torch.bfloat16).contiguous()
    return _launch(q.to(torch.bfloat16), keys, keys, weights, positions, ratio, d, False, config)


def default_config_fp8mma(n_q: int, n_keys: int, n_heads: int) -> dict:
    """FP8-MMA FP4 path: 128 keys per tile; a program walks several tiles (the query's codes are made once per
    program): decode about two programs per SM (3-stage pipeline from 4 tiles), prefill 16 tiles per (query,
    program); the H200 sweeps of BENCHMARKS.md. ``packed``: the bf16x2 epilogue where the FP32-pipe one may run
    (``False``: the FP32-pipe epilogue; both give the same scores)."""
    decode = n_q <= 4
    tiles = max(1, min(16, triton.cdiv(triton.cdiv(n_keys, 128), 264))) if decode else 16
    return {"block_e": 128, "tiles": tiles, "q_per_prog": 1, "num_warps": 4,
            "num_stages": 3 if decode and tiles >= 4 else 1, "packed": True}


def _launch_fp8mma(q, packed, scales, weights, positions, ratio, cfg):
    n, h, _ = q.shape
    e = packed.shape[0]
    out = torch.empty((n, e), dtype=torch.bfloat16, device=q.device)
    used = torch.zeros((n,), dtype=torch.int8, device=q.device)
    if n == 0 or e == 0:
        return out, used
    c = with_overrides(default_config_fp8mma(n, e, h), cfg)
    q, weights, pos = _operands(q, weights, positions, out)
    causal = positions is not None
    grid = (triton.cdiv(e, c["block_e"] * c["tiles"]), triton.cdiv(n, c["q_per_prog"]))
    _index_scores_fp8mma_kernel[grid](
        q, packed, scales, weights, pos, out, used, n, e, h, int(ratio),
        q.stride(0), q.stride(1), packed.stride(0), scales.stride(0), weights.stride(0), out.stride(0),
        BLOCK_H=max(16, next_pow2(h)), BLOCK_E=c["block_e"], TILES=c["tiles"], Q_PER_PROG=c["q_per_prog"],
        CAUSAL=causal, ASM=not INTERPRET, PACKED=c["packed"] and not INTERPRET,
        SPAN=next_pow2(c["tiles"] * c["block_e"]), num_warps=c["num_warps"], num_stages=c["num_stages"], **PDL_LAUNCH)
    return out, used


FP8_MMA_MIN_KEYS = 32768  # H200 sweep (BENCHMARKS.md history): at 32K keys FP8 8.7 us vs 9.6 us for bf16 MMA
WS_MIN_KEYS = 32768  # H200, one query: ws 7.3 vs fp8 8.4 us at 32K keys (128K context), 18.4 vs 24.3 at 256K
# H200, 2-4 queries (folded-scale ws kernel): 2 queries 13.2 vs 18.8 us at 64K keys, 26.7 vs 44.3 at 256K; 4 queries
# 34.5 vs 51.1 at 128K keys, 48.9 vs 83.5 at 256K (not measured below 64K keys)
WS_MIN_KEYS_QUERIES = 65536


def index_scores_fp4(q, packed, scales, weights, *, positions=None, ratio=4, config=None, mma: str = "auto",
                     return_path: bool = False):
    """Scores against an FP4 key cache: packed uint8 [e, d/2] (low nibble = element 2i) and ue8m0 scale bytes
    uint8 [e, d/32] (``fidelity.model.formats.quantize_fp4`` layout). q [n, H, d] bf16 on CUDA, weights [n, H].

    ``mma="fp8"`` (d = 128, H <= 128): keys upcast to e4m3 by a bit shuffle and scored on FP8 tensor cores
    against q's e4m3 codes, per query where q is FP4-simulated (spec §4 Indexer; else that query takes the bf16
    path in the same launch); ``mma="ws"``: the same on the warp-specialized Gluon kernel
    (``kernels/indexer_ws.py``: d = 128, H <= 64, 1 to 4 queries, sm_90; ``config`` may set its ``slots``,
    ``ctas`` and ``consumers``); ``mma="bf16"``: keys dequantized to bf16 in registers, bf16 MMA; ``"auto"``: for
    decode (<= 4 queries) over >= ``FP8_MMA_MIN_KEYS`` keys ``fp8``, or ``ws`` where it can run for one query over
    >= ``WS_MIN_KEYS`` keys and for 2-4 over >= ``WS_MIN_KEYS_QUERIES`` (each where it measured fastest), else
    ``bf16``. All give the bf16 kernel's scores on the
    dequantized keys up to fp32 summation order (:func:`route_index_scores_fp4` names the route of ``"auto"``).
    ``return_path``: also an int8 [n], 1 where a query was scored on FP8 tensor cores (under
    ``ws``: where its codes allow them; a half tile of keys whose scales cannot fold still takes bf16 there)."""
    d = q.shape[-1]
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    if packed.shape[-1] * 2 != d or scales.shape[-1] * 32 != d or d not in (32, 64, 128, 256):
        raise ValueError(f"packed [e, {d // 2}] and scales [e, {d // 32}] expected for d={d}, found "
                         f"{list(packed.shape)} and {list(scales.shape)}")
    if mma not in ("auto", "fp8", "bf16", "ws"):
        raise ValueError(f"mma: expected 'auto', 'fp8', 'bf16' or 'ws', found {mma!r}")
    q = q.to(torch.bfloat16)
    mma = _mma(q, packed, scales, mma)
    if mma == "ws":
        from fidelity.decoders.production.kernels.indexer_ws import index_scores_fp4_ws
        out, used = index_scores_fp4_ws(q, packed, scales, weights, positions, ratio, **(config or {}))
    elif mma == "fp8" and d == 128 and q.shape[1] <= 128:
        out, used = _launch_fp8mma(q, packed.contiguous(), scales.contiguous(), weights, positions, ratio, config)
    else:
        out = _launch(q, packed.contiguous(), scales.contiguous(), weights, positions, ratio, d, True, config)
        used = torch.zeros((q.shape[0],), dtype=torch.int8, device=q.device)
    return (out, used) if return_path else out


def _mma(q: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mma: str) -> str:
    """The route :func:`index_scores_fp4` takes for ``mma``: ``ws``, ``fp8`` or ``bf16`` (see there)."""
    if mma == "auto":
        mma = "fp8" if q.shape[0] <= 4 and packed.shape[0] >= FP8_MMA_MIN_KEYS else "bf16"
        if mma == "fp8" and packed.shape[0] >= (WS_MIN_KEYS if q.shape[0] == 1 else WS_MIN_KEYS_QUERIES):
            mma = "fp8" if ws_refusal("indexer_ws", q, packed, scales) else "ws"
    elif mma == "ws":
        refusal = ws_refusal("indexer_ws", q, packed, scales)
        if refusal:
            raise ValueError(f"index_scores_fp4: mma 'ws' cannot run: {refusal}")
    if mma == "fp8" and not (q.shape[-1] == 128 and q.shape[1] <= 128):
        return "bf16"
    return mma


def takes_index_scores_fp4(q, codes, scales, weights, dtype=torch.bfloat16) -> str | None:
    """Why :func:`index_scores_packed_cuda` cannot take these inputs (None: it can): bf16 scores, q [n, H <= 128,
    d], codes uint8 [e, d/2], scales [e, d/32], d a power of two in 32..256."""
    d = q.shape[-1]
    ok = (dtype == torch.bfloat16 and on_device(q) and q.dim() == 3 and codes.dim() == 2 and scales.dim() == 2
          and codes.shape[1] * 2 == d and scales.shape[1] * 32 == d and d in (32, 64, 128, 256) and q.shape[1] <= 128)
    return None if ok else UNSUPPORTED


def index_scores_packed_cuda(q, codes, scales, weights, dtype=torch.bfloat16):
    """Op ``index_scores_fp4`` (signature of ``ops.index_scores_fp4``): :func:`index_scores_fp4` with
    ``mma="auto"``, bf16 scores [n, e]."""
    return index_scores_fp4(q, codes, scales, weights)


def route_index_scores_fp4(q, codes, scales, weights, dtype=torch.bfloat16) -> str:
    """The route :func:`index_scores_packed_cuda` takes for these inputs: ``ws``, ``fp8`` or ``bf16``."""
    return _mma(q.to(torch.bfloat16), codes.view(torch.uint8), scales.view(torch.uint8), "auto")
