"""Warp-specialized sparse FMHA for Hopper (Gluon, sm_90a): the default route of ``sparse_attention`` for bf16
attention at d = 512 on an H100 / H200, decode and prefill.

Same semantics as the Triton kernel (``kernels/sparse_attention.py``, spec §3 ``sparse_attn``): online softmax
over consecutive blocks of 64 indices, ``s = (q . k) * scale`` with fp32 accumulation, fp32 running max and sum,
``P = exp(s - m)`` rounded to bf16 against the running max before ``P . V``, a -1 index loads no row (zero row,
logit -inf), ``sum += exp(sink - m)`` after the loop.

One CTA per (query token, head group), in warp-specialized partitions that overlap the row gathers with the math.
The producer (4 warps, few registers) loads each block's 64 indices and gathers the rows with ``cp.async`` (16 B
per copy, zero-fill for -1) into a ring of half-tile slots ([64 rows, 256 dims]; block j in slots 2j, 2j+1 mod
the ring); a slot's copies arrive on its ``ready`` mbarrier, and its reader releases it on its ``empty`` mbarrier.

Two layouts of the math (``consumers``):

* one consumer warpgroup, 32 heads per CTA: the rows are the MMA's M, so 32 heads need no padding to wgmma's
  M = 64: ``S^T [64 rows, 32 heads] = K Q^T``, the column softmax (the four warps' column maxima meet in shared
  memory at one barrier; the sum of P kept per (row, head), reduced over rows at the end), ``P^T`` to shared
  memory, ``O^T [512, 32] += V^T P^T`` as two 256-dim halves. Five slots (2.5 blocks in flight, 196 KB with Q
  and P); the first half's ``Q . K`` starts while the second half may still land, and the first half's slot is
  released while the second half's ``P . V`` runs;
* two consumer warpgroups, 64 heads per CTA: the heads are the MMA's M. The tail warpgroup makes
  ``S [64 heads, 64 rows] = Q K^T`` (m64n64k16), the row softmax (one fp32 sum per head and block) and P (bf16,
  to shared memory, with the rescale), then ``O[:, 256:] += P V[:, 256:]`` (m64n256k16); the lead warpgroup loads
  Q and makes ``O[:, :256] += P V[:, :256]`` from the same P. Four slots (2 blocks in flight; Q is 64 KB). A CTA
  does twice the heads of the one-consumer layout in about 1.19x the time (H200), so it pays off once the
  one-consumer grid needs more than one wave of CTAs (:func:`consumers_for`).

Both layouts round P at the same points against the same running max; they differ in the fp32 summation order of
the row sum (and rarely of S), so about 1e-5 of the bf16 outputs differ by one ulp, within the op's contract. The
head groups of a token are neighbouring CTAs, so their shared rows meet in L2. O leaves through Q's shared-memory
buffer as coalesced rows.
"""

from __future__ import annotations

import math

import torch
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

BLOCK_N = 64  # indices per online-softmax step (the reference's block)
BLOCK_H = 32  # heads per CTA of the one-consumer layout (64 with two consumers)
HEAD_DIM = 512
PRODUCER_WARPS = 4
CHUNK = 64  # columns per cp.async batch: [64 rows, 64 cols] = 16 B x 512 copies
GATHER, MATH = 1, 2  # PARTS bits: which halves run (both by default; benchmarks/diag_fmha_ws.py switches one off)
# consumers -> (heads per CTA, ring slots, producer registers, lead warpgroup's registers)
_LAYOUT = {1: (BLOCK_H, 5, 56, 0), 2: (2 * BLOCK_H, 4, 56, 200)}
_PER_CTA_COST = {1: 1.0, 2: 1.19}  # time of one CTA, one consumer = 1 (H200, Flash decode b64: 26.9 / 22.7 us)


@gluon.jit
def _block_ids(idx_row_ptr, j, topk, BN: gl.constexpr, layout: gl.constexpr):
    """Block j's BN indices (-1 past the end of the row)."""
    cols = j * BN + gl.arange(0, BN, layout=layout)
    return gl.load(idx_row_ptr + cols, mask=cols < topk, other=-1)


