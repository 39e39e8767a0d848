"""Warp-specialized sparse FMHA on the 584 B/token FP8 KV layout (Gluon, sm_90a): the CUDA route of
``sparse_attention_fp8kv`` on an H100 / H200, decode and prefill.

The math partitions are those of the bf16 kernel (``kernels/sparse_attention_ws.py``: one consumer warpgroup with
32 heads per CTA, or two with 64), reading the same bf16 half-tile slots [64 rows, 256 dims] in the same rings (five
slots with one consumer, four with two); only the producers differ. A cache row is ``[448 e4m3 nope | 64 bf16 rope
(128 B) | 7 ue8m0 scale bytes | 1 pad]`` (spec §3, the layout of ``kv_layout.pack``), 8-byte aligned
(584 = 8 x 73). A producer partition (4 warps)

1. loads its half of a block's 64 rows into registers as int32 words with 8-byte loads (half 0: code bytes 0-255;
   half 1: code bytes 256-447 and the rope bytes), and each row's scale bytes as one int64 word; -1 rows load
   nothing (zero codes). Words, not bytes, so that the loop carries them without a register per byte;
2. waits for the half's slot, dequantizes (``e4m3 * 2^(b - 127)``: e4m3 -> f16 -> f32 exactly, one fp32 multiply,
   rounded to bf16, four codes a word in one inline-assembly block; exact, since an e4m3 value times a power of
   two is a bf16 value, so the tile equals ``kv_layout.unpack``'s rows), stores the tile (the rope words copied),
   fences, meets its partition barrier and arrives on the slot's ``ready`` barrier.

With one consumer, two producer partitions take half 0 and half 1 of every block, each loading block j + 1 before
it stores block j (the loop takes two blocks a step, so no loaded register is copied); with two consumers one
partition fills both halves, each loaded one half ahead of its store (``ahead=False``: in turn). The two-consumer CTA
stays at 12 warps: its wgmma accumulators need at least 154 registers a thread in the compiled function, and 16 warps
of 154 exceed the register file. The partition with half 0 prefetches rows into L2 (``prefetch.global.L2``)
``prefetch`` blocks ahead of its loads.

The consumers see the same bf16 tiles as the bf16 kernel on the unpacked rows, in the same order, so the outputs
are bit-identical to ``sparse_attention_ws(q, kv_layout.unpack(kv, 512, 64), ...)`` with the same layout.
BENCHMARKS.md has what bounds it.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from fidelity.decoders.production.kernels._common import hopper_gluon_refusal
from fidelity.decoders.production.kernels.sparse_attention_ws import (
    BLOCK_H,
    BLOCK_N,
    HEAD_DIM,
    PRODUCER_WARPS,
    _block_ids,
    _lead,
    _one_consumer,
    _one_consumer_buffers,
    _slot_barriers,
    _tail,
    _two_consumer_exchange,
    consumer_layout,
)

ROW_BYTES = 584
# consumers -> (heads per CTA, bf16 slots, registers of a producer partition, lead warpgroup's registers); shared
# memory: a bf16 slot 32 KB, Q 32 KB per 32 heads (the bf16 kernel's rings). One consumer: two producer partitions
# (one per half of a block); two consumers: one (the two warpgroups' wgmma accumulators hold the kernel to 12 warps:
# a 16-warp CTA would leave fewer registers per thread than one wgmma needs), here with the registers of the in-turn
# fill
_LAYOUT = {1: (BLOCK_H, 5, 128, 0), 2: (2 * BLOCK_H, 4, 96, 192)}
# two consumers, halves loaded one ahead of their stores: (producer, lead) registers (the tail keeps 208)
_AHEAD_REGS = (120, 176)
AHEAD = True  # the two-consumer producer's default fill order (BENCHMARKS.md: the ``ahead`` sweep)
PREFETCH = 1  # blocks whose rows are prefetched into L2 ahead of the loads (H200: 1 best of 0-3)
# PARTS bits: which parts run (all by default; the diagnosis switches some off): the producers' loads, the consumers'
# math, the dequantization and stores, the producers' proxy fence
GATHER, MATH, DEQUANT, FENCE = 1, 2, 4, 8


@gluon.jit
def _prefetch_rows(kv_ptr, ids, layout: gl.constexpr):
    """``prefetch.global.L2`` of every 128-byte line of the rows ``ids`` (offsets 0, 128, .., 512 and the last
    byte; -1 prefetches row 0), so that their later loads read L2 instead of waiting on HBM."""
    offs = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)) * 128, 583)
    ptrs = kv_ptr + gl.maximum(ids, 0).to(gl.int64)[:, None] * 584 + offs[None, :]
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)


# one word of four e4m3 codes ($2) times the fp32 scale ($3) -> two bf16 pairs ($0: codes 0-1, $1: 2-3): exact
# e4m3 -> f16 -> f32, the product rounded once to bf16 (the emulation's fp32 product, rounded on the copy)
_DEQUANT_WORD = gl.constexpr("""{
.reg .b16 c01, c23, h0, h1, h2, h3;
.reg .b32 p01, p23;
.reg .f32 f0, f1, f2, f3;
mov.b32 {c01, c23}, $2;
cvt.rn.f16x2.e4m3x2 p01, c01;
cvt.rn.f16x2.e4m3x2 p23, c23;
mov.b32 {h0, h1}, p01;
mov.b32 {h2, h3}, p23;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
mul.rn.f32 f0, f0, $3;
mul.rn.f32 f1, f1, $3;
mul.rn.f32 f2, f2, $3;
mul.rn.f32 f3, f3, $3;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")


@gluon.jit
def _code_words(kvi_ptr, rows, valid, T0: gl.constexpr, NT: gl.constexpr, L3: gl.constexpr, PARTS: gl.constexpr):
    """Code tiles T0 ..+NT of ``rows`` (int64 [64]; invalid rows zero) as int32 words [NT, 64 rows, 16], four codes
    a word: 8-byte loads (a row starts 8-byte aligned). Words, not bytes, so that a loop can carry them."""
    tile = T0 + gl.arange(0, NT, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    ptrs = kvi_ptr + rows[None, :, None] * 146 + (tile[:, None, None] * 16 + col[None, None, :])
    if PARTS & 1:
        words = gl.load(ptrs, mask=valid[None, :, None], other=0)
    else:
        words = gl.zeros([NT, 64, 16], gl.int32, layout=L3)
    return words


@gluon.jit
def _dequant(words, sw, T0: gl.constexpr, NT: gl.constexpr):
    """int32 [NT, 64 rows, 16] code words of tiles T0 ..+NT times 2^(b - 127), b the row's scale byte of the tile
    (byte T0 + t of its int64 scale word ``sw`` [64]; b = 0 gives 2^-127, as the emulation's exp2), rounded to bf16
    (exact: an e4m3 value times a power of two is a bf16 value) -> int32 [64, 32 NT], two bf16 a word."""
    sw_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, words.type.layout))
    shift = 8 * (T0 + gl.arange(0, NT, layout=gl.SliceLayout(1, gl.SliceLayout(2, words.type.layout))))
    b = ((gl.convert_layout(sw, sw_l)[None, :] >> shift[:, None].to(gl.int64)) & 0xFF).to(gl.int32)
    scale = gl.where(b > 0, b << 23, 0x400000)  # [NT, 64 rows], fp32 bits of 2^(b - 127)
    lo, hi = gl.inline_asm_elementwise(_DEQUANT_WORD, "=r,=r,r,r", [words, scale[:, :, None]],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    pairs = gl.reshape(gl.join(lo, hi), [NT, 64, 32])
    return gl.reshape(gl.permute(pairs, (1, 0, 2)), [64, 32 * NT])


@gluon.jit
def _split_tiles(words):
    """int32 [2N, 64, 16] code tiles -> tiles 0 ..N and N ..2N, each [N, 64, 16] (the tile dimension lies within
    each thread, so the split moves no data)."""
    N: gl.constexpr = words.shape[0] // 2
    pairs = gl.permute(gl.reshape(words, [2, N, 64, 16]), (1, 2, 3, 0))
    return gl.split(pairs)


@gluon.jit
def _load_lo(kvi_ptr, kvw_ptr, ids, L3: gl.constexpr, PARTS: gl.constexpr):
    """Half 0 of the rows ``ids`` (a block's 64 indices, -1: zero rows) in registers: code tiles 0-3 and each row's
    scale word (int64 [64])."""
    valid = ids >= 0
    rows = gl.maximum(ids, 0).to(gl.int64)
    sw = gl.load(kvw_ptr + rows * 73 + 72, mask=valid, other=0)
    return _code_words(kvi_ptr, rows, valid, 0, 4, L3, PARTS), sw


@gluon.jit
def _load_hi(kvi_ptr, kvw_ptr, ids, L3: gl.constexpr, PARTS: gl.constexpr):
    """Half 1 of the rows ``ids`` in registers: code tiles 4-5, tile 6, the rope dims' 32 words (bytes 448-575,
    as [2, 64, 16] int32: two bf16 a word), the scale words."""
    valid = ids >= 0
    rows = gl.maximum(ids, 0).to(gl.int64)
    sw = gl.load(kvw_ptr + rows * 73 + 72, mask=valid, other=0)
    rope = gl.reshape(_code_words(kvi_ptr, rows, valid, 7, 2, L3, PARTS), [2, 64, 16])  # words 112-143
    return (_code_words(kvi_ptr, rows, valid, 4, 2, L3, PARTS), _code_words(kvi_ptr, rows, valid, 6, 1, L3, PARTS),
            rope, sw)


@gluon.jit
def _slot_words(kv_smem, s):
    """Slot s ([64, 256] bf16, 128-byte swizzle) as int32 [64, 128] over the same bytes."""
    return kv_smem.index(s)._reinterpret(gl.int32, [64, 128], gl.NVMMASharedLayout(128, 32))


@gluon.jit
def _fill(kv_smem, ready, empty, u, NS: gl.constexpr, PARTS: gl.constexpr, H: gl.constexpr, codes, sw, last, rope):
    """Waits for slot u mod NS, stores half H's bf16 tile (H = 0: tiles 0-3 from ``codes``; H = 1: tiles 4-6 from
    ``codes`` and ``last``, then the rope words), fences, meets the partition barrier, arrives on ``ready``."""
    s = u % NS
    mbarrier.wait(empty.index(s), ((u // NS) & 1) ^ 1)
    if PARTS & 4:  # DEQUANT
        slot = _slot_words(kv_smem, s)
        if H == 0:  # two tiles a store
            first, second = _split_tiles(codes)
            slot.slice(0, 64, dim=1).store(_dequant(first, sw, 0, 2))
            slot.slice(64, 64, dim=1).store(_dequant(second, sw, 2, 2))
        else:
            slot.slice(0, 64, dim=1).store(_dequant(codes, sw, 4, 2))
            slot.slice(64, 32, dim=1).store(_dequant(last, sw, 6, 1))
            slot.slice(96, 32, dim=1).store(gl.reshape(gl.permute(rope, (1, 0, 2)), [64, 32]))
    if PARTS & 8:  # FENCE
        fence_async_shared()
    gl.thread_barrier()  # every thread's stores are done
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _load_half(kvi_ptr, kvw_ptr, ids, H: gl.constexpr, L3: gl.constexpr, PARTS: gl.constexpr):
    """Half H of the rows ``ids`` in registers, as :func:`_fill` takes it: (codes, scale words, last, rope)."""
    if H == 0:
        codes, sw = _load_lo(kvi_ptr, kvw_ptr, ids, L3, PARTS)
        last, rope = codes, codes
    else:
        codes, last, rope, sw = _load_hi(kvi_ptr, kvw_ptr, ids, L3, PARTS)
    return codes, sw, last, rope


@gluon.jit
def _fill_halves_in_turn(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, pf_ids,
                         BN: gl.constexpr, NS: gl.constexpr, PF: gl.constexpr, L3: gl.constexpr,
                         PF_LAYOUT: gl.constexpr, PARTS: gl.constexpr):
    """Both halves of every block, each loaded just before its store; block j + 1 + PF's rows prefetched."""
    pf_rows: gl.constexpr = gl.SliceLayout(1, PF_LAYOUT)
    rows_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L3))
    for j in range(n_blocks):
        if PF > 0:
            if j + 1 + PF < n_blocks:
                _prefetch_rows(kv_ptr, pf_ids, PF_LAYOUT)
            pf_ids = _block_ids(idx_row_ptr, j + 2 + PF, topk, BN, pf_rows)
        ids = _block_ids(idx_row_ptr, j, topk, BN, rows_l)
        codes, sw, last, rope = _load_half(kvi_ptr, kvw_ptr, ids, 0, L3, PARTS)
        _fill(kv_smem, ready, empty, 2 * j, NS, PARTS, 0, codes, sw, last, rope)
        codes, sw, last, rope = _load_half(kvi_ptr, kvw_ptr, ids, 1, L3, PARTS)
        _fill(kv_smem, ready, empty, 2 * j + 1, NS, PARTS, 1, codes, sw, last, rope)


@gluon.jit
def _fill_halves_ahead(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, pf_ids,
                       BN: gl.constexpr, NS: gl.constexpr, PF: gl.constexpr, L3: gl.constexpr,
                       PF_LAYOUT: gl.constexpr, PARTS: gl.constexpr):
    """Both halves of every block, each loaded one half ahead of its store (load half 1 of block j, store half 0,
    load half 0 of block j + 1, store half 1), so that two halves' loads are in flight while one is stored; block
    j + 1 + PF's rows prefetched."""
    pf_rows: gl.constexpr = gl.SliceLayout(1, PF_LAYOUT)
    rows_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L3))
    ids = _block_ids(idx_row_ptr, 0, topk, BN, rows_l)
    lo, lo_sw = _load_lo(kvi_ptr, kvw_ptr, ids, L3, PARTS)
    for j in range(n_blocks):
        if PF > 0:
            if j + 1 + PF < n_blocks:
                _prefetch_rows(kv_ptr, pf_ids, PF_LAYOUT)
            pf_ids = _block_ids(idx_row_ptr, j + 2 + PF, topk, BN, pf_rows)
        hi, last, rope, hi_sw = _load_hi(kvi_ptr, kvw_ptr, ids, L3, PARTS)
        _fill(kv_smem, ready, empty, 2 * j, NS, PARTS, 0, lo, lo_sw, lo, lo)
        ids = _block_ids(idx_row_ptr, j + 1, topk, BN, rows_l)
        lo, lo_sw = _load_lo(kvi_ptr, kvw_ptr, ids, L3, PARTS)
        _fill(kv_smem, ready, empty, 2 * j + 1, NS, PARTS, 1, hi, hi_sw, last, rope)


