"""Warp-specialized sparse FMHA on the 584 B/token FP8 KV layout (Gluon, sm_90a): the CUDA route of
``sparse_attention_fp8kv`` on an H100 / H200, decode and prefill.

The math partitions are those of the bf16 kernel (``kernels/sparse_attention_ws.py``: one consumer warpgroup with
32 heads per CTA, or two with 64), reading bf16 half-tile slots [64 rows, 256 dims]; only the producer differs.
A cache row is ``[448 e4m3 nope | 64 bf16 rope (128 B) | 7 ue8m0 scale bytes | 1 pad]`` (spec §3, the layout of
:func:`kernels.sparse_attention.pack_kv_fp8`); rows are 8-byte aligned (584 = 8 x 73), so the producer (4 warps)

1. gathers block j + NR's 64 rows with 8-byte ``cp.async`` into a raw ring of NR slots (bytes 0-511 of each row
   as eight [64, 64] byte tiles: the 448 code bytes, then the first 64 rope bytes; bytes 512-575; the scale
   bytes; one copy per buffer, zero-fill for a -1 index), arriving on the slot's ``raw_ready`` mbarrier, and
   prefetches the rows of block j + NR + PF into L2 (``prefetch.global.L2``), while
2. it dequantizes block j from its raw slot into the two bf16 slots of the block, one shared-memory store per
   half: ``e4m3 * 2^(b - 127)`` in fp32, rounded to bf16 (exact: an e4m3 value times a power of two is a bf16
   value, so the tile equals the bf16 rows of :func:`kernels.sparse_attention.unpack_kv_fp8`), the rope dims
   copied; a proxy fence, one partition barrier, then the slot's ``ready`` arrival.

Shared memory bounds the rings: with Q (32 KB per 32 heads) and P, three bf16 half-tile slots (32 KB each) and two
raw slots (36.5 KB each) fill the 227 KB of an H100 / H200 with one consumer, three and one with two; the bf16
kernel keeps five slots of 1024 B rows in flight. BENCHMARKS.md has the measured consequences.

The consumers see the same bf16 tiles as the bf16 kernel on the unpacked rows, in the same order, so the outputs
are bit-identical to ``sparse_attention_ws(q, unpack_kv_fp8(kv), ...)`` with the same layout.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

from fidelity.decoders.production.kernels._common import hopper_gluon_refusal
from fidelity.decoders.production.kernels.sparse_attention_ws import (
    BLOCK_H,
    BLOCK_N,
    HEAD_DIM,
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
# consumers -> (heads per CTA, bf16 slots, raw slots, producer warps, producer registers, lead warpgroup's
# registers); shared memory: a bf16 slot 32 KB, a raw slot 36.5 KB, Q 32 KB per 32 heads
_LAYOUT = {1: (BLOCK_H, 3, 2, 4, 96, 0), 2: (2 * BLOCK_H, 3, 1, 4, 96, 192)}
PREFETCH = 1  # blocks whose rows are prefetched into L2 beyond the raw ring (H200: 1 best of 0, 1, 2, 4)
GATHER, MATH, DEQUANT = 1, 2, 4  # PARTS bits: which parts run (all by default; the diagnosis switches some off)


@gluon.jit
def _gather_raw(kv_ptr, idx_row_ptr, j, topk, raw_codes, raw_tail, raw_scales, raw_ready, r, L3: gl.constexpr,
                L2: gl.constexpr, PARTS: gl.constexpr):
    """cp.async (8 B per copy) of block j's rows (-1: zero-filled) into raw slot r, one copy per buffer (no
    barriers between them): bytes 0-511 of each row into ``raw_codes[r]`` ([8 tiles, 64 rows, 64 B]: the 448 code
    bytes, then the first 64 rope bytes), bytes 512-575 into ``raw_tail[r]``, the scale bytes into
    ``raw_scales[r]``; every thread arrives on ``raw_ready[r]``."""
    if PARTS & 1:
        ids = _block_ids(idx_row_ptr, j, topk, 64, gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        base = kv_ptr + gl.maximum(ids, 0).to(gl.int64) * 584
        tile = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        ptrs = base[None, :, None] + (tile[:, None, None] * 64 + col[None, None, :])
        async_copy.async_copy_global_to_shared(raw_codes.index(r), ptrs, mask=(ids >= 0)[None, :, None])
        ids = _block_ids(idx_row_ptr, j, topk, 64, gl.SliceLayout(1, L2))
        base = kv_ptr + gl.maximum(ids, 0).to(gl.int64) * 584
        valid = (ids >= 0)[:, None]
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, L2))
        async_copy.async_copy_global_to_shared(raw_tail.index(r), base[:, None] + (512 + c64)[None, :], mask=valid)
        c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
        async_copy.async_copy_global_to_shared(raw_scales.index(r), base[:, None] + (576 + c8)[None, :], mask=valid)
    async_copy.mbarrier_arrive(raw_ready.index(r), increment_count=False)


@gluon.jit
def _prefetch_rows(kv_ptr, ids, layout: gl.constexpr):
    """``prefetch.global.L2`` of every 128-byte line of the rows ``ids`` (offsets 0, 128, .., 512 and the last
    byte; -1 prefetches row 0), so that their later ``cp.async`` reads L2 instead of waiting on HBM."""
    offs = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)) * 128, 583)
    ptrs = kv_ptr + gl.maximum(ids, 0).to(gl.int64)[:, None] * 584 + offs[None, :]
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dequant_half(raw_codes, raw_scales, r, h: gl.constexpr, L3: gl.constexpr):
    """Code tiles 4h .. 4h + 3 of raw slot r times 2^(b - 127), b each row's scale byte of the tile (b = 0 gives
    2^-127, as the emulation's exp2), as bf16 [64 rows, 256 dims] (for h = 1 the last 64 dims are garbage: tile 7
    holds rope bytes)."""
    codes = raw_codes.index(r).slice(4 * h, 4, dim=0).load(L3)  # [4 tiles, 64 rows, 64] e4m3 bits
    b = raw_scales.index(r).slice(4 * h, 4, dim=1).permute((1, 0)).load(gl.SliceLayout(2, L3)).to(gl.int32)
    scale = gl.where(b > 0, b << 23, 0x400000).to(gl.float32, bitcast=True)  # [4 tiles, 64 rows]
    val = (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]).to(gl.bfloat16)
    return gl.reshape(gl.permute(val, (1, 0, 2)), [64, 256])


@gluon.jit
def _rope_rows(raw_codes, raw_tail, r, RL: gl.constexpr):
    """The 64 bf16 rope dims of raw slot r's rows: [64, 64] (tile 7's bytes, then the tail's)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    lo = raw_codes.index(r).slice(7, 1, dim=0)._reinterpret(gl.bfloat16, [64, 32], plain).load(RL)
    hi = raw_tail.index(r)._reinterpret(gl.bfloat16, [64, 32], plain).load(RL)
    return gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [64, 64])


