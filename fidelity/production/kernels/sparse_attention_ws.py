"""Warp-specialized sparse FMHA for Hopper (Gluon, sm_90a): the default route of ``sparse_attention`` for bf16
attention at d = 512 on an H100 / H200, decode and prefill (one CTA per query token and 32 heads).

Same semantics and the same reference order as the Triton kernel (``kernels/sparse_attention.py``, spec §3
``sparse_attn``): online softmax over consecutive blocks of 64 indices, ``s = (q . k) * scale`` with fp32
accumulation, fp32 running max and sum, ``P = exp(s - m)`` rounded to bf16 against the running max before
``P . V``, a -1 index loads no row (zero row, logit -inf), ``sum += exp(sink - m)`` after the loop.

One CTA per (token, 32 heads), two partitions that overlap the row gathers with the math:

* producer (4 warps, few registers): loads each block's 64 indices and gathers the rows with ``cp.async``
  (16 B per copy, zero-fill for -1) into a 2-stage ring of [64, 512] bf16 tiles in shared memory; the copies
  arrive on the stage's ``ready`` mbarrier when they land;
* consumer (one warpgroup): the rows are the MMA's M, so 32 heads need no padding to wgmma's M = 64:
  ``S^T [64 rows, 32 heads] = K Q^T`` (wgmma, K tile and Q^T from shared memory), the column softmax, ``P^T``
  to shared memory as bf16, ``O^T [512, 32] += V^T P^T`` (the tile again, read transposed); then it releases
  the stage on its ``empty`` mbarrier.

Shared memory: 2 x 64 KB tiles + 32 KB Q + 4 KB P (a third stage would need 1 KB more than the 227 KB a CTA may
have). The sum of P is kept per (row, head) and reduced over rows once at the end (fp32; the order of that sum
differs from the Triton kernel's per-block sums, within the same contract).
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

BLOCK_N = 64  # indices per online-softmax step (the reference's block)
BLOCK_H = 32  # heads per CTA
HEAD_DIM = 512
STAGES = 2
PRODUCER_WARPS = 4
PRODUCER_REGS = 56
CHUNK = 64  # columns per cp.async batch: [64 rows, 64 cols] = 16 B x 512 copies
GLUON_VERSION = "3.6."  # warp_specialize's signature changed after 3.6
GATHER, MATH = 1, 2  # PARTS bits: which halves run (both by default; benchmarks/diag_fmha.py switches one off)


@gluon.jit
def _producer(kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty,
              D: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr, PW: gl.constexpr,
              PARTS: gl.constexpr):
    """Gathers block j's rows into stage j % NS once the consumer has released it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CH // 8), CH // 8], [PW, 1], [1, 0])
    for j in range(n_blocks):
        s = j % NS
        cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        ids = gl.load(idx_row_ptr + cols, mask=cols < topk, other=-1)
        valid = ids >= 0
        rows = gl.where(valid, ids, 0).to(gl.int64)
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)
        tile = kv_smem.index(s)
        for c in gl.static_range(D // CH):
            dcol = c * CH + gl.arange(0, CH, layout=gl.SliceLayout(0, layout))
            if PARTS & 1:
                async_copy.async_copy_global_to_shared(tile.slice(c * CH, CH, dim=1),
                                                       kv_ptr + rows[:, None] * stride_kv + dcol[None, :],
                                                       mask=valid[:, None])
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _softmax_step(s_t, ids, m_i, l_part, scale):
    """One block of the online softmax on S^T [rows, heads]: returns P^T, the rescale of the old sums, the new
    running max and the per-(row, head) running sums of P."""
    s_t = gl.where((ids >= 0)[:, None], s_t * scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, axis=0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid logit yet: keep exp() finite
    alpha = gl.exp(m_i - m_use)
    p = gl.exp(s_t - m_use[None, :])
    return p, alpha, m_new, l_part * alpha[None, :] + p


@gluon.jit
def _consumer(idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk, n_blocks, scale,
              kv_smem, q_smem, p_smem, ready, empty,
              D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, PARTS: gl.constexpr):
    """The MMAs and the softmax of one (token, BH heads); writes o [BH, D] bf16."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_part = gl.zeros([BN, BH], gl.float32, layout=mma)
    acc = gl.zeros([D, BH], gl.float32, layout=mma)  # O^T
    zero_s = gl.zeros([BN, BH], gl.float32, layout=mma)
    q_t = q_smem.permute((1, 0))  # [D, BH]
    for j in range(n_blocks):
        s = j % NS
        cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        ids = gl.load(idx_row_ptr + cols, mask=cols < topk, other=-1)
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        fence_async_shared()  # cp.async wrote the tile through the generic proxy; wgmma reads it async
        tile = kv_smem.index(s)
        if PARTS & 2:
            s_t = warpgroup_mma(tile, q_t, zero_s, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            p, alpha, m_i, l_part = _softmax_step(s_t, ids, m_i, l_part, scale)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    heads = h0 + gl.arange(0, BH, layout=gl.SliceLayout(0, mma))
    l_i = gl.sum(l_part, axis=0) + gl.exp(gl.load(sink_ptr + heads) - m_i)
    dv = gl.arange(0, D, layout=gl.SliceLayout(1, mma))
    gl.store(o_ptr + pid_n * stride_on + heads[None, :] * stride_oh + dv[:, None], (acc / l_i[None, :]).to(gl.bfloat16))


@gluon.jit
def _attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, scale,
                   stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                   D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, CH: gl.constexpr,
                   PW: gl.constexpr, PREGS: gl.constexpr, PARTS: gl.constexpr):
    pid_n = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BH
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D],
                                        gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], gl.NVMMASharedLayout.get_default_for([BH, D], gl.bfloat16))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH],
                                       gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=PW * 32)  # every producer thread's cp.async arrival
        mbarrier.init(empty.index(i), count=1)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    hq = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ql))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    q_smem.store(gl.load(q_ptr + pid_n * stride_qn + hq[:, None] * stride_qh + dq[None, :]))
    fence_async_shared()
    n_blocks = gl.cdiv(topk, BN)
    idx_row_ptr = idx_ptr + pid_n * stride_in
    gl.warp_specialize([
        (_consumer, (idx_row_ptr, sink_ptr, o_ptr, stride_on, stride_oh, pid_n, h0, topk, n_blocks, scale,
                     kv_smem, q_smem, p_smem, ready, empty, D, BH, BN, NS, PARTS)),
        (_producer, (kv_ptr, idx_row_ptr, stride_kv, topk, n_blocks, kv_smem, ready, empty, D, BN, NS, CH, PW,
                     PARTS)),
    ], [PW], [PREGS])


def takes(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> str | None:
    """Why this kernel cannot take these inputs (None: it can): bf16 q [n, H, 512] with H a multiple of 32,
    bf16 kv [m, 512], 2-D idx, on a CUDA device of compute capability 9.0 (wgmma), under Triton 3.6."""
    if not triton.__version__.startswith(GLUON_VERSION):
        return f"written for the Gluon API of Triton {GLUON_VERSION}, found Triton {triton.__version__}"
    if not (q.is_cuda and q.dim() == 3 and kv.dim() == 2 and idx.dim() == 2):
        return "needs CUDA tensors q [n, H, d], kv [m, d], idx [n, K]"
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


def sparse_attention_ws(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                        *, parts: int = GATHER | MATH) -> torch.Tensor:
    """q [n, H, 512] bf16, kv [m, 512] bf16, idx [n, K] int (-1 = masked), sink [H] fp32 -> o [n, H, 512] bf16
    (inputs as checked by :func:`takes`). ``parts`` other than both is for the diagnosis only (wrong results)."""
    n, h, d = q.shape
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return o
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    sink = sink.to(torch.float32).contiguous()
    _attention_kernel[(n, h // BLOCK_H)](
        q, kv, idx, sink, o, idx.shape[1], float(scale), q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
        o.stride(0), o.stride(1), D=d, BH=BLOCK_H, BN=BLOCK_N, NS=STAGES, CH=CHUNK, PW=PRODUCER_WARPS,
        PREGS=PRODUCER_REGS, PARTS=parts, num_warps=4)
    return o
