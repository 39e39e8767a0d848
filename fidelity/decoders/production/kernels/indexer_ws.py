"""Warp-specialized lightning-indexer scoring for Hopper (Gluon, sm_90a): FP4 keys (d = 128), up to 64 heads,
decode (1 to 4 queries scored against the same keys). Route ``mma="ws"`` of ``index_scores_fp4``
(``kernels/indexer.py``), its default for one query over >= 2^15 keys and for 2-4 queries over >= 2^16; on the
H200 it measured 15.4 us against the Triton FP8 kernel's 24.3 us for one query at 1M context, 42.2 against 83.5
us for four (BENCHMARKS.md). Spec §4 Indexer.

``score[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])`` with the official bf16 steps: q.k rounded to bf16, ReLU,
times the bf16 weight and rounded to bf16, the head sum in fp32 rounded once to bf16.

Persistent CTAs (at most one per SM) walk the 128-key tiles ``pid, pid + grid, ...`` in three kinds of partition:

* a loader (4 warps, few registers) copies each tile's packed codes (per 64-key half and 32-dim block, [64, 16]
  bytes) and its keys' four ue8m0 scale bytes (one 32-bit word per key) into a ring of slots with ``cp.async``;
* two or four consumer warpgroups: each takes 64 keys (one half) of every tile, or of every other tile with four
  (two tiles in flight: one query from ``FOUR_CONSUMER_TILES`` tiles per CTA). A consumer loads its keys' code
  bytes into registers, unpacks them to e4m3 by a table lookup that folds the key's block scales into the codes
  (below), releases the slot, and makes ``S [64 keys, 64 heads]`` by four chained K = 32 e4m3 wgmmas whose A
  operands are those registers, against the query's codes in shared memory; then the bf16 steps two values per
  instruction (``cvt.rn.relu.bf16x2.f32``, ``mul.rn.bf16x2`` with the weights packed once per query), the head sum
  as one more wgmma (the bf16 products times a ones matrix, fp32 accumulation), and one power of two per key.

**Folded block scales.** A key with scale bytes ``s_b`` (blocks b = 0..3) and smallest byte m gets the codes
``e2m1 * 2^(s_b - m - 5)``: exact e4m3 normals while ``s_b - m <= 11``. Then ``q.k = S * 2^(m + E - 129)`` with
E the query's code exponent (below), and that power of two passes through every bf16 step unchanged while no value
leaves the normal range, so it multiplies the head sum instead of every (key, head) value. The per-query weight
range and the key's m decide whether it may (:func:`_query_params`); the 64 keys of a half tile take this path
for a query only if all of them may, else that half tile is scored on bf16 tensor cores (keys dequantized to
bf16, exact; ``q.k`` by bf16 wgmma over the 128 dims) for that query. The products are exact; Hopper's FP8 tensor
core is reported to keep about 14 significant bits of a running sum (DeepSeek-V3 report), which the sums of 128
products of FP4-simulated queries and keys fit in the H200 runs (every benchmark and A/B output bit-equal to the
previous kernel, which scaled four exact K = 32 sums in fp32); a sum that needs more is truncated there, a near-tie
of the bf16 score at most.

A query's codes are ``q * 2^(7 - E)`` with one exponent E per query (from its amax), made by consumers 0 and 1 of
every CTA at its start, each for its half of the dims (:func:`_prepare_queries`; no kernel runs before this one).
A query whose codes are not exact (not FP4-simulated, NaN, a value below 2^-9 of the code grid) is scored on the
bf16 path throughout. ``used[i]`` = 1 where the FP8 path could run; ``paths`` counts the (half tile, query) pairs
scored by each path.

Both paths give the bf16 kernel's scores up to the fp32 summation order of the head sum (the tensor core adds
in its own order), so a score can differ by one bf16 rounding flip near a tie.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fidelity.decoders.production.kernels._common import hopper_gluon_refusal

D = 128  # head dim of the indexer
HEADS = 64  # heads per query (fewer are padded with zero codes and weights)
TILE = 128  # keys per ring slot: 64 per consumer warpgroup
HALF = TILE // 2
MAX_QUERIES = 4
LOADER_WARPS = 4
SLOTS = 4  # ring slots
SPREAD = 11  # the most a key's block scale bytes may differ by for its codes to fold them (6 * 2^(11 - 5) = 384)
# consumer warpgroups per CTA: 4 (two tiles in flight) for one query from 10 tiles per CTA, else 2 (H200, one query,
# 4 vs 2 consumers: 8.7 vs 8.2 us at 3.9 tiles per CTA, 11.2 vs 11.0 at 7.8, 13.3 vs 13.4 at 11.6, 15.5 vs 16.1 at
# 15.5; with 4, three or four queries exceed shared memory and two spill)
FOUR_CONSUMER_TILES = 10
LOADER_REGS, CONSUMER_REGS = 40, {2: 224, 4: 112}  # per thread, by consumers per CTA
LOADS, MMAS, EPILOGUE = 1, 2, 4  # PARTS bits: which stages run (all by default; benchmarks/diag_indexer_ws.py)
_D, _HEADS, _TILE, _HALF = gl.constexpr(D), gl.constexpr(HEADS), gl.constexpr(TILE), gl.constexpr(HALF)
_MAXQ, _SPREAD = gl.constexpr(MAX_QUERIES), gl.constexpr(SPREAD)
# e4m3 codes of the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 times 2^-5: table bytes 0-3 and 4-7
_TABLE_LO, _TABLE_HI = gl.constexpr(0x14100800), gl.constexpr(0x24201C18)
# 4 packed bytes (8 e2m1 nibbles, element 2i low) and a block's table ($3 low, $7 high word: with pack=4 Triton
# passes each int32 operand as four registers, $3-$6 and $7-$10, all equal here) -> e4m3 codes of elements 0-3 ($0)
# and 4-7 ($1): magnitudes by byte permute, signs moved from nibble bit 3 to byte bit 7
_UNPACK = gl.constexpr("{ .reg .b32 m, n, a, b, s, p, r; and.b32 m, $2, 0x77777777; shr.u32 n, m, 16; "
                       "prmt.b32 a, $3, $7, m; prmt.b32 b, $3, $7, n; shl.b32 s, $2, 4; prmt.b32 p, s, $2, 0x5140; "
                       "prmt.b32 r, s, $2, 0x7362; and.b32 p, p, 0x80808080; and.b32 r, r, 0x80808080; "
                       "or.b32 $0, a, p; or.b32 $1, b, r; }")
# register layouts of a consumer's 64 keys (warp w holds keys 16w .. 16w + 15, as the wgmma row fragments do;
# lane l keys 16w + l // 4 and + 8, block t = l % 4): _RAW the code bytes [_HALF, 64] (16 of block t per key),
# _P3 one packed word per (key, block) [_HALF, 4, 4], _A8 the e4m3 A operand of a K = 32 wgmma, _KEYS per key
_RAW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HALF, 64]))
_P3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]], lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[HALF, 4, 4]))
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 32]))
_A8 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=4))
_KEYS = gl.constexpr(gl.SliceLayout(1, _MMA.value))
# AND over a warp of two registers (a thread's two keys): both outputs get it
_WARP_AND = gl.constexpr("{ .reg .b32 t; and.b32 t, $2, $3; redux.sync.and.b32 $0, t, 0xffffffff; mov.b32 $1, $0; }")
# bf16(relu(bf16(s)) * w) for two (key, head) values: s fp32 pair ($1, $2), the two heads' bf16 weights as one word
# ($3; $4 is the same word) -> bf16 pair. The ReLU is the rounding's (NaN stays NaN, as torch.relu keeps it; -0 may
# become +0, which can change at most the sign of a zero score)
_EPILOGUE = gl.constexpr("{ .reg .b32 p; cvt.rn.relu.bf16x2.f32 p, $2, $1; mul.rn.bf16x2 $0, p, $3; }")


@gluon.jit
def _loader(k_ptr, ks_ptr, stride_k, stride_ks, n_keys, n_tiles, codes, words, ready, empty,
            NS: gl.constexpr, LW: gl.constexpr, PARTS: gl.constexpr):
    """Fills slot i % NS with this CTA's i-th tile once it is released. Keys 64c .. 64c + 63 of the tile (c = 0, 1):
    codes[2 s + c] = their 64 code bytes ([_HALF, 64], rows as stored), words[2 s + c] = their scale words
    ([_HALF] int32); zeros past the last key. 16-byte copies."""
    cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LW, 1], [1, 0])
    wl: gl.constexpr = gl.BlockedLayout([1], [32], [LW], [0])
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    for i in range((n_tiles - pid + grid - 1) // grid):
        tile = pid + i * grid
        s = i % NS
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, cl))
        for c in gl.static_range(2 if PARTS & 1 else 0):
            keys = tile * _TILE + _HALF * c + gl.arange(0, _HALF, layout=gl.SliceLayout(1, cl))
            valid = keys < n_keys
            rows = gl.where(valid, keys, 0).to(gl.int64) * stride_k
            async_copy.async_copy_global_to_shared(codes.index(2 * s + c), k_ptr + rows[:, None] + cols[None, :],
                                                   mask=valid[:, None])
        for c in gl.static_range(2):
            wkeys = tile * _TILE + _HALF * c + gl.arange(0, _HALF, layout=wl)
            wvalid = wkeys < n_keys
            async_copy.async_copy_global_to_shared(words.index(2 * s + c),
                                                   ks_ptr + gl.where(wvalid, wkeys, 0).to(gl.int64) * stride_ks,
                                                   mask=wvalid)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _scale_bytes(word):
    """The four scale bytes of each key's word ([_HALF] int32) and the smallest of them."""
    b0 = word & 0xFF
    b1 = (word >> 8) & 0xFF
    b2 = (word >> 16) & 0xFF
    b3 = (word >> 24) & 0xFF
    return b0, b1, b2, b3, gl.minimum(gl.minimum(b0, b1), gl.minimum(b2, b3))