@gluon.jit
def _fp8_producer(kv_ptr, idx_row_ptr, topk, n_blocks, kv_smem, raw_codes, raw_tail, raw_scales, raw_ready, ready,
                  empty, BN: gl.constexpr, NS: gl.constexpr, NR: gl.constexpr, PF: gl.constexpr, PW: gl.constexpr,
                  PARTS: gl.constexpr):
    """Gathers block j + NR while it dequantizes block j into slots 2j (dims [0, 256)) and 2j + 1 (mod NS), one
    shared-memory store per half (and one for the rope dims); with PF > 0 the rows of block j + NR + PF are
    prefetched into L2 (the gathers then wait on L2, not HBM)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, PW, 1], [2, 1, 0])  # [tiles, rows, 64 B]
    L2: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])  # [rows, bytes]
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [PW, 1], [1, 0])  # bf16 [rows, 32], 16 B a thread
    pf_layout: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [PW, 1], [1, 0])  # [64 rows, 8 lines], no copies
    pf_rows: gl.constexpr = gl.SliceLayout(1, pf_layout)
    if PF > 0:
        for j in range(NR, gl.minimum(n_blocks, NR + PF)):
            _prefetch_rows(kv_ptr, _block_ids(idx_row_ptr, j, topk, BN, pf_rows), pf_layout)
    pf_ids = _block_ids(idx_row_ptr, NR + PF, topk, BN, pf_rows)  # loaded an iteration before its prefetch
    for j in range(gl.minimum(n_blocks, NR)):
        _gather_raw(kv_ptr, idx_row_ptr, j, topk, raw_codes, raw_tail, raw_scales, raw_ready, j, L3, L2, PARTS)
    for j in range(n_blocks):
        r = j % NR
        if PF > 0:
            if j + NR + PF < n_blocks:
                _prefetch_rows(kv_ptr, pf_ids, pf_layout)
            pf_ids = _block_ids(idx_row_ptr, j + 1 + NR + PF, topk, BN, pf_rows)
        mbarrier.wait(raw_ready.index(r), (j // NR) & 1)
        for h in gl.static_range(2):
            u = 2 * j + h
            s = u % NS
            mbarrier.wait(empty.index(s), ((u // NS) & 1) ^ 1)
            if PARTS & 4:
                slot = kv_smem.index(s)
                slot.store(_dequant_half(raw_codes, raw_scales, r, h, L3))
                if h == 1:
                    slot.slice(192, 64, dim=1).store(_rope_rows(raw_codes, raw_tail, r, RL))
            fence_async_shared()
            gl.thread_barrier()  # every thread's stores (and, after h = 1, its reads of raw slot r) are done
            mbarrier.arrive(ready.index(s), count=1)
        if j + NR < n_blocks:
            _gather_raw(kv_ptr, idx_row_ptr, j + NR, topk, raw_codes, raw_tail, raw_scales, raw_ready, r, L3, L2,
                        PARTS)


@gluon.jit
def _rings(NS: gl.constexpr, NR: gl.constexpr, BN: gl.constexpr, PW: gl.constexpr):
    """The raw ring (NR slots: code tiles, rope tail, scale bytes, ``raw_ready``) and the bf16 ring's mbarriers
    (``ready``: the producer's one arrival after its partition barrier; ``empty``: the reader's release), all
    initialized."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw_codes = gl.allocate_shared_memory(gl.uint8, [NR, 8, BN, 64], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    raw_tail = gl.allocate_shared_memory(gl.uint8, [NR, BN, 64], plain)
    raw_scales = gl.allocate_shared_memory(gl.uint8, [NR, BN, 8], plain)
    raw_ready = gl.allocate_shared_memory(gl.int64, [NR, 1], mbarrier.MBarrierLayout())
    ready, empty = _slot_barriers(NS, 1)
    for i in gl.static_range(NR):
        mbarrier.init(raw_ready.index(i), count=PW * 32)  # every producer thread's cp.async arrival
    return raw_codes, raw_tail, raw_scales, raw_ready, ready, empty


