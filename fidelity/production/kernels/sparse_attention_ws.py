"""Warp-specialized sparse FMHA for Hopper (Gluon, sm_90a): the default route of ``sparse_attention`` for bf16
attention at d = 512 on an H100 / H200, decode and prefill.

Same semantics and the same reference order as the Triton kernel (``kernels/sparse_attention.py``, spec §3
``sparse_attn``): online softmax over consecutive blocks of 64 indices, ``s = (q . k) * scale`` with fp32
accumulation, fp32 running max and sum, ``P = exp(s - m)`` rounded to bf16 against the running max before
``P . V``, a -1 index loads no row (zero row, logit -inf), ``sum += exp(sink - m)`` after the loop.

One CTA per (query token, 32 or 64 heads), in warp-specialized partitions that overlap the row gathers with the
math:

* producer (4 warps, few registers): loads each block's 64 indices and gathers the rows with ``cp.async``
  (16 B per copy, zero-fill for -1) into a ring of slots in shared memory; a slot holds the block's rows whole
  ([64, 512]) or one column half ([64, 256]), and its copies arrive on the slot's ``ready`` mbarrier when they
  land;
* one or two consumers (a warpgroup each, 32 heads each): the rows are the MMA's M, so 32 heads need no padding
  to wgmma's M = 64: ``S^T [64 rows, 32 heads] = K Q^T`` (wgmma, from shared memory), the column softmax, ``P^T``
  to shared memory as bf16, ``O^T [512, 32] += V^T P^T`` (the slots again, read transposed); a slot is released
  on its ``empty`` mbarrier once its ``P . V`` is done (each consumer arrives once).

Layouts (``_LAYOUT``):

* one consumer: five half-tile slots (2.5 blocks in flight; 196 KB of shared memory with Q and P). The first
  half's ``Q . K`` starts while the second half may still land, and the first half's slot is released while the
  second half's ``P . V`` runs;
* two consumers (64 heads per CTA): two whole-tile slots (200 KB). Each row is gathered once for 64 heads: half
  the gathers and half the CTAs, but a CTA takes about 1.45x as long (two warpgroups share its tensor cores), so
  they pay off once the one-consumer grid needs more than one wave of CTAs (:func:`consumers_for`).

The head groups of a token are neighbouring CTAs, so their shared rows meet in L2. The sum of P is kept per
(row, head) and reduced over rows once at the end (fp32; the order of that sum differs from the Triton kernel's
per-block sums, within the same contract). O leaves through Q's shared-memory buffer as coalesced rows.
"""

from __future__ import annotations

import math

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

BLOCK_N = 64  # indices per online-softmax step (the reference's block)
BLOCK_H = 32  # heads per consumer warpgroup
HEAD_DIM = 512
PRODUCER_WARPS = 4
CHUNK = 64  # columns per cp.async batch: [64 rows, 64 cols] = 16 B x 512 copies
GLUON_VERSION = "3.6."  # warp_specialize's signature changed after 3.6
GATHER, MATH = 1, 2  # PARTS bits: which halves run (both by default; benchmarks/diag_fmha_ws.py switches one off)
# consumers -> (column parts per slot, ring slots, producer registers, second consumer's registers)
_LAYOUT = {1: (2, 5, 56, 0), 2: (1, 2, 56, 224)}
_PER_CTA_COST = {1: 1.0, 2: 1.45}  # time of one CTA, one consumer = 1 (Flash decode b64 on the H200: 35.5 / 24.3 us)


@gluon.jit
def _block_ids(idx_row_ptr, j, topk, BN: gl.constexpr, layout: gl.constexpr):
    """Block j's BN indices (-1 past the end of the row)."""
    cols = j * BN + gl.arange(0, BN, layout=layout)
    return gl.load(idx_row_ptr + cols, mask=cols < topk, other=-1)