@gluon.jit
def _fill_one_half_ahead(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, pf_ids,
                         BN: gl.constexpr, NS: gl.constexpr, H: gl.constexpr, PF: gl.constexpr, L3: gl.constexpr,
                         PF_LAYOUT: gl.constexpr, PARTS: gl.constexpr):
    """Half H of every block, loads a block ahead of the stores, two blocks a loop step (two register sets, A and
    B: load B's block j + 1, store A's block j, load block j + 2 into A, store B's), so that no loaded register is
    copied (a copy waits for its load); half 0 prefetches blocks j + 1 + PF and j + 2 + PF."""
    pf_rows: gl.constexpr = gl.SliceLayout(1, PF_LAYOUT)
    rows_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L3))
    pf_next = _block_ids(idx_row_ptr, 2 + PF, topk, BN, pf_rows)
    a, a_sw, a_last, a_rope = _load_half(kvi_ptr, kvw_ptr, _block_ids(idx_row_ptr, 0, topk, BN, rows_l), H, L3,
                                         PARTS)
    ids_b = _block_ids(idx_row_ptr, 1, topk, BN, rows_l)
    ids_a = _block_ids(idx_row_ptr, 2, topk, BN, rows_l)
    for j in range(0, n_blocks, 2):
        if PF > 0 and H == 0:
            if j + 1 + PF < n_blocks:
                _prefetch_rows(kv_ptr, pf_ids, PF_LAYOUT)
            if j + 2 + PF < n_blocks:
                _prefetch_rows(kv_ptr, pf_next, PF_LAYOUT)
            pf_ids = _block_ids(idx_row_ptr, j + 3 + PF, topk, BN, pf_rows)
            pf_next = _block_ids(idx_row_ptr, j + 4 + PF, topk, BN, pf_rows)
        b, b_sw, b_last, b_rope = _load_half(kvi_ptr, kvw_ptr, ids_b, H, L3, PARTS)
        _fill(kv_smem, ready, empty, 2 * j + H, NS, PARTS, H, a, a_sw, a_last, a_rope)
        a, a_sw, a_last, a_rope = _load_half(kvi_ptr, kvw_ptr, ids_a, H, L3, PARTS)
        if j + 1 < n_blocks:
            _fill(kv_smem, ready, empty, 2 * j + 2 + H, NS, PARTS, H, b, b_sw, b_last, b_rope)
        ids_b = _block_ids(idx_row_ptr, j + 3, topk, BN, rows_l)
        ids_a = _block_ids(idx_row_ptr, j + 4, topk, BN, rows_l)