@gluon.jit
def _producer(kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty,
              D: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr, PW: gl.constexpr,
              PARTS: gl.constexpr):
    """Gathers block j's rows into slots 2j (dims [0, D/2)) and 2j + 1 (mod NS), each once it is released."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CH // 8), CH // 8], [PW, 1], [1, 0])
    W: gl.constexpr = D // 2
    for j in range(n_blocks):
        ids = _block_ids(idx_row_ptr, j, topk, BN, gl.SliceLayout(1, layout))
        valid = ids >= 0
        rows = gl.where(valid, ids, 0).to(gl.int64)
        for h in gl.static_range(2):
            u = 2 * j + h
            s = u % NS
            mbarrier.wait(empty.index(s), ((u // NS) & 1) ^ 1)
            slot = kv_smem.index(s)
            for c in gl.static_range(W // CH):
                dcol = h * W + c * CH + gl.arange(0, CH, layout=gl.SliceLayout(0, layout))
                if PARTS & 1:
                    async_copy.async_copy_global_to_shared(slot.slice(c * CH, CH, dim=1),
                                                           kv_ptr + rows[:, None] * stride_kv + dcol[None, :],
                                                           mask=valid[:, None])
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _row_ptrs(ptr, stride_n, stride_h, pid_n, h0, d0, BH: gl.constexpr, W: gl.constexpr):
    """Pointers to x[pid_n, h0 ..+BH, d0 ..+W] of a [n, H, D] tensor, laid out as rows (a warp per row, 8 contiguous
    elements per thread)."""
    rowl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    hq = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, rowl))
    dq = d0 + gl.arange(0, W, layout=gl.SliceLayout(0, rowl))
    return ptr + pid_n * stride_n + hq[:, None] * stride_h + dq[None, :]


@gluon.jit
def _load_q(q_ptr, stride_qn, stride_qh, pid_n, h0, d0, q_smem, BH: gl.constexpr, W: gl.constexpr):
    """q_smem [BH, W] = q[pid_n, h0 ..+BH, d0 ..+W], visible to wgmma."""
    q_smem.store(gl.load(_row_ptrs(q_ptr, stride_qn, stride_qh, pid_n, h0, d0, BH, W)))
    fence_async_shared()


@gluon.jit
def _store_rows(o_ptr, stride_on, stride_oh, pid_n, h0, d0, o_smem, BH: gl.constexpr, W: gl.constexpr):
    """o[pid_n, h0 ..+BH, d0 ..+W] = o_smem [BH, W] as coalesced rows (after the writers' barrier)."""
    ptrs = _row_ptrs(o_ptr, stride_on, stride_oh, pid_n, h0, d0, BH, W)
    gl.store(ptrs, o_smem.load(ptrs.type.layout))


@gluon.jit
def _divide_by_sums(acc, l_i, AXIS: gl.constexpr):
    """``acc / l_i`` (l_i expanded at AXIS) with the bits of ``div.full.f32``, which ``/`` gives (as in the Triton
    kernel). For a divisor in fp32's normal range that is x * rcp.approx(y), so when every l_i is in
    [2^-126, 2^126] (the usual case: l >= 1 once an entry is valid) it is one multiply per element by 1 / l_i
    instead of four instructions (the range fix-ups); otherwise (no valid entry: inf; a sink ~ e^87 above the
    max) the plain division."""
    if (gl.max(l_i, axis=0) <= 2.0**126) & (gl.min(l_i, axis=0) >= 2.0**-126):
        out = acc * gl.expand_dims(1.0 / l_i, AXIS)
    else:
        out = acc / gl.expand_dims(l_i, AXIS)
    return out


@gluon.jit
def _column_max(s_t, red, b):
    """max over the rows of S^T [BN rows, BH heads] (mma layout, 16 rows per warp, BH = 32): each warp's partial
    maxima go to ``red[b]`` ([4 warps, BH] fp32), one barrier, and every thread combines the four of its heads.
    Order-free, so the bits equal ``gl.max(s_t, axis=0)``, which takes two barriers and a shuffle round trip."""
    rows_per_warp: gl.constexpr = s_t.shape[0] // 4
    red.index(b).store(gl.max(gl.reshape(s_t, [4, rows_per_warp, s_t.shape[1]]), axis=1))
    gl.thread_barrier()
    # a thread's heads as in the wgmma accumulator: 2 (lane % 4) + {0, 1} + 8 i
    per_head: gl.constexpr = gl.BlockedLayout([4, 2], [8, 4], [4, 1], [1, 0])
    m_blk = gl.max(red.index(b).load(per_head), axis=0)
    return gl.convert_layout(m_blk, gl.SliceLayout(0, s_t.type.layout))


@gluon.jit
def _softmax_to_smem(s_t, ids, m_i, l_part, scale, p_smem, red, b):
    """One block of the online softmax on S^T [rows, heads]; P^T goes to ``p_smem`` as bf16. Returns the rescale
    of the old sums, the new running max and the per-(row, head) running sums of P. ``red`` is the scratch of
    :func:`_column_max` (b alternates between blocks, so no warp overwrites a partial another still reads)."""
    s_t = gl.where((ids >= 0)[:, None], s_t * scale, float("-inf"))
    m_new = gl.maximum(m_i, _column_max(s_t, red, b))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid logit yet: keep exp() finite
    alpha = gl.exp(m_i - m_use)
    p = gl.exp(s_t - m_use[None, :])
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    return alpha, m_new, l_part * alpha[None, :] + p


@gluon.jit
def _one_consumer(q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk,
                  n_blocks, scale, kv_smem, q_smem, p_smem, red, ready, empty,
                  D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, PARTS: gl.constexpr):
    """The one-consumer layout's math for heads h0 ..+BH of one token: block j in slots 2j, 2j+1 (mod NS),
    O^T [D/2, BH] twice; writes o [BH, D] bf16."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    W: gl.constexpr = D // 2
    sink = gl.load(sink_ptr + h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, mma)))
    _load_q(q_ptr, stride_qn, stride_qh, pid_n, h0, 0, q_smem, BH, D)
    q_t0 = q_smem.slice(0, W, dim=1).permute((1, 0))  # [D/2, BH]
    q_t1 = q_smem.slice(W, W, dim=1).permute((1, 0))
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_part = gl.zeros([BN, BH], gl.float32, layout=mma)
    zero_s = gl.zeros([BN, BH], gl.float32, layout=mma)
    acc0 = gl.zeros([W, BH], gl.float32, layout=mma)  # O^T[:D/2]
    acc1 = gl.zeros([W, BH], gl.float32, layout=mma)  # O^T[D/2:]
    for j in range(n_blocks):
        ids = _block_ids(idx_row_ptr, j, topk, BN, gl.SliceLayout(1, mma))
        s0 = (2 * j) % NS
        s1 = (2 * j + 1) % NS
        mbarrier.wait(ready.index(s0), ((2 * j) // NS) & 1)
        fence_async_shared()  # cp.async wrote the slot through the generic proxy; wgmma reads it async
        k0 = kv_smem.index(s0)
        if PARTS & 2:
            s_t = warpgroup_mma(k0, q_t0, zero_s, use_acc=False, is_async=True)
        mbarrier.wait(ready.index(s1), ((2 * j + 1) // NS) & 1)
        fence_async_shared()
        k1 = kv_smem.index(s1)
        if PARTS & 2:
            s_t = warpgroup_mma(k1, q_t1, s_t, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            alpha, m_i, l_part = _softmax_to_smem(s_t, ids, m_i, l_part, scale, p_smem, red, j % 2)
            acc0 = warpgroup_mma(k0.permute((1, 0)), p_smem, acc0 * alpha[None, :], is_async=True)
            acc1 = warpgroup_mma(k1.permute((1, 0)), p_smem, acc1 * alpha[None, :], is_async=True)
            acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0,))
        mbarrier.arrive(empty.index(s0), count=1)
        if PARTS & 2:
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
        mbarrier.arrive(empty.index(s1), count=1)
    l_i = gl.sum(l_part, axis=0) + gl.exp(sink - m_i)
    o_t = q_smem.permute((1, 0))  # O^T leaves through Q's buffer (Q is read by now) to be stored as rows
    o_t.slice(0, W, dim=0).store(_divide_by_sums(acc0, l_i, 0).to(gl.bfloat16))
    o_t.slice(W, W, dim=0).store(_divide_by_sums(acc1, l_i, 0).to(gl.bfloat16))
    gl.thread_barrier()
    _store_rows(o_ptr, stride_on, stride_oh, pid_n, h0, 0, q_smem, BH, D)


@gluon.jit
def _one_consumer_buffers(NS: gl.constexpr, BN: gl.constexpr, BH: gl.constexpr, D: gl.constexpr):
    """The one-consumer layout's shared buffers: NS bf16 half-row KV slots [BN, D/2], Q [BH, D], P^T [BN, BH] and the
    column-maximum exchange [2, 4, BH]."""
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D // 2],
                                        gl.NVMMASharedLayout.get_default_for([BN, D // 2], gl.bfloat16))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], gl.NVMMASharedLayout.get_default_for([BH, D], gl.bfloat16))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH],
                                       gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16))
    red = gl.allocate_shared_memory(gl.float32, [2, 4, BH], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return kv_smem, q_smem, p_smem, red


@gluon.jit
def _slot_barriers(NS: gl.constexpr, READY: gl.constexpr):
    """The KV ring's mbarriers, initialized: ``ready`` (READY arrivals fill a slot), ``empty`` (one release)."""
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _one_consumer_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                         stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                         D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr,
                         PW: gl.constexpr, PREGS: gl.constexpr, PARTS: gl.constexpr):
    pid_n = gl.program_id(1).to(gl.int64)  # the head groups of a token are neighbouring CTAs (shared rows in L2)
    h0 = gl.program_id(0) * BH
    kv_smem, q_smem, p_smem, red = _one_consumer_buffers(NS, BN, BH, D)
    ready, empty = _slot_barriers(NS, PW * 32)  # ready: every producer thread's cp.async arrival
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_one_consumer, (q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0,
                         topk, n_blocks, scale, kv_smem, q_smem, p_smem, red, ready, empty, D, BH, BN, NS, PARTS)),
        (_producer, (kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty, D, BN, NS, CH, PW,
                     PARTS)),
    ], [PW], [PREGS])


