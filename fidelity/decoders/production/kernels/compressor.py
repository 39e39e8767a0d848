"""A compressor's decode step after its projections in one launch (spec §4-§5, op ``compressor_decode``): the score's
ape, the carry slot write, the softmax pool of the carried slots, the overlap shift where the block completes, the
bf16 store, RMSNorm and RoPE at the block's first position.

One program holds the token. It reads the carried slots in blocks of rows, three passes (the per-channel maximum,
the softmax denominator, the weighted sum), the new token's slot from registers, so nothing written is read back;
after a barrier it writes the new slot and, where the block completes, the shifted overlap carry. As torch's
``softmax`` then ``sum``, the exponentials (libdevice ``expf``) are divided by their sum before the weighted sum; the
fp32 sums go in another order (the op's tolerance contract). One launch replaces the emulation's ~25 kernels per
compressor and step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    PDL_LAUNCH,
    ROTATION,
    UNSUPPORTED,
    bf16_rne,
    next_pow2,
    on_device,
    rotated,
    wait_for_previous_kernel,
)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:  # Triton's CPU interpreter has no libdevice
        return tl.exp(x)


@triton.jit
def _slots(ckv_ptr, csc_ptr, rows, cols, new_kv, new_sc, slot, r, d, W: tl.constexpr, OVERLAP: tl.constexpr):
    """Pool rows ``rows`` [RB] x channels ``cols`` [DP] -> (kv, score) fp32: row j reads carry column c (with overlap
    c + d from row r on), the new token's row from registers, rows past the slots score -inf."""
    if OVERLAP:
        src = cols[None, :] + tl.where(rows >= r, d, 0)[:, None]
        ok = (rows < 2 * r)[:, None] & (cols < d)[None, :]
    else:
        src = cols[None, :] + 0 * rows[:, None]
        ok = (rows < r)[:, None] & (cols < d)[None, :]
    kv = tl.load(ckv_ptr + rows[:, None] * W + src, mask=ok, other=0.0)
    sc = tl.load(csc_ptr + rows[:, None] * W + src, mask=ok, other=float("-inf"))
    is_new = (rows == slot)[:, None]
    return tl.where(is_new, new_kv[None, :], kv), tl.where(is_new, new_sc[None, :], sc)


@triton.jit
def _write_carry(kv_ptr, sc_ptr, ape_ptr, ckv_ptr, csc_ptr, phase, slot, r, W: tl.constexpr, WP: tl.constexpr,
                 RP: tl.constexpr, OVERLAP: tl.constexpr):
    """The new token's full row into carry row ``slot``; with overlap, where the block completes, rows r .. 2r-1
    (the new row from registers) copied to rows 0 .. r-1."""
    full = tl.arange(0, WP)
    fok = full < W
    nkv = tl.load(kv_ptr + full, mask=fok, other=0.0)
    nsc = tl.load(sc_ptr + full, mask=fok, other=0.0) + tl.load(ape_ptr + phase * W + full, mask=fok, other=0.0)
    tl.store(ckv_ptr + slot * W + full, nkv, mask=fok)
    tl.store(csc_ptr + slot * W + full, nsc, mask=fok)
    if OVERLAP:
        if phase == r - 1:
            rows = tl.arange(0, RP)
            ok = (rows < r)[:, None] & fok[None, :]
            src = (r + rows)[:, None] * W + full[None, :]
            is_new = (r + rows == slot)[:, None]
            kv = tl.where(is_new, nkv[None, :], tl.load(ckv_ptr + src, mask=ok, other=0.0))
            sc = tl.where(is_new, nsc[None, :], tl.load(csc_ptr + src, mask=ok, other=0.0))
            tl.store(ckv_ptr + rows[:, None] * W + full[None, :], kv, mask=ok)
            tl.store(csc_ptr + rows[:, None] * W + full[None, :], sc, mask=ok)