@gluon.jit
def _dequant_producer(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty,
                      BN: gl.constexpr, NS: gl.constexpr, H0: gl.constexpr, NH: gl.constexpr, PF: gl.constexpr,
                      PW: gl.constexpr, AHEAD: gl.constexpr, PARTS: gl.constexpr):
    """Fills the bf16 slots of halves H0 ..+NH of every block (slot 2j + h mod NS) from the 584 B rows (8-byte
    words loaded into registers): one half (NH = 1) with its loads a block ahead (:func:`_fill_one_half_ahead`),
    or both (the two-consumer layout), each loaded one half ahead of its store (AHEAD, :func:`_fill_halves_ahead`)
    or in turn (:func:`_fill_halves_in_turn`). Half 0 holds code
    tiles 0-3 (dims 0-255), half 1 tiles 4-6 and the rope dims. The partition with half 0 prefetches rows into L2,
    PF blocks ahead of its loads."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 4, 8], [1, PW, 1], [2, 1, 0])  # [tiles, rows, 16 words]
    pf_layout: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [PW, 1], [1, 0])  # [64 rows, 8 lines], no copies
    pf_rows: gl.constexpr = gl.SliceLayout(1, pf_layout)
    if PF > 0 and H0 == 0:
        for j in range(1, gl.minimum(n_blocks, 1 + PF)):
            _prefetch_rows(kv_ptr, _block_ids(idx_row_ptr, j, topk, BN, pf_rows), pf_layout)
    pf_ids = _block_ids(idx_row_ptr, 1 + PF, topk, BN, pf_rows)  # loaded a loop step before its prefetch
    if NH == 2 and AHEAD:
        _fill_halves_ahead(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, pf_ids,
                           BN, NS, PF, L3, pf_layout, PARTS)
    elif NH == 2:
        _fill_halves_in_turn(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, pf_ids,
                             BN, NS, PF, L3, pf_layout, PARTS)
    else:
        _fill_one_half_ahead(kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, pf_ids,
                             BN, NS, H0, PF, L3, pf_layout, PARTS)


@gluon.jit
def _one_consumer_fp8_kernel(q_ptr, kv_ptr, kvi_ptr, kvw_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                             stride_qn, stride_qh, stride_in, stride_on, stride_oh,
                             D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                             PF: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr, PARTS: gl.constexpr):
    pid_n = gl.program_id(1).to(gl.int64)
    h0 = gl.program_id(0) * BH
    kv_smem, q_smem, p_smem, red = _one_consumer_buffers(NS, BN, BH, D)
    ready, empty = _slot_barriers(NS, 1)  # ready: the filling partition's one arrival after its barrier
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_one_consumer, (q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0,
                         topk, n_blocks, scale, kv_smem, q_smem, p_smem, red, ready, empty, D, BH, BN, NS, PARTS)),
        (_dequant_producer, (kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, BN, NS,
                             0, 1, PF, PW, False, PARTS)),
        (_dequant_producer, (kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, BN, NS,
                             1, 1, PF, PW, False, PARTS)),
    ], [PW, PW], [PREGS, PREGS])


@gluon.jit
def _two_consumer_fp8_kernel(q_ptr, kv_ptr, kvi_ptr, kvw_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                             stride_qn, stride_qh, stride_in, stride_on, stride_oh,
                             D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                             PF: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr, CREGS: gl.constexpr,
                             AHEAD: gl.constexpr, PARTS: gl.constexpr):
    W: gl.constexpr = D // 2
    pid_n = gl.program_id(1).to(gl.int64)
    h0 = gl.program_id(0) * BH
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, W],
                                        gl.NVMMASharedLayout.get_default_for([BN, W], gl.bfloat16))
    q_h, p_buf, a_buf, l_buf, p_ready, p_free, q_ready, l_ready = _two_consumer_exchange(BH, BN, W)
    ready, empty = _slot_barriers(NS, 1)
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_tail, (idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk, n_blocks, scale, kv_smem,
                 q_h, p_buf, a_buf, l_buf, ready, empty, q_ready, p_ready, p_free, l_ready, BH, BN, W, NS, PARTS)),
        (_lead, (q_ptr, stride_qn, stride_qh, o_ptr, stride_on, stride_oh, pid_n, h0, n_blocks, kv_smem, q_h,
                 p_buf, a_buf, l_buf, empty, q_ready, p_ready, p_free, l_ready, BH, W, NS, PARTS)),
        (_dequant_producer, (kv_ptr, kvi_ptr, kvw_ptr, idx_row_ptr, topk, n_blocks, kv_smem, ready, empty, BN,
                             NS, 0, 2, PF, PW, AHEAD, PARTS)),
    ], [4, PW], [CREGS, PREGS])


def takes(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> str | None:
    """Why this kernel cannot take these inputs (None: it can): bf16 q [n, H, 512] with H a multiple of 32, the
    uint8 [m, 584] cache, 2-D idx, on a CUDA device of compute capability 9.0 (wgmma), under Triton 3.6."""
    if not (q.is_cuda and q.dim() == 3 and kv.dim() == 2 and idx.dim() == 2):
        return "needs CUDA tensors q [n, H, d], kv [m, 584], idx [n, K]"
    refusal = hopper_gluon_refusal(q.device)
    if refusal:
        return refusal
    if q.dtype != torch.bfloat16 or kv.dtype != torch.uint8 or kv.shape[1] != ROW_BYTES:
        return f"needs bf16 q and a uint8 [m, {ROW_BYTES}] cache, found {q.dtype} and {kv.dtype} {list(kv.shape)}"
    if q.shape[-1] != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, found {q.shape[-1]}"
    if q.shape[1] % BLOCK_H:
        return f"needs a head count that is a multiple of {BLOCK_H}, found {q.shape[1]}"
    return None


def sparse_attention_ws_fp8kv(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                              scale: float, *, consumers: int | None = None, slots: int | None = None,
                              prefetch: int | None = None, ahead: bool | None = None,
                              parts: int = GATHER | MATH | DEQUANT | FENCE) -> torch.Tensor:
    """q [n, H, 512] bf16, kv uint8 [m, 584] (the FP8 layout), idx [n, K] int (-1 = masked), sink [H] fp32 ->
    o [n, H, 512] bf16 (inputs as checked by :func:`takes`). ``consumers`` (1: 32 heads per CTA, 2: 64) defaults
    to :func:`kernels.sparse_attention_ws.consumers_for`; ``slots`` overrides the bf16 ring depth of that layout
    (shared memory permitting), ``prefetch`` the L2 prefetch distance in blocks (0: none); ``ahead`` (two consumers)
    has the producer load each half of a block one half ahead of its store (default :data:`AHEAD`); ``parts`` other
    than all is for the diagnosis only (wrong results)."""
    n, h, d = q.shape
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    nc = consumer_layout("sparse_attention_ws_fp8kv", consumers, n, h, q.device)
    bh, ns, pregs, cregs = _LAYOUT[nc]
    ns = slots or ns
    q, kv = q.contiguous(), kv.contiguous()
    idx, sink = idx.to(torch.int32).contiguous(), sink.to(torch.float32).contiguous()
    # the rows as int32 words (codes, rope dims) and as int64 words (the scale bytes: word 72 of a row)
    args = (q, kv, kv.view(torch.int32), kv.view(torch.int64), idx, sink, o, idx.shape[1], float(scale),
            q.stride(0), q.stride(1), idx.stride(0), o.stride(0), o.stride(1))
    pf = PREFETCH if prefetch is None else prefetch
    common = dict(D=d, BH=bh, BN=BLOCK_N, NS=ns, PF=pf, PW=PRODUCER_WARPS, PREGS=pregs, PARTS=parts, num_warps=4)
    if nc == 1:
        _one_consumer_fp8_kernel[(h // bh, n)](*args, **common)
    else:
        fill_ahead = AHEAD if ahead is None else bool(ahead)
        if fill_ahead:
            common["PREGS"], cregs = _AHEAD_REGS
        _two_consumer_fp8_kernel[(h // bh, n)](*args, CREGS=cregs, AHEAD=fill_ahead, **common)
    return o
