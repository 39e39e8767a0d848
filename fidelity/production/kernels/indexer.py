"""Lightning-indexer scoring (spec §4 Indexer) in Triton: ``score[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])``.

Numerics follow :func:`fidelity.production.ops.index_scores` with ``dtype=bf16`` (the official path is bf16
throughout): the q.k dot accumulates in fp32 and is rounded to bf16, ReLU, the product with the bf16 head
weight is rounded to bf16, the head sum accumulates in fp32 and is rounded once to bf16. Only the fp32
summation order differs from torch, so a result can differ from the emulation by a bf16 rounding flip.

Keys are bf16 [e, d], or packed FP4 (uint8 [e, d/2], low nibble = element 2i, plus ue8m0 scale bytes
[e, d/32]: the ``fp4_act_quant`` cache of spec §3), dequantized in registers per tile
(``e2m1 * 2^(b-127)`` is exact in bf16, so FP4 keys score bit-identically to their dequantized bf16 copy: same
tile values, same MMA; checked on the H200).

One program scores ``BLOCK_E`` keys for ``Q_PER_PROG`` queries: the key tile is loaded (and dequantized) once,
then one ``[BLOCK_E, d] x [d, H]`` MMA per query. Optional causal mask for compressed entries
(``positions``: entry j visible to the query at position t iff ``j < (t + 1) // ratio``, else -inf).
Top-k stays in torch (``torch.topk`` on the bf16 scores; tie order is implementation-defined in the
reference too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.production import ops
from fidelity.production.kernels._common import device_transparent, next_pow2, on_device


@triton.jit
def _e2m1(c):
    """FP4 e2m1 nibble codes (int32 0..15) -> fp32 values (sign bit 3, magnitudes 0 .5 1 1.5 2 3 4 6)."""
    m = c & 7
    e = m >> 1
    man = (m & 1).to(tl.float32)
    pw = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * man, pw * (1.0 + 0.5 * man))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit(do_not_specialize=["n_q", "n_heads", "ratio"])
def _index_scores_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, pos_ptr, out_ptr, n_q, n_keys, n_heads, ratio,
                         stride_qn, stride_qh, stride_k, stride_ks, stride_wn, stride_on,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, Q_PER_PROG: tl.constexpr,
                         FP4: tl.constexpr, CAUSAL: tl.constexpr):
    pid_e = tl.program_id(0)
    pid_q = tl.program_id(1)
    keys = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    kmask = keys < n_keys
    krow = keys.to(tl.int64)
    if FP4:
        j = tl.arange(0, D // 2)
        pk = tl.load(k_ptr + krow[:, None] * stride_k + j[None, :], mask=kmask[:, None], other=0).to(tl.int32)
        sc_i = tl.arange(0, D // 32)
        sb = tl.load(ks_ptr + krow[:, None] * stride_ks + sc_i[None, :], mask=kmask[:, None], other=127)
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(b-127), exact for b in 1..254
        vals = tl.reshape(tl.join(_e2m1(pk & 15), _e2m1(pk >> 4)), [BLOCK_E, D])  # element 2i = low nibble
        vals = tl.reshape(tl.reshape(vals, [BLOCK_E, D // 32, 32]) * scale[:, :, None], [BLOCK_E, D])
        k = vals.to(tl.bfloat16)
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
            s = tl.dot(k, tl.trans(q)).to(tl.bfloat16).to(tl.float32)  # [BLOCK_E, BLOCK_H], bf16 einsum
            s = tl.where(s < 0, 0.0, s)  # ReLU that keeps NaN (torch.relu does)
            w = tl.load(w_ptr + i64 * stride_wn + heads, mask=hmask, other=0.0).to(tl.float32)
            t = (s * w[None, :]).to(tl.bfloat16).to(tl.float32)
            t = tl.where(hmask[None, :], t, 0.0)
            score = tl.sum(t, axis=1)
            if CAUSAL:
                limit = (tl.load(pos_ptr + i64) + 1) // ratio
                score = tl.where(keys < limit, score, float("-inf"))
            tl.store(out_ptr + i64 * stride_on + keys, score.to(tl.bfloat16), mask=kmask)


def default_config(n_q: int, n_keys: int, n_heads: int, d: int) -> dict:
    """Launch parameters (from the sweep in ``benchmarks/bench_kernels.py``; see BENCHMARKS.md)."""
    block_e = 64 if n_keys <= 64 * 264 else 128
    q_per_prog = 1 if n_q <= 4 else 8
    return {"block_e": block_e, "q_per_prog": q_per_prog, "num_warps": 4, "num_stages": 1}


def default_config_fp4(n_q: int, n_keys: int, n_heads: int, d: int) -> dict:
    return dict(default_config(n_q, n_keys, n_heads, d), block_e=128, num_warps=8 if n_keys > 64 * 264 else 4)


def _launch(q, k, ks, weights, positions, ratio, d, fp4, cfg):
    n, h, _ = q.shape
    e = k.shape[0]
    out = torch.empty((n, e), dtype=torch.bfloat16, device=q.device)
    if n == 0 or e == 0:
        return out
    c = (default_config_fp4 if fp4 else default_config)(n, e, h, d)
    c.update({kk: v for kk, v in (cfg or {}).items() if v is not None})
    q = q.contiguous()
    weights = weights.to(torch.bfloat16).contiguous()
    causal = positions is not None
    pos = positions.to(torch.int64).contiguous() if causal else out
    grid = (triton.cdiv(e, c["block_e"]), triton.cdiv(n, c["q_per_prog"]))
    _index_scores_kernel[grid](
        q, k, ks, weights, pos, out, n, e, h, int(ratio),
        q.stride(0), q.stride(1), k.stride(0), ks.stride(0), weights.stride(0), out.stride(0),
        D=d, BLOCK_H=max(16, next_pow2(h)), BLOCK_E=c["block_e"], Q_PER_PROG=c["q_per_prog"], FP4=fp4,
        CAUSAL=causal, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out


def index_scores_cuda(q, keys, weights, dtype=torch.bfloat16, *, positions=None, ratio=4, config=None):
    """CUDA-tensor entry point with the signature of ``ops.index_scores`` (plus an optional causal mask:
    ``positions`` [n] int, entry j visible iff ``j < (t + 1) // ratio``). Non-bf16 ``dtype`` or unsupported
    shapes run the torch emulation on the GPU."""
    d = q.shape[-1]
    ok = (dtype == torch.bfloat16 and on_device(q) and q.dim() == 3 and keys.dim() == 2 and keys.shape[1] == d
          and d in (16, 32, 64, 128, 256) and q.shape[1] <= 128)
    if not ok:
        s = ops.index_scores(q, keys, weights, dtype)
        if positions is not None:
            j = torch.arange(keys.shape[0], device=s.device)
            s = s.masked_fill(j[None, :] >= ((positions.to(s.device) + 1) // ratio)[:, None], float("-inf"))
        return s
    keys = keys.to(torch.bfloat16).contiguous()
    return _launch(q.to(torch.bfloat16), keys, keys, weights, positions, ratio, d, False, config)


index_scores = device_transparent(index_scores_cuda)
index_scores.__name__ = "triton_index_scores"


def dequantize_fp4_keys(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch (any device) dequantization of an FP4 key cache: packed uint8 [e, d/2], scale bytes uint8 [e, d/32]
    -> bf16 [e, d] (exact; equals ``fidelity.formats.dequantize_fp4(...).to(bf16)``)."""
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    scales = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=packed.device)
    table = torch.cat((table, -table))
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    s = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    return (table[codes] * s).to(torch.bfloat16)


def index_scores_fp4(q, packed, scales, weights, *, positions=None, ratio=4, config=None):
    """Scores against an FP4 key cache: packed uint8 [e, d/2] (low nibble = element 2i) and ue8m0 scale bytes
    uint8 [e, d/32] (``fidelity.formats.quantize_fp4`` layout). q [n, H, d] bf16 on CUDA, weights [n, H]."""
    d = q.shape[-1]
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    if packed.shape[-1] * 2 != d or scales.shape[-1] * 32 != d or d not in (32, 64, 128, 256):
        raise ValueError(f"packed [e, {d // 2}] and scales [e, {d // 32}] expected for d={d}, found "
                         f"{list(packed.shape)} and {list(scales.shape)}")
    return _launch(q.to(torch.bfloat16), packed.contiguous(), scales.contiguous(), weights, positions, ratio, d,
                   True, config)