@triton.jit(do_not_specialize=["r", "d"])
def _compressor_kernel(kv_ptr, sc_ptr, ape_ptr, ckv_ptr, csc_ptr, pos_ptr, norm_ptr, f_ptr, out_ptr, r, d, eps,
                       W: tl.constexpr, WP: tl.constexpr, DP: tl.constexpr, RB: tl.constexpr, N_ROWS: tl.constexpr,
                       RP: tl.constexpr, FIRST: tl.constexpr, OVERLAP: tl.constexpr, LIBDEVICE: tl.constexpr,
                       ROTATION: tl.constexpr):
    wait_for_previous_kernel()
    pos = tl.load(pos_ptr)
    phase = (pos % r).to(tl.int32)
    cols = tl.arange(0, DP)
    cmask = cols < d
    if OVERLAP:  # the new row's pooled channels: carry columns hi .. hi + d - 1
        slot, hi = phase + r, d
    else:
        slot, hi = phase, 0
    new_kv = tl.load(kv_ptr + hi + cols, mask=cmask, other=0.0)
    new_sc = tl.load(sc_ptr + hi + cols, mask=cmask, other=0.0) + tl.load(ape_ptr + phase * W + hi + cols,
                                                                           mask=cmask, other=0.0)
    m = tl.full([DP], float("-inf"), tl.float32)
    for r0 in tl.static_range(0, N_ROWS, RB):
        _, sc = _slots(ckv_ptr, csc_ptr, r0 + tl.arange(0, RB), cols, new_kv, new_sc, slot, r, d, W, OVERLAP)
        m = tl.maximum(m, tl.max(sc, axis=0))
    m = tl.where(cmask, m, 0.0)
    den = tl.zeros([DP], tl.float32)
    for r0 in tl.static_range(0, N_ROWS, RB):
        _, sc = _slots(ckv_ptr, csc_ptr, r0 + tl.arange(0, RB), cols, new_kv, new_sc, slot, r, d, W, OVERLAP)
        den += tl.sum(_exp(sc - m[None, :], LIBDEVICE), axis=0)
    den = tl.where(cmask, den, 1.0)
    pooled = tl.zeros([DP], tl.float32)
    for r0 in tl.static_range(0, N_ROWS, RB):
        kv, sc = _slots(ckv_ptr, csc_ptr, r0 + tl.arange(0, RB), cols, new_kv, new_sc, slot, r, d, W, OVERLAP)
        pooled += tl.sum(kv * tl.math.div_rn(_exp(sc - m[None, :], LIBDEVICE), den[None, :]), axis=0)
    tl.debug_barrier()  # every read of the carry above is done before the carry is written
    _write_carry(kv_ptr, sc_ptr, ape_ptr, ckv_ptr, csc_ptr, phase, slot, r, W, WP, RP, OVERLAP)
    # the entry: the pool stored bf16, RMSNorm with its weight (bf16), RoPE at pos + 1 - r on the pairs from FIRST
    x = bf16_rne(tl.where(cmask, pooled, 0.0))
    rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(x * x, axis=0), d.to(tl.float32)) + eps))
    y = bf16_rne(tl.load(norm_ptr + cols, mask=cmask, other=0.0) * (x * rs))
    a, b = tl.split(tl.reshape(y, [DP // 2, 2]))
    pair = tl.arange(0, DP // 2)
    rope = (pair >= FIRST) & (2 * pair < d)
    angle = (pos + 1 - r).to(tl.float32) * tl.load(f_ptr + (pair - FIRST), mask=rope, other=0.0)
    ra, rb = rotated(a, b, tl.cos(angle), tl.sin(angle), ROTATION)
    out = tl.reshape(tl.join(tl.where(rope, ra, a), tl.where(rope, rb, b)), [DP])
    tl.store(out_ptr + cols, bf16_rne(out).to(tl.bfloat16), mask=cmask)


def takes_compressor_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, carry_kv: torch.Tensor,
                            carry_score: torch.Tensor, pos: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor,
                            eps: float) -> str | None:
    """Why :func:`compressor_decode_cuda` cannot take these inputs (None: it can): one token, a contiguous fp32
    carry, d <= 1024."""
    r, d = ape.shape[0], norm.numel()
    w = kv.shape[-1]
    n_slots = (2 if w == 2 * d else 1) * r
    ok = (on_device(kv) and kv.shape == (1, w) and score.shape == (1, w) and ape.shape == (r, w)
          and carry_kv.shape == carry_score.shape == (n_slots, w) and carry_kv.is_contiguous()
          and carry_score.is_contiguous() and carry_kv.dtype == carry_score.dtype == torch.float32
          and w in (d, 2 * d) and d <= 1024 and 0 < 2 * freqs.numel() <= d and pos.numel() == 1)
    return None if ok else UNSUPPORTED


def compressor_decode_cuda(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, carry_kv: torch.Tensor,
                           carry_score: torch.Tensor, pos: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor,
                           eps: float, *, rows: int = 8, num_warps: int = 4):
    """Same signature, outputs and in-place carry update as ``ops.compressor_decode``: kv, score fp32 [1, w],
    carries fp32 [coff * r, w] -> (entry bf16 [1, d], carry_kv, carry_score)."""
    r, d = ape.shape[0], norm.numel()
    w = kv.shape[-1]
    overlap = w == 2 * d
    n_slots = (2 if overlap else 1) * r
    entry = torch.empty((1, d), dtype=torch.bfloat16, device=kv.device)
    rows = min(rows, next_pow2(n_slots))
    dp = next_pow2(d)
    _compressor_kernel[(1,)](
        kv.float().contiguous(), score.float().contiguous(), ape.float().contiguous(), carry_kv, carry_score, pos,
        norm.contiguous(), freqs.float().contiguous(), entry, r, d, float(eps), W=w, WP=next_pow2(w), DP=dp,
        RB=rows, N_ROWS=triton.cdiv(n_slots, rows) * rows, RP=next_pow2(r), FIRST=(d - 2 * freqs.numel()) // 2,
        OVERLAP=overlap, LIBDEVICE=not INTERPRET, ROTATION=ROTATION, num_warps=num_warps, enable_fp_fusion=False,
        **PDL_LAUNCH)
    return entry, carry_kv, carry_score