@gluon.jit
def _folds(b0, b1, b2, b3, m):
    """Whether a key's block scales fold into its codes: bytes within ``_SPREAD`` of the smallest, none 255."""
    top = gl.maximum(gl.maximum(b0, b1), gl.maximum(b2, b3))
    return (top - m <= _SPREAD) & (top < 255)


@gluon.jit
def _unpack_word(p, lo, hi):
    """One wgmma's A operand from its packed words ``p`` ([_HALF, 4 blocks t, 4 bytes], one 32-bit word per key
    and block in each thread) and the tables of each (key, block) (``lo``, ``hi`` [_HALF, 4, 1]): e4m3 [_HALF, 32]
    in registers, column 16a + 4t + i holding element 4a + i of the word of block t (:data:`_UNPACK`)."""
    lo, _ = gl.broadcast(lo, p)
    hi, _ = gl.broadcast(hi, p)
    x, y = gl.inline_asm_elementwise(_UNPACK, "=r,=r,r,r,r,r,r,r,r,r,r", [p, lo, hi],
                                     dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    a = gl.reshape(gl.permute(gl.join(x, y), (0, 3, 1, 2)), [_HALF, 32]).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(a, _A8)


@gluon.jit
def _unpack_half(raw, word, m, fold):
    """A consumer's 64 keys (``raw``: their code bytes [_HALF, 64] in :data:`_RAW`; ``word``, ``m``, ``fold``:
    [_HALF] per key in :data:`_KEYS`) as the e4m3 A operands of four K = 32 wgmmas, in registers: wgmma j takes
    word j (bytes 4j .. 4j + 3) of every block t, so column 16a + 4t + i of operand j holds dim 32t + 8j + 4a + i
    (:func:`_query_half` orders the queries the same way). Codes ``e2m1 * 2^(byte_t - m - 5)`` for a folded key,
    ``e2m1 * 2^-5`` for the others."""
    tl: gl.constexpr = gl.SliceLayout(2, _P3)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, tl))
    byte = (gl.convert_layout(word, gl.SliceLayout(1, tl))[:, None] >> (8 * t)[None, :]) & 0xFF
    m = gl.convert_layout(m, gl.SliceLayout(1, tl))
    k = gl.where(gl.convert_layout(fold, gl.SliceLayout(1, tl))[:, None], byte - m[:, None], 0)
    lo = (k * 0x08080800 + _TABLE_LO)[:, :, None]
    hi = (k * 0x08080808 + _TABLE_HI)[:, :, None]
    # (key, block t, word j = 2 j1 + j0, byte i) -> four [_HALF, t, i] tensors, one per word j
    r = gl.permute(gl.reshape(raw, [_HALF, 4, 2, 2, 4]), (0, 1, 4, 2, 3))
    even, odd = gl.split(r)
    w0, w2 = gl.split(even)
    w1, w3 = gl.split(odd)
    return (_unpack_word(gl.convert_layout(w0, _P3), lo, hi), _unpack_word(gl.convert_layout(w1, _P3), lo, hi),
            _unpack_word(gl.convert_layout(w2, _P3), lo, hi), _unpack_word(gl.convert_layout(w3, _P3), lo, hi))