@gluon.jit
def _producer(kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty,
              D: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr,
              PW: gl.constexpr, PARTS: gl.constexpr):
    """Gathers block j's rows into slots SPLIT*j .. SPLIT*j + SPLIT-1 (mod NS), each once it is released."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CH // 8), CH // 8], [PW, 1], [1, 0])
    W: gl.constexpr = D // SPLIT
    for j in range(n_blocks):
        ids = _block_ids(idx_row_ptr, j, topk, BN, gl.SliceLayout(1, layout))
        valid = ids >= 0
        rows = gl.where(valid, ids, 0).to(gl.int64)
        for h in gl.static_range(SPLIT):
            u = SPLIT * j + h
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
def _softmax_to_smem(s_t, ids, m_i, l_part, scale, p_smem):
    """One block of the online softmax on S^T [rows, heads]; P^T goes to ``p_smem`` as bf16. Returns the rescale
    of the old sums, the new running max and the per-(row, head) running sums of P."""
    s_t = gl.where((ids >= 0)[:, None], s_t * scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, axis=0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid logit yet: keep exp() finite
    alpha = gl.exp(m_i - m_use)
    p = gl.exp(s_t - m_use[None, :])
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    return alpha, m_new, l_part * alpha[None, :] + p


@gluon.jit
def _blocks_whole(idx_row_ptr, topk, n_blocks, scale, kv_smem, q_smem, p_smem, ready, empty, m_i, l_part,
                  acc, zero_s, mma: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, PARTS: gl.constexpr):
    """The block loop over whole-tile slots: O^T [512, BH] in one accumulator."""
    q_t = q_smem.permute((1, 0))  # [D, BH]
    for j in range(n_blocks):
        ids = _block_ids(idx_row_ptr, j, topk, BN, gl.SliceLayout(1, mma))
        s = j % NS
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        fence_async_shared()  # cp.async wrote the slot through the generic proxy; wgmma reads it async
        tile = kv_smem.index(s)
        if PARTS & 2:
            s_t = warpgroup_mma(tile, q_t, zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            alpha, m_i, l_part = _softmax_to_smem(s_t, ids, m_i, l_part, scale, p_smem)
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    return acc, m_i, l_part


@gluon.jit
def _blocks_halves(idx_row_ptr, topk, n_blocks, scale, kv_smem, q_smem, p_smem, ready, empty, m_i, l_part,
                   acc0, acc1, zero_s, mma: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, PARTS: gl.constexpr):
    """The block loop over half-tile slots (block j in slots 2j, 2j+1 mod NS): O^T [256, BH] twice. The first
    half's Q.K runs while the second half may still land, and the first half's slot is released while the second
    half's P.V runs."""
    W: gl.constexpr = q_smem.shape[1] // 2
    q_t0 = q_smem.slice(0, W, dim=1).permute((1, 0))  # [D/2, BH]
    q_t1 = q_smem.slice(W, W, dim=1).permute((1, 0))
    for j in range(n_blocks):
        ids = _block_ids(idx_row_ptr, j, topk, BN, gl.SliceLayout(1, mma))
        s0 = (2 * j) % NS
        s1 = (2 * j + 1) % NS
        mbarrier.wait(ready.index(s0), ((2 * j) // NS) & 1)
        fence_async_shared()
        k0 = kv_smem.index(s0)
        if PARTS & 2:
            s_t = warpgroup_mma(k0, q_t0, zero_s, use_acc=False, is_async=True)
        mbarrier.wait(ready.index(s1), ((2 * j + 1) // NS) & 1)
        fence_async_shared()
        k1 = kv_smem.index(s1)
        if PARTS & 2:
            s_t = warpgroup_mma(k1, q_t1, s_t, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            alpha, m_i, l_part = _softmax_to_smem(s_t, ids, m_i, l_part, scale, p_smem)
            acc0 = warpgroup_mma(k0.permute((1, 0)), p_smem, acc0 * alpha[None, :], is_async=True)
            acc1 = warpgroup_mma(k1.permute((1, 0)), p_smem, acc1 * alpha[None, :], is_async=True)
            acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0,))
        mbarrier.arrive(empty.index(s0), count=1)
        if PARTS & 2:
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
        mbarrier.arrive(empty.index(s1), count=1)
    return acc0, acc1, m_i, l_part


@gluon.jit
def _consumer(q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk,
              n_blocks, scale, kv_smem, q_all, p_all, ready, empty,
              D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, NS: gl.constexpr,
              PARTS: gl.constexpr, C: gl.constexpr):
    """Consumer C: the MMAs and the softmax of heads h0 + C*BH ..+BH of one token; writes o [BH, D] bf16."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    rowl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [BH, D] rows of Q and O
    W: gl.constexpr = D // 2
    q_smem = q_all.index(C)
    p_smem = p_all.index(C)
    hc = h0 + C * BH
    heads = hc + gl.arange(0, BH, layout=gl.SliceLayout(0, mma))
    sink = gl.load(sink_ptr + heads)
    hq = hc + gl.arange(0, BH, layout=gl.SliceLayout(1, rowl))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, rowl))
    q_smem.store(gl.load(q_ptr + pid_n * stride_qn + hq[:, None] * stride_qh + dq[None, :]))
    fence_async_shared()
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_part = gl.zeros([BN, BH], gl.float32, layout=mma)
    zero_s = gl.zeros([BN, BH], gl.float32, layout=mma)
    o_t = q_smem.permute((1, 0))  # O^T leaves through Q's buffer (Q is read by then) to be stored as rows
    if SPLIT == 1:
        acc = gl.zeros([D, BH], gl.float32, layout=mma)
        acc, m_i, l_part = _blocks_whole(idx_row_ptr, topk, n_blocks, scale, kv_smem, q_smem, p_smem, ready, empty,
                                         m_i, l_part, acc, zero_s, mma, BN, NS, PARTS)
        l_i = gl.sum(l_part, axis=0) + gl.exp(sink - m_i)
        o_t.store((acc / l_i[None, :]).to(gl.bfloat16))
    else:
        acc0 = gl.zeros([W, BH], gl.float32, layout=mma)  # O^T[:D/2]
        acc1 = gl.zeros([W, BH], gl.float32, layout=mma)  # O^T[D/2:]
        acc0, acc1, m_i, l_part = _blocks_halves(idx_row_ptr, topk, n_blocks, scale, kv_smem, q_smem, p_smem,
                                                 ready, empty, m_i, l_part, acc0, acc1, zero_s, mma, BN, NS, PARTS)
        l_i = gl.sum(l_part, axis=0) + gl.exp(sink - m_i)
        o_t.slice(0, W, dim=0).store((acc0 / l_i[None, :]).to(gl.bfloat16))
        o_t.slice(W, W, dim=0).store((acc1 / l_i[None, :]).to(gl.bfloat16))
    gl.thread_barrier()
    gl.store(o_ptr + pid_n * stride_on + hq[:, None] * stride_oh + dq[None, :], q_smem.load(rowl))


@gluon.jit
def _attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                      stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                      D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NC: gl.constexpr,
                      SPLIT: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr, PW: gl.constexpr,
                      PREGS: gl.constexpr, CREGS: gl.constexpr, PARTS: gl.constexpr):
    pid_n = gl.program_id(1).to(gl.int64)  # the head groups of a token are neighbouring CTAs (shared rows in L2)
    h0 = gl.program_id(0) * (NC * BH)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D // SPLIT],
                                        gl.NVMMASharedLayout.get_default_for([BN, D // SPLIT], gl.bfloat16))
    q_all = gl.allocate_shared_memory(gl.bfloat16, [NC, BH, D],
                                      gl.NVMMASharedLayout.get_default_for([BH, D], gl.bfloat16))
    p_all = gl.allocate_shared_memory(gl.bfloat16, [NC, BN, BH],
                                      gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=PW * 32)  # every producer thread's cp.async arrival
        mbarrier.init(empty.index(i), count=NC)  # every consumer's release
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    if NC == 1:
        gl.warp_specialize([
            (_consumer, (q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0,
                         topk, n_blocks, scale, kv_smem, q_all, p_all, ready, empty, D, BH, BN, SPLIT, NS, PARTS, 0)),
            (_producer, (kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty, D, BN, SPLIT, NS,
                         CH, PW, PARTS)),
        ], [PW], [PREGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0,
                         topk, n_blocks, scale, kv_smem, q_all, p_all, ready, empty, D, BH, BN, SPLIT, NS, PARTS, 0)),
            (_consumer, (q_ptr, stride_qn, stride_qh, idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0,
                         topk, n_blocks, scale, kv_smem, q_all, p_all, ready, empty, D, BH, BN, SPLIT, NS, PARTS, 1)),
            (_producer, (kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty, D, BN, SPLIT, NS,
                         CH, PW, PARTS)),
        ], [4, PW], [CREGS, PREGS])


def takes(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> str | None:
    """Why this kernel cannot take these inputs (None: it can): bf16 q [n, H, 512] with H a multiple of 32,
    bf16 kv [m, 512], 2-D idx, on a CUDA device of compute capability 9.0 (wgmma), under Triton 3.6."""
    if not (q.is_cuda and q.dim() == 3 and kv.dim() == 2 and idx.dim() == 2):
        return "needs CUDA tensors q [n, H, d], kv [m, d], idx [n, K]"
    if not triton.__version__.startswith(GLUON_VERSION):
        return f"written for the Gluon API of Triton {GLUON_VERSION}, found Triton {triton.__version__}"
    cc = torch.cuda.get_device_capability(q.device)
    if cc != (9, 0):
        return f"needs an sm_90 device (wgmma), found compute capability {cc[0]}.{cc[1]}"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"needs bf16 q and kv, found {q.dtype} and {kv.dtype}"
    if q.shape[-1] != HEAD_DIM or kv.shape[1] != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, found q {q.shape[-1]}, kv {kv.shape[1]}"
    if q.shape[1] % BLOCK_H:
        return f"needs a head count that is a multiple of {BLOCK_H}, found {q.shape[1]}"
    return None


def consumers_for(n: int, heads: int, sms: int) -> int:
    """1 or 2 consumer warpgroups per CTA: the layout with fewer (waves of CTAs x time of one CTA)."""
    if heads % (2 * BLOCK_H):
        return 1
    cost = {c: math.ceil(n * heads // (c * BLOCK_H) / sms) * _PER_CTA_COST[c] for c in (1, 2)}
    return 2 if cost[2] < cost[1] else 1


def sparse_attention_ws(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                        *, consumers: int | None = None, parts: int = GATHER | MATH) -> torch.Tensor:
    """q [n, H, 512] bf16, kv [m, 512] bf16, idx [n, K] int (-1 = masked), sink [H] fp32 -> o [n, H, 512] bf16
    (inputs as checked by :func:`takes`). ``consumers`` (1 or 2 warpgroups, 32 heads each) defaults to
    :func:`consumers_for`; ``parts`` other than both is for the diagnosis only (wrong results)."""
    n, h, d = q.shape
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    nc = consumers or consumers_for(n, h, torch.cuda.get_device_properties(q.device).multi_processor_count)
    if nc not in _LAYOUT or h % (nc * BLOCK_H):
        raise ValueError(f"sparse_attention_ws: consumers must be 1 or 2, with heads a multiple of "
                         f"{BLOCK_H} x consumers; found consumers={nc}, heads={h}")
    split, slots, pregs, cregs = _LAYOUT[nc]
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    sink = sink.to(torch.float32).contiguous()
    _attention_kernel[(h // (nc * BLOCK_H), n)](
        q, kv, idx, sink, o, idx.shape[1], float(scale), q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
        o.stride(0), o.stride(1), D=d, BH=BLOCK_H, BN=BLOCK_N, NC=nc, SPLIT=split, NS=slots, CH=CHUNK,
        PW=PRODUCER_WARPS, PREGS=pregs, CREGS=cregs, PARTS=parts, num_warps=4)
    return o