@gluon.jit
def _lead(q_ptr, stride_qn, stride_qh, o_ptr, stride_on, stride_oh, pid_n, h0, n_blocks, kv_smem, q_h, p_buf, a_buf,
          l_buf, empty, q_ready, p_ready, p_free, l_ready,
          BH: gl.constexpr, W: gl.constexpr, NS: gl.constexpr, PARTS: gl.constexpr):
    """Two-consumer layout, lead warpgroup: loads Q, then ``O[:, :W] = O[:, :W] * alpha + P V[:, :W]`` for each
    block once the tail has made its P (slot 2j, released here); writes o[..., :W]."""
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W, 16])
    _load_q(q_ptr, stride_qn, stride_qh, pid_n, h0, 0, q_h.index(0), BH, W)
    _load_q(q_ptr, stride_qn, stride_qh, pid_n, h0, W, q_h.index(1), BH, W)
    mbarrier.arrive(q_ready.index(0), count=1)
    acc = gl.zeros([BH, W], gl.float32, layout=mma_o)
    for j in range(n_blocks):
        b = j % 2
        s = (2 * j) % NS
        mbarrier.wait(p_ready.index(b), (j // 2) & 1)  # the tail has waited for the slot and written P
        fence_async_shared()
        if PARTS & 2:
            alpha = a_buf.index(b).load(gl.SliceLayout(1, mma_o))
            acc = warpgroup_mma(p_buf.index(b), kv_smem.index(s), acc * alpha[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p_free.index(b), count=1)
        mbarrier.arrive(empty.index(s), count=1)
    mbarrier.wait(l_ready.index(0), 0)
    l_i = l_buf.load(gl.SliceLayout(1, mma_o))
    q_h.index(0).store(_divide_by_sums(acc, l_i, 1).to(gl.bfloat16))  # Q's first half is read by now
    gl.thread_barrier()
    _store_rows(o_ptr, stride_on, stride_oh, pid_n, h0, 0, q_h.index(0), BH, W)


@gluon.jit
def _tail(idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk, n_blocks, scale, kv_smem, q_h, p_buf,
          a_buf, l_buf, ready, empty, q_ready, p_ready, p_free, l_ready,
          BH: gl.constexpr, BN: gl.constexpr, W: gl.constexpr, NS: gl.constexpr, PARTS: gl.constexpr):
    """Two-consumer layout, tail warpgroup: ``S [BH, BN] = Q K^T`` over both slots of block j, the online softmax
    (P and alpha to the lead through a double buffer), ``O[:, W:] = O[:, W:] * alpha + P V[:, W:]`` (slot 2j + 1,
    released here); the final sums go to the lead; writes o[..., W:]."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W, 16])
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, mma_s))
    zero_s = gl.zeros([BH, BN], gl.float32, layout=mma_s)
    acc = gl.zeros([BH, W], gl.float32, layout=mma_o)
    mbarrier.wait(q_ready.index(0), 0)
    for j in range(n_blocks):
        b = j % 2
        s0 = (2 * j) % NS
        s1 = (2 * j + 1) % NS
        mbarrier.wait(ready.index(s0), ((2 * j) // NS) & 1)
        fence_async_shared()
        if PARTS & 2:
            s_t = warpgroup_mma(q_h.index(0), kv_smem.index(s0).permute((1, 0)), zero_s, use_acc=False,
                                is_async=True)
        mbarrier.wait(ready.index(s1), ((2 * j + 1) // NS) & 1)
        fence_async_shared()
        mbarrier.wait(p_free.index(b), ((j // 2) & 1) ^ 1)  # the lead is done with block j - 2's P
        if PARTS & 2:
            s_t = warpgroup_mma(q_h.index(1), kv_smem.index(s1).permute((1, 0)), s_t, is_async=True)
            # the indices after the fences (fence_async_shared compiles to a memory barrier that waits for loads in
            # flight): faster at H200 Pro decode b64; slower in the one-consumer loop
            ids = _block_ids(idx_row_ptr, j, topk, BN, gl.SliceLayout(0, mma_s))
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            s_t = gl.where((ids >= 0)[None, :], s_t * scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s_t, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid logit yet: keep exp() finite
            alpha = gl.exp(m_i - m_use)
            p = gl.exp(s_t - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_buf.index(b).store(p.to(gl.bfloat16))
            a_buf.index(b).store(alpha)
            fence_async_shared()
        mbarrier.arrive(p_ready.index(b), count=1)
        if PARTS & 2:
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))
            acc = warpgroup_mma(p_buf.index(b), kv_smem.index(s1), acc * alpha_o[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s1), count=1)
    sink = gl.load(sink_ptr + h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, mma_s)))  # after the loop: registers
    l_i = l_i + gl.exp(sink - m_i)
    l_buf.store(l_i)
    mbarrier.arrive(l_ready.index(0), count=1)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))
    q_h.index(1).store(_divide_by_sums(acc, l_o, 1).to(gl.bfloat16))  # Q's second half is read by now
    gl.thread_barrier()
    _store_rows(o_ptr, stride_on, stride_oh, pid_n, h0, W, q_h.index(1), BH, W)


@gluon.jit
def _two_consumer_exchange(BH: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
    """The two-consumer layout's shared buffers between its warpgroups, mbarriers initialized: Q as two halves,
    P and alpha double-buffered, the final sums; ``p_ready`` / ``p_free`` (P of block j), ``q_ready``, ``l_ready``."""
    q_h = gl.allocate_shared_memory(gl.bfloat16, [2, BH, W], gl.NVMMASharedLayout.get_default_for([BH, W], gl.bfloat16))
    p_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN],
                                      gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16))
    a_buf = gl.allocate_shared_memory(gl.float32, [2, BH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    l_buf = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    mbarrier.init(q_ready.index(0), count=1)
    mbarrier.init(l_ready.index(0), count=1)
    return q_h, p_buf, a_buf, l_buf, p_ready, p_free, q_ready, l_ready


@gluon.jit
def _two_consumer_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                         stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                         D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr,
                         PW: gl.constexpr, PREGS: gl.constexpr, CREGS: gl.constexpr, PARTS: gl.constexpr):
    W: gl.constexpr = D // 2
    pid_n = gl.program_id(1).to(gl.int64)  # the head groups of a token are neighbouring CTAs (shared rows in L2)
    h0 = gl.program_id(0) * BH
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, W],
                                        gl.NVMMASharedLayout.get_default_for([BN, W], gl.bfloat16))
    q_h, p_buf, a_buf, l_buf, p_ready, p_free, q_ready, l_ready = _two_consumer_exchange(BH, BN, W)
    # ready: every producer thread's cp.async arrival; empty: slot 2j is released by the lead, 2j + 1 by the tail
    ready, empty = _slot_barriers(NS, PW * 32)
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_tail, (idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk, n_blocks, scale, kv_smem, q_h,
                 p_buf, a_buf, l_buf, ready, empty, q_ready, p_ready, p_free, l_ready, BH, BN, W, NS, PARTS)),
        (_lead, (q_ptr, stride_qn, stride_qh, o_ptr, stride_on, stride_oh, pid_n, h0, n_blocks, kv_smem, q_h, p_buf,
                 a_buf, l_buf, empty, q_ready, p_ready, p_free, l_ready, BH, W, NS, PARTS)),
        (_producer, (kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty, D, BN, NS, CH, PW,
                     PARTS)),
    ], [4, PW], [CREGS, PREGS])


def takes(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> str | None:
    """Why this kernel cannot take these inputs (None: it can): bf16 q [n, H, 512] with H a multiple of 32,
    bf16 kv [m, 512], 2-D idx, on a CUDA device of compute capability 9.0 (wgmma), under Triton 3.6."""
    if not (q.is_cuda and q.dim() == 3 and kv.dim() == 2 and idx.dim() == 2):
        return "needs CUDA tensors q [n, H, d], kv [m, d], idx [n, K]"
    refusal = hopper_gluon_refusal(q.device)
    if refusal:
        return refusal
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"needs bf16 q and kv, found {q.dtype} and {kv.dtype}"
    if q.shape[-1] != HEAD_DIM or kv.shape[1] != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, found q {q.shape[-1]}, kv {kv.shape[1]}"
    if q.shape[1] % BLOCK_H:
        return f"needs a head count that is a multiple of {BLOCK_H}, found {q.shape[1]}"
    return None


def consumers_for(n: int, heads: int, sms: int) -> int:
    """1 or 2 consumer warpgroups per CTA (32 or 64 heads): the layout with fewer (waves of CTAs x time of one
    CTA)."""
    if heads % _LAYOUT[2][0]:
        return 1
    cost = {c: math.ceil(n * heads // _LAYOUT[c][0] / sms) * _PER_CTA_COST[c] for c in (1, 2)}
    return 2 if cost[2] < cost[1] else 1


def consumer_layout(kernel: str, consumers: int | None, n: int, heads: int, device: torch.device) -> int:
    """``consumers`` (1 or 2), or :func:`consumers_for` the device's SM count; a ValueError naming ``kernel`` when
    the heads do not fill that layout's CTAs (32 or 64 heads each)."""
    nc = consumers or consumers_for(n, heads, torch.cuda.get_device_properties(device).multi_processor_count)
    if nc not in _LAYOUT or heads % _LAYOUT[nc][0]:
        raise ValueError(f"{kernel}: consumers must be 1 or 2, with heads a multiple of {BLOCK_H} x consumers; "
                         f"found consumers={nc}, heads={heads}")
    return nc


def sparse_attention_ws(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                        *, consumers: int | None = None, parts: int = GATHER | MATH) -> torch.Tensor:
    """q [n, H, 512] bf16, kv [m, 512] bf16, idx [n, K] int (-1 = masked), sink [H] fp32 -> o [n, H, 512] bf16
    (inputs as checked by :func:`takes`). ``consumers`` (1: 32 heads per CTA, 2: 64) defaults to
    :func:`consumers_for`; ``parts`` other than both is for the diagnosis only (wrong results)."""
    n, h, d = q.shape
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    nc = consumer_layout("sparse_attention_ws", consumers, n, h, q.device)
    bh, slots, pregs, cregs = _LAYOUT[nc]
    q, kv = q.contiguous(), kv.contiguous()
    idx, sink = idx.to(torch.int32).contiguous(), sink.to(torch.float32).contiguous()
    args = (q, kv, idx, sink, o, idx.shape[1], float(scale), q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
            o.stride(0), o.stride(1))
    common = dict(D=d, BH=bh, BN=BLOCK_N, NS=slots, CH=CHUNK, PW=PRODUCER_WARPS, PREGS=pregs, PARTS=parts,
                  num_warps=4)
    if nc == 1:
        _one_consumer_kernel[(h // bh, n)](*args, **common)
    else:
        _two_consumer_kernel[(h // bh, n)](*args, CREGS=cregs, **common)
    return o