@gluon.jit
def _dequantize(a, word, m, fold):
    """Operand ``a`` of :func:`_unpack_half` (e4m3 [_HALF, 32], column 16a + 4t + i from block t) -> the keys'
    bf16 values in the same order: code x 2^(m - 122) for a folded key, code x 2^(byte_t - 122) for the others
    (byte 255: NaN). Exact within bf16's range."""
    t = (gl.arange(0, 32, layout=gl.SliceLayout(0, _A8)) // 4) % 4
    kl: gl.constexpr = gl.SliceLayout(1, _A8)
    word, m, fold = gl.convert_layout(word, kl), gl.convert_layout(m, kl), gl.convert_layout(fold, kl)
    byte = (word[:, None] >> (8 * t)[None, :]) & 0xFF
    e = gl.where(fold[:, None], m[:, None], byte) - 122
    h = e >> 1  # two normal factors 2^h and 2^(e - h): the product rounds once
    f1 = ((h + 127) << 23).to(gl.float32, bitcast=True)
    f2 = ((e - h + 127) << 23).to(gl.float32, bitcast=True)
    v = a.to(gl.float32) * f1 * f2
    return gl.where((byte == 255) & ~fold[:, None], float("nan"), v).to(gl.bfloat16)


@gluon.jit
def _query_half(q_ptr, stride_qn, stride_qh, n_heads, qi: gl.constexpr, c: gl.constexpr, layout: gl.constexpr):
    """Query qi's B operands of wgmmas 2c and 2c + 1 in the keys' column order (:func:`_unpack_half`): two bf16
    [_HEADS, 32], zeros past n_heads. Dims 32t + 16c .. 32t + 16c + 15 of each block t are loaded in order
    (vector loads), then reordered in registers."""
    l2: gl.constexpr = gl.SliceLayout(2, layout)
    heads = gl.arange(0, _HEADS, layout=gl.SliceLayout(1, l2))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, l2))
    u = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    off = (heads[:, None] * stride_qh + 32 * t[None, :] + 16 * c)[:, :, None] + u[None, None, :]
    x = gl.load(q_ptr + qi * stride_qn + off, mask=(heads < n_heads)[:, None, None], other=0.0)  # [_HEADS, t, u]
    # u = 8 j' + 4 a + i -> (a, t, i) for j' = 0, 1
    x = gl.permute(gl.reshape(x, [_HEADS, 4, 2, 2, 4]), (0, 3, 1, 4, 2))
    return gl.split(gl.reshape(x, [_HEADS, 32, 2]))


@gluon.jit
def _pair_amax(xa, xb):
    """max |x| over two blocks (one cross-warp reduction)."""
    return gl.max(gl.max(gl.maximum(gl.abs(xa.to(gl.float32)), gl.abs(xb.to(gl.float32))), axis=1), axis=0)