@gluon.jit
def _one_consumer_fp8_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                             stride_qn, stride_qh, stride_in, stride_on, stride_oh,
                             D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                             NR: gl.constexpr, PF: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr,
                             PARTS: gl.constexpr):
    pid_n = gl.program_id(1).to(gl.int64)
    h0 = gl.program_id(0) * BH
    kv_smem, q_smem, p_smem, red = _one_consumer_buffers(NS, BN, BH, D)
    raw_codes, raw_tail, raw_scales, raw_ready, ready, empty = _rings(NS, NR, BN, PW)
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_one_consumer, (q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0,
                         topk, n_blocks, scale, kv_smem, q_smem, p_smem, red, ready, empty, D, BH, BN, NS, PARTS)),
        (_fp8_producer, (kv_ptr, idx_row_ptr, topk, n_blocks, kv_smem, raw_codes, raw_tail, raw_scales, raw_ready,
                         ready, empty, BN, NS, NR, PF, PW, PARTS)),
    ], [PW], [PREGS])


@gluon.jit
def _two_consumer_fp8_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                             stride_qn, stride_qh, stride_in, stride_on, stride_oh,
                             D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
                             NR: gl.constexpr, PF: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr,
                             CREGS: gl.constexpr, PARTS: gl.constexpr):
    W: gl.constexpr = D // 2
    pid_n = gl.program_id(1).to(gl.int64)
    h0 = gl.program_id(0) * BH
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, W],
                                        gl.NVMMASharedLayout.get_default_for([BN, W], gl.bfloat16))
    q_h, p_buf, a_buf, l_buf, p_ready, p_free, q_ready, l_ready = _two_consumer_exchange(BH, BN, W)
    raw_codes, raw_tail, raw_scales, raw_ready, ready, empty = _rings(NS, NR, BN, PW)
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_tail, (idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk, n_blocks, scale, kv_smem, q_h,
                 p_buf, a_buf, l_buf, ready, empty, q_ready, p_ready, p_free, l_ready, BH, BN, W, NS, PARTS)),
        (_lead, (q_ptr, stride_qn, stride_qh, o_ptr, stride_on, stride_oh, pid_n, h0, n_blocks, kv_smem, q_h, p_buf,
                 a_buf, l_buf, empty, q_ready, p_ready, p_free, l_ready, BH, W, NS, PARTS)),
        (_fp8_producer, (kv_ptr, idx_row_ptr, topk, n_blocks, kv_smem, raw_codes, raw_tail, raw_scales, raw_ready,
                         ready, empty, BN, NS, NR, PF, PW, PARTS)),
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
                              raw_slots: int | None = None, prefetch: int | None = None,
                              producer_warps: int | None = None, parts: int = GATHER | MATH | DEQUANT
                              ) -> torch.Tensor:
    """q [n, H, 512] bf16, kv uint8 [m, 584] (the FP8 layout), idx [n, K] int (-1 = masked), sink [H] fp32 ->
    o [n, H, 512] bf16 (inputs as checked by :func:`takes`). ``consumers`` (1: 32 heads per CTA, 2: 64) defaults
    to :func:`kernels.sparse_attention_ws.consumers_for`; ``slots`` / ``raw_slots`` override the bf16 and raw ring
    depths of that layout (shared memory permitting), ``prefetch`` the L2 prefetch distance in blocks (0: none),
    ``producer_warps`` 4, or 8 with one consumer;
    ``parts`` other than all is for the diagnosis only (wrong results)."""
    n, h, d = q.shape
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    nc = consumer_layout("sparse_attention_ws_fp8kv", consumers, n, h, q.device)
    bh, ns, nr, pw, pregs, cregs = _LAYOUT[nc]
    ns, nr = slots or ns, raw_slots or nr
    if producer_warps not in (None, pw):
        if (nc, producer_warps) != (1, 8):
            raise ValueError(f"sparse_attention_ws_fp8kv: producer_warps must be 4, or 8 with one consumer (the "
                             f"registers of 8 warps do not fit beside two); found {producer_warps} with "
                             f"consumers={nc}")
        pw = producer_warps
    q, kv = q.contiguous(), kv.contiguous()
    idx, sink = idx.to(torch.int32).contiguous(), sink.to(torch.float32).contiguous()
    args = (q, kv, idx, sink, o, idx.shape[1], float(scale), q.stride(0), q.stride(1), idx.stride(0), o.stride(0),
            o.stride(1))
    pf = PREFETCH if prefetch is None else prefetch
    common = dict(D=d, BH=bh, BN=BLOCK_N, NS=ns, NR=nr, PF=pf, PW=pw, PREGS=pregs, PARTS=parts,
                  num_warps=4)
    if nc == 1:
        _one_consumer_fp8_kernel[(h // bh, n)](*args, **common)
    else:
        _two_consumer_fp8_kernel[(h // bh, n)](*args, CREGS=cregs, **common)
    return o