@gluon.jit
def _code_block(x, e, q8_block, qb_block):
    """Block x (bf16 [_HEADS, 32]) of a query with code exponent e: the e4m3 codes ``x * 2^(7 - e)`` into q8_block,
    x itself into qb_block (for the bf16 path); returns 1 where a code is not exact, else 0 ([_HEADS, 32])."""
    xs = x.to(gl.float32) * ((134 - e) << 23).to(gl.float32, bitcast=True)  # |xs| < 2^8, exact
    ax = gl.abs(xs)
    # exact in e4m3, tested on the fp32 bits: at most 3 mantissa bits where normal (>= 2^-6), else a multiple of
    # 2^-9; NaN fails (the e4m3 round trip gave wrong flags on the H200 under Triton 3.6)
    normal_ok = (ax.to(gl.int32, bitcast=True) & 0xFFFFF) == 0
    tiny_ok = ax * 512.0 == gl.floor(ax * 512.0)
    ok = (ax <= 448.0) & gl.where(ax >= 0.015625, normal_ok, tiny_ok)
    q8_block.store(gl.minimum(gl.maximum(xs, -448.0), 448.0).to(gl.float8e4nv))
    qb_block.store(x)
    return gl.where(ok, 0, 1)


@gluon.jit
def _pick(v, qi: gl.constexpr):
    """Entry qi of a [_MAXQ] int32 vector, as a scalar."""
    return gl.sum(gl.where(gl.arange(0, _MAXQ, layout=v.type.layout) == qi, v, 0), axis=0)


@gluon.jit
def _code_query(xa, xb, e, qi: gl.constexpr, c: gl.constexpr, q8, qb):
    """Blocks 2c (xa) and 2c + 1 (xb) of query qi coded with its exponent (from e [_MAXQ]); 1 if some code of
    them is not exact."""
    e_q = _pick(e, qi)
    bad = gl.maximum(_code_block(xa, e_q, q8.index(4 * qi + 2 * c), qb.index(4 * qi + 2 * c)),
                     _code_block(xb, e_q, q8.index(4 * qi + 2 * c + 1), qb.index(4 * qi + 2 * c + 1)))
    return gl.max(gl.max(bad, axis=1), axis=0)


@gluon.jit
def _code_queries(q_ptr, stride_qn, stride_qh, n_heads, q8, qb, stats, stats_ready, c: gl.constexpr, NQ: gl.constexpr):
    """Consumer c's (0 or 1) half of every query (blocks 2c, 2c + 1: dims 64c .. 64c + 63) into shared memory.
    E = floor(log2(amax)) over the query's heads and dims, clamped to [-100, 100] (the two halves' maxima meet
    through ``stats`` row c); the e4m3 codes ``q * 2^(7 - E)``; the bf16 q for the bf16 path; whether some code of
    the half is not exact (``stats`` row 2 + c)."""
    ql: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 4, 1], [4, 1, 1], [2, 1, 0])
    sl: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, 4], [0, 1])
    qid = gl.arange(0, _MAXQ, layout=gl.SliceLayout(0, sl))
    # every load first (one round trip); a query's operands are xa (wgmma 2c) and xb (2c + 1)
    xa0, xb0 = _query_half(q_ptr, stride_qn, stride_qh, n_heads, 0, c, ql)
    if NQ > 1:
        xa1, xb1 = _query_half(q_ptr, stride_qn, stride_qh, n_heads, 1, c, ql)
    if NQ > 2:
        xa2, xb2 = _query_half(q_ptr, stride_qn, stride_qh, n_heads, 2, c, ql)
    if NQ > 3:
        xa3, xb3 = _query_half(q_ptr, stride_qn, stride_qh, n_heads, 3, c, ql)
    amax = gl.where(qid == 0, _pair_amax(xa0, xb0), 0.0)
    if NQ > 1:
        amax = gl.where(qid == 1, _pair_amax(xa1, xb1), amax)
    if NQ > 2:
        amax = gl.where(qid == 2, _pair_amax(xa2, xb2), amax)
    if NQ > 3:
        amax = gl.where(qid == 3, _pair_amax(xa3, xb3), amax)
    stats.slice(c, 1).store(amax.to(gl.int32, bitcast=True)[None, :])
    gl.thread_barrier()
    mbarrier.arrive(stats_ready.index(0), count=1)
    mbarrier.wait(stats_ready.index(0), 0)
    e = _exponents(stats)
    inexact = gl.where(qid == 0, _code_query(xa0, xb0, e, 0, c, q8, qb), 0)
    if NQ > 1:
        inexact = gl.where(qid == 1, _code_query(xa1, xb1, e, 1, c, q8, qb), inexact)
    if NQ > 2:
        inexact = gl.where(qid == 2, _code_query(xa2, xb2, e, 2, c, q8, qb), inexact)
    if NQ > 3:
        inexact = gl.where(qid == 3, _code_query(xa3, xb3, e, 3, c, q8, qb), inexact)
    stats.slice(2 + c, 1).store(inexact[None, :])


@gluon.jit
def _exponents(stats):
    """Per query, E = floor(log2(amax)) clamped to [-100, 100], from the halves' maxima in ``stats`` rows 0-1."""
    sl: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, 4], [0, 1])
    amax = gl.max(stats.slice(0, 2).load(sl).to(gl.float32, bitcast=True), axis=0)
    return gl.minimum(gl.maximum(((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100), 100)


@gluon.jit
def _prepare_queries(q_ptr, stride_qn, stride_qh, n_heads, used_ptr, q8, qb, ones, stats, stats_ready, q_ready,
                     c: gl.constexpr, NQ: gl.constexpr):
    """The queries coded in the CTA (no kernel before this one) by consumers 0 and 1 (:func:`_code_queries`);
    every consumer waits for them (``q_ready``) and returns per query (exact, E) as two [_MAXQ] int32 vectors.
    Consumer 0 of CTA 0 writes ``used``."""
    sl: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [1, 4], [0, 1])
    qid = gl.arange(0, _MAXQ, layout=gl.SliceLayout(0, sl))
    if c < 2:
        _code_queries(q_ptr, stride_qn, stride_qh, n_heads, q8, qb, stats, stats_ready, c, NQ)
    ones.store(gl.full([8, _HEADS], 1.0, gl.bfloat16, layout=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
    fence_async_shared()
    gl.thread_barrier()
    if c < 2:
        mbarrier.arrive(q_ready.index(0), count=1)
    mbarrier.wait(q_ready.index(0), 0)
    exact = 1 - gl.max(stats.slice(2, 2).load(sl), axis=0)
    gl.store(used_ptr + qid, exact.to(gl.int8), mask=(qid < NQ) & (gl.program_id(0) == 0) & (c == 0))
    return exact, _exponents(stats)


@gluon.jit
def _query_inputs(w_ptr, pos_ptr, qi: gl.constexpr, stride_wn, n_heads, CAUSAL: gl.constexpr, layout: gl.constexpr):
    """Query qi's weights ([_HEADS] bf16, 0 past n_heads) and position (0 without the causal mask), loaded before
    the queries are coded so that the loads overlap."""
    heads = gl.arange(0, _HEADS, layout=layout)
    w = gl.load(w_ptr + qi * stride_wn + heads, mask=heads < n_heads, other=0.0)
    return w, gl.load(pos_ptr + qi) if CAUSAL else 0


@gluon.jit
def _weight_pairs(w):
    """Weights [_HEADS] bf16 -> int32 [_HEADS], entry h the word of heads 2 (h // 2) (low half) and 2 (h // 2) + 1
    (high half): what the epilogue multiplies two heads' values by, made once (not repacked per tile)."""
    bits = w.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    lo, hi = gl.split(gl.reshape(bits, [_HEADS // 2, 2]))
    word = lo | (hi << 16)
    return gl.convert_layout(gl.reshape(gl.join(word, word), [_HEADS]), w.type.layout)


@gluon.jit
def _query_params(w, pos, exact, e, qi: gl.constexpr, ratio, CAUSAL: gl.constexpr):
    """Query qi's code exponent (from the [_MAXQ] vectors of :func:`_prepare_queries`), causal limit, and the range
    [lo, hi] of a key's smallest scale byte m for which its power of two F = 2^(m + E - 129) may wait until after
    the head sum (empty where the query's codes are not exact). With the unscaled ``S`` in [2^-18, 2^25] (codes are
    multiples of 2^-9) and nonzero weights in [2^a, 2^(b + 1)): every bf16 step stays normal, scaled or not, when
    a >= -101, b <= 95, log2 F in [max(-101 - a, -108), min(95 - b, 101)] (the head sum's partial sums are
    multiples of 2^(a - 25) and below 2^(b + 32))."""
    ex, qe = _pick(exact, qi), _pick(e, qi)
    ew = ((w.to(gl.float32).to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |w|); -127 subnormal
    a = gl.min(gl.where(w != 0.0, ew, 255), axis=0)
    b = gl.max(gl.where(w != 0.0, ew, -255), axis=0)
    lo = gl.maximum(-101 - a, -108) + 129 - qe
    hi = gl.minimum(95 - b, 101) + 129 - qe
    limit = (pos + 1) // ratio if CAUSAL else 0
    return qe, limit, gl.where((ex != 0) & (a >= -101) & (b <= 95), lo, 1000), hi


@gluon.jit
def _scores(a0, a1, a2, a3, ab, ab0: gl.constexpr, q8, qb, ones, qi: gl.constexpr, fold, w, PARTS: gl.constexpr):
    """One query's head-summed scores of the consumer's 64 keys: fp32 [_HALF, 8] (8 equal columns). ``fold``: from
    the FP8 codes with the folded scales (``a0`` .. ``a3``, registers; still to be multiplied by each key's F), else
    from the bf16 keys (``ab`` from index ab0). ``w``: the query's weights as :func:`_weight_pairs` packs them."""
    mma16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _HEADS, 16])
    hmma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    if fold != 0:
        y = gl.zeros([_HALF, _HEADS], gl.float32, layout=_MMA)
        if PARTS & 2:
            y = warpgroup_mma(a0, q8.index(4 * qi).permute((1, 0)), y, use_acc=False, is_async=True)
            y = warpgroup_mma(a1, q8.index(4 * qi + 1).permute((1, 0)), y, is_async=True)
            y = warpgroup_mma(a2, q8.index(4 * qi + 2).permute((1, 0)), y, is_async=True)
            y = warpgroup_mma(a3, q8.index(4 * qi + 3).permute((1, 0)), y, is_async=True)
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y,))
    else:
        acc = gl.zeros([_HALF, _HEADS], gl.float32, layout=mma16)
        for b in gl.static_range(4):
            acc = warpgroup_mma(ab.index(ab0 + b), qb.index(4 * qi + b).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        y = gl.convert_layout(acc, _MMA)
    if PARTS & 4:
        wb, y = gl.broadcast(w[None, :], y)
        t = gl.inline_asm_elementwise(_EPILOGUE, "=r,r,r,r,r", [y, wb], dtype=gl.bfloat16, is_pure=True, pack=2)
        a = gl.convert_layout(t, gl.DotOperandLayout(operand_index=0, parent=hmma, k_width=2))
        score = warpgroup_mma(a, ones.permute((1, 0)), gl.zeros([_HALF, 8], gl.float32, layout=hmma),
                              use_acc=False, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(score,))
    return gl.convert_layout(gl.reshape(y, [_HALF, 8, 8]).sum(axis=2), hmma)  # diagnosis only: no epilogue


@gluon.jit
def _fold_bits(fold, m, lo, hi, qi: gl.constexpr):
    """Bit qi set for the keys whose scores for query qi may take the folded path."""
    return gl.where(fold & (m >= lo) & (m <= hi), 1 << qi, 0)


@gluon.jit
def _half_tile_bits(tflag):
    """AND of the four warps' fold bits (``tflag`` [_HALF]: each warp wrote its AND at its 16 keys): a scalar."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    bits = (tflag.slice(0, 1).load(one) & tflag.slice(16, 1).load(one) & tflag.slice(32, 1).load(one)
            & tflag.slice(48, 1).load(one))
    return gl.max(bits, axis=0)


@gluon.jit
def _consumer(shared, ones, c: gl.constexpr, NC: gl.constexpr, NS: gl.constexpr,
              NQ: gl.constexpr, CAUSAL: gl.constexpr, COUNT: gl.constexpr, PARTS: gl.constexpr):
    """Consumer c of NC (2 or 4): keys 64h .. 64h + 63 (h = c % 2) of this CTA's tiles i = c // 2, c // 2 + NC / 2,
    ... (of its own walk), scored for every query (NQ <= 4). ``shared``: the arguments all consumers take, in the
    order :func:`_index_ws_kernel` packs them."""
    (q_ptr, used_ptr, w_ptr, pos_ptr, out_ptr, paths_ptr, n_keys, n_heads, n_tiles, ratio, stride_qn, stride_qh,
     stride_wn, stride_on, codes, words, q8, qb, ab, stats, tflag, ready, empty, stats_ready, q_ready) = shared
    hmma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    hl: gl.constexpr = gl.SliceLayout(1, hmma)
    cols: gl.constexpr = gl.SliceLayout(0, _MMA)
    # the per-query loads first (they overlap the queries' coding); the values stay in registers for the loop
    w0, pos0 = _query_inputs(w_ptr, pos_ptr, 0, stride_wn, n_heads, CAUSAL, cols)
    if NQ > 1:
        w1, pos1 = _query_inputs(w_ptr, pos_ptr, 1, stride_wn, n_heads, CAUSAL, cols)
    if NQ > 2:
        w2, pos2 = _query_inputs(w_ptr, pos_ptr, 2, stride_wn, n_heads, CAUSAL, cols)
    if NQ > 3:
        w3, pos3 = _query_inputs(w_ptr, pos_ptr, 3, stride_wn, n_heads, CAUSAL, cols)
    exact, e = _prepare_queries(q_ptr, stride_qn, stride_qh, n_heads, used_ptr, q8, qb, ones, stats, stats_ready,
                                q_ready, c, NQ)
    any_bf16 = gl.max(gl.where(gl.arange(0, _MAXQ, layout=exact.type.layout) < NQ, 1 - exact, 0), axis=0)
    qe0, lim0, lo0, hi0 = _query_params(w0, pos0, exact, e, 0, ratio, CAUSAL)
    wp0 = _weight_pairs(w0)
    if NQ > 1:
        qe1, lim1, lo1, hi1 = _query_params(w1, pos1, exact, e, 1, ratio, CAUSAL)
        wp1 = _weight_pairs(w1)
    if NQ > 2:
        qe2, lim2, lo2, hi2 = _query_params(w2, pos2, exact, e, 2, ratio, CAUSAL)
        wp2 = _weight_pairs(w2)
    if NQ > 3:
        qe3, lim3, lo3, hi3 = _query_params(w3, pos3, exact, e, 3, ratio, CAUSAL)
        wp3 = _weight_pairs(w3)
    col8 = gl.arange(0, 8, layout=gl.SliceLayout(0, hmma))
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    h: gl.constexpr = c % 2
    n_fold = pid * 0
    for i in range(c // 2, (n_tiles - pid + grid - 1) // grid, NC // 2):
        tile = pid + i * grid
        s = i % NS
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        word = words.index(2 * s + h).load(_KEYS)
        raw = codes.index(2 * s + h).load(_RAW)
        b0, b1, b2, b3, m = _scale_bytes(word)
        fold = _folds(b0, b1, b2, b3, m)
        a0, a1, a2, a3 = _unpack_half(raw, word, m, fold)
        keys = tile * _TILE + _HALF * h + gl.arange(0, _HALF, layout=_KEYS)
        bits = gl.where(keys < n_keys, 0, 15)
        bits |= _fold_bits(fold, m, lo0, hi0, 0)
        if NQ > 1:
            bits |= _fold_bits(fold, m, lo1, hi1, 1)
        if NQ > 2:
            bits |= _fold_bits(fold, m, lo2, hi2, 2)
        if NQ > 3:
            bits |= _fold_bits(fold, m, lo3, hi3, 3)
        tflag.index(c).store(gl.inline_asm_elementwise(_WARP_AND, "=r,=r,r,r", [bits], dtype=gl.int32, is_pure=True,
                                                       pack=2))
        gl.thread_barrier()  # also: every thread has read the slot
        mbarrier.arrive(empty.index(s), count=1)
        ok = _half_tile_bits(tflag.index(c))
        if (any_bf16 != 0) | ((ok & ((1 << NQ) - 1)) != (1 << NQ) - 1):  # some query takes the bf16 path
            gl.thread_barrier()  # every warp is past its previous bf16 MMAs
            ab.index(4 * c + 0).store(_dequantize(a0, word, m, fold))
            ab.index(4 * c + 1).store(_dequantize(a1, word, m, fold))
            ab.index(4 * c + 2).store(_dequantize(a2, word, m, fold))
            ab.index(4 * c + 3).store(_dequantize(a3, word, m, fold))
            fence_async_shared()
            gl.thread_barrier()
        mh = gl.convert_layout(m, hl)
        keys = gl.convert_layout(keys, hl)
        for qi in gl.static_range(NQ):
            if qi == 0:
                qe, wp, limit = qe0, wp0, lim0
            elif qi == 1:
                qe, wp, limit = qe1, wp1, lim1
            elif qi == 2:
                qe, wp, limit = qe2, wp2, lim2
            else:
                qe, wp, limit = qe3, wp3, lim3
            fq = (ok >> qi) & 1
            score = _scores(a0, a1, a2, a3, ab, 4 * c, q8, qb, ones, qi, fq, wp, PARTS)
            f = gl.where(fq != 0, ((mh + qe - 2) << 23).to(gl.float32, bitcast=True), 1.0)  # 2^(m + E - 129)
            score = score * f[:, None]
            n_fold += fq
            if CAUSAL:
                score = gl.where((keys < limit)[:, None], score, float("-inf"))
            gl.store(out_ptr + qi * stride_on + keys[:, None] + col8[None, :] * 0, score.to(gl.bfloat16),
                     mask=(keys < n_keys)[:, None] & (col8 == 0)[None, :])
    if COUNT:
        gl.atomic_add(paths_ptr, n_fold)
        mine = ((n_tiles - pid + grid - 1) // grid - c // 2 + NC // 2 - 1) // (NC // 2)  # tiles this consumer took
        gl.atomic_add(paths_ptr + 1, gl.maximum(mine, 0) * NQ - n_fold)


# n_heads is not specialized: with n_heads == 1 the padded heads' codes are constant zeros, and ptxas (Triton 3.6,
# sm_90a) may pack some of those e4m3 pairs with another register's half (the thread id, the stack pointer) into
# the q8 stores: stray codes, NaN ones among them, in heads of weight 0, which make every score NaN
@gluon.jit(do_not_specialize=["n_heads"])
def _index_ws_kernel(q_ptr, used_ptr, w_ptr, pos_ptr, out_ptr, paths_ptr, k_ptr, ks_ptr,
                     n_keys, n_heads, n_tiles, ratio, stride_qn, stride_qh, stride_wn, stride_on, stride_k,
                     stride_ks, NC: gl.constexpr, NS: gl.constexpr, NQ: gl.constexpr, CAUSAL: gl.constexpr,
                     COUNT: gl.constexpr, LW: gl.constexpr, LREGS: gl.constexpr, CREGS: gl.constexpr,
                     PARTS: gl.constexpr):
    codes = gl.allocate_shared_memory(gl.uint8, [2 * NS, _HALF, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    words = gl.allocate_shared_memory(gl.int32, [2 * NS, _HALF], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q8 = gl.allocate_shared_memory(gl.float8e4nv, [4 * NQ, _HEADS, 32],
                                   gl.NVMMASharedLayout.get_default_for([_HEADS, 32], gl.float8e4nv))
    qb = gl.allocate_shared_memory(gl.bfloat16, [4 * NQ, _HEADS, 32],
                                   gl.NVMMASharedLayout.get_default_for([_HEADS, 32], gl.bfloat16))
    ones = gl.allocate_shared_memory(gl.bfloat16, [NC, 8, _HEADS],
                                     gl.NVMMASharedLayout.get_default_for([8, _HEADS], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    stats = gl.allocate_shared_memory(gl.int32, [4, _MAXQ], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    tflag = gl.allocate_shared_memory(gl.int32, [NC, _HALF], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ab = gl.allocate_shared_memory(gl.bfloat16, [4 * NC, _HALF, 32],
                                   gl.NVMMASharedLayout.get_default_for([_HALF, 32], gl.bfloat16))
    stats_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=LW * 32)  # every loader thread's cp.async arrival
        mbarrier.init(empty.index(i), count=2)  # the two consumers of the tile
    mbarrier.init(stats_ready.index(0), count=2)
    mbarrier.init(q_ready.index(0), count=2)  # consumers 0 and 1 code the queries
    shared = (q_ptr, used_ptr, w_ptr, pos_ptr, out_ptr, paths_ptr, n_keys, n_heads, n_tiles, ratio, stride_qn,
              stride_qh, stride_wn, stride_on, codes, words, q8, qb, ab, stats, tflag, ready, empty, stats_ready,
              q_ready)
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (shared, ones.index(0), 0, NC, NS, NQ, CAUSAL, COUNT, PARTS)),
            (_consumer, (shared, ones.index(1), 1, NC, NS, NQ, CAUSAL, COUNT, PARTS)),
            (_loader, (k_ptr, ks_ptr, stride_k, stride_ks, n_keys, n_tiles, codes, words, ready, empty, NS, LW, PARTS)),
        ], [4, LW], [CREGS, LREGS])
    else:
        gl.warp_specialize([
            (_consumer, (shared, ones.index(0), 0, NC, NS, NQ, CAUSAL, COUNT, PARTS)),
            (_consumer, (shared, ones.index(1), 1, NC, NS, NQ, CAUSAL, COUNT, PARTS)),
            (_consumer, (shared, ones.index(2), 2, NC, NS, NQ, CAUSAL, COUNT, PARTS)),
            (_consumer, (shared, ones.index(3), 3, NC, NS, NQ, CAUSAL, COUNT, PARTS)),
            (_loader, (k_ptr, ks_ptr, stride_k, stride_ks, n_keys, n_tiles, codes, words, ready, empty, NS, LW, PARTS)),
        ], [4, 4, 4, LW], [CREGS, CREGS, CREGS, LREGS])


def takes(q: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why this kernel cannot take these inputs (None: it can): q [n, H, 128] bf16 with 1 <= n <= 4 and H <= 64,
    packed uint8 [e, 64] with 16-byte aligned rows, scale bytes uint8 [e, 4] with 4-byte aligned rows, on a CUDA
    device of compute capability 9.0 (wgmma), under Triton 3.6."""
    if not (q.is_cuda and q.dim() == 3 and packed.dim() == 2 and scales.dim() == 2):
        return "needs CUDA tensors q [n, H, d], packed [e, d/2], scales [e, d/32]"
    refusal = hopper_gluon_refusal(q.device)
    if refusal:
        return refusal
    n, h, d = q.shape
    if d != D or not 1 <= n <= MAX_QUERIES or h > HEADS:
        return f"needs d = {D}, 1 to {MAX_QUERIES} queries and at most {HEADS} heads, found q {list(q.shape)}"
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return f"needs uint8 codes and scale bytes, found {packed.dtype} and {scales.dtype}"
    if packed.stride(1) != 1 or packed.stride(0) % 16 or packed.data_ptr() % 16:
        return f"needs 16-byte aligned rows of codes, found strides {packed.stride()}"
    if scales.stride(1) != 1 or scales.stride(0) % 4 or scales.data_ptr() % 4:
        return f"needs 4-byte aligned rows of scale bytes, found strides {scales.stride()}"
    return None


def index_scores_fp4_ws(q: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor,
                        positions: torch.Tensor | None = None, ratio: int = 4, *, slots: int = SLOTS,
                        consumers: int | None = None,
                        ctas: int | None = None, parts: int = LOADS | MMAS | EPILOGUE,
                        paths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [n, e] bf16 and ``used`` int8 [n] (1 where the query's codes are exact, so the FP8 path may run)
    for inputs :func:`takes` accepts; ``positions`` [n]: causal mask ``j < (t + 1) // ratio`` (else -inf).
    ``paths`` (int32 [2] on the device, optional): the kernel adds the number of (64-key half tile, query) pairs
    it scored on the folded FP8 path and on the bf16 path. ``ctas`` caps the persistent grid (default: one CTA
    per SM); ``parts`` other than all three is for the diagnosis only (wrong results)."""
    n, h, _ = q.shape
    e = packed.shape[0]
    if tuple(weights.shape) != (n, h) or (positions is not None and tuple(positions.shape) != (n,)):
        raise ValueError(f"index_scores_fp4_ws: weights [{n}, {h}] and positions [{n}] expected for q "
                         f"{list(q.shape)}, found weights {list(weights.shape)}, positions "
                         f"{None if positions is None else list(positions.shape)}")
    dev = q.device
    out = torch.empty((n, e), dtype=torch.bfloat16, device=dev)
    used = torch.empty((n,), dtype=torch.int8, device=dev)
    q = q.to(torch.bfloat16).contiguous()
    w = weights.to(torch.bfloat16).contiguous()
    causal = positions is not None
    pos = positions.to(torch.int32).contiguous() if causal else used  # not read without the causal mask
    if e == 0:  # no keys: one CTA still prepares the queries (``used``); its loader and tile loops do nothing
        packed, scales = torch.zeros((1, D // 2), dtype=torch.uint8, device=dev), torch.zeros(
            (1, D // 32), dtype=torch.uint8, device=dev)
    if consumers not in (None, *CONSUMER_REGS) or (consumers == 4 and n > 1):
        raise ValueError(f"index_scores_fp4_ws: consumers must be 2, or 4 for one query, found {consumers} for "
                         f"{n} queries")
    if paths is not None and (paths.dtype != torch.int32 or tuple(paths.shape) != (2,) or paths.device != dev):
        raise ValueError(f"index_scores_fp4_ws: paths must be int32 [2] on {dev}, found {paths.dtype} "
                         f"{list(paths.shape)} on {paths.device}")
    words = scales.view(torch.int32)  # [e, 1]: one word per key (takes() checked the alignment)
    n_tiles = triton.cdiv(e, TILE)
    grid = max(1, min(n_tiles, ctas or torch.cuda.get_device_properties(dev).multi_processor_count))
    consumers = consumers or (4 if n == 1 and n_tiles >= FOUR_CONSUMER_TILES * grid else 2)
    _index_ws_kernel[(grid,)](
        q, used, w, pos, out, used if paths is None else paths, packed, words, e, h, n_tiles, int(ratio), q.stride(0),
        q.stride(1), w.stride(0), out.stride(0), packed.stride(0), words.stride(0),
        NC=consumers, NS=slots, NQ=n, CAUSAL=causal, COUNT=paths is not None, LW=LOADER_WARPS, LREGS=LOADER_REGS,
        CREGS=CONSUMER_REGS[consumers], PARTS=parts, num_warps=4)
    return out, used
