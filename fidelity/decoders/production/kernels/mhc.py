"""Fused mHC ``hc_pre`` in Triton (spec §4 mHC block, §3 ``hc_split_sinkhorn``): one launch for the mixes
projection, the RMS factor, the sigmoid / Sinkhorn split (20 rounds) and the collapse ``y = sum_i pre_i x_i``.

One program handles ``BT`` tokens: pass 1 streams ``x`` [BT, 4*dim] against ``fn`` [24, 4*dim] (tensor cores with
``bf16x3`` or ``tf32x3``, or fp32 FMA with ``"ieee"``; see :func:`hc_pre_cuda`) and the sum of squares; the 24 mixes
then go through the split and Sinkhorn in registers; pass 2 re-reads the token's streams (L2-resident) for the
fp32 collapse, rounded once to bf16. Outputs as ``ops.hc_pre``: (y bf16 [n, dim], pre [n, 4], post [n, 4],
comb [n, 4, 4] fp32). fp32 summation order differs from torch (tolerance contract of ``hc_pre``). With few
tokens (decode) the K reduction is split over programs and finished by a second launch (fixed-order sum); with
fewer tokens than a tile (decode's one) the finish reads the splits' partials a group at a time (one load latency
for all 128 of V4-Flash's splits instead of one per split: ``_finish_tiles``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    UNSUPPORTED,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
)


@triton.jit
def _split_collapse(m_pre, m_post, m_comb, toks, tmask, x_ptr, scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr,
                    comb_ptr, dim, hc_eps, iters, stride_xn, BT: tl.constexpr, BD: tl.constexpr, d_lo, d_hi,
                    STORE_SPLIT: tl.constexpr):
    """Sinkhorn split of the (rms-scaled) mixes [BT, 4], [BT, 4], [BT, 16], stores (if STORE_SPLIT), then
    y = sum_i pre_i x_i for the dims d_lo .. d_hi-1."""
    r4 = tl.arange(0, 4)
    r16 = tl.arange(0, 16)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + r4)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + 4 + r4)[None, :])
    c = tl.reshape(m_comb * s2 + tl.load(base_ptr + 8 + r16)[None, :], [BT, 4, 4])
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    if STORE_SPLIT:
        tl.store(pre_ptr + toks[:, None] * 4 + r4[None, :], pre, mask=tmask[:, None])
        tl.store(post_ptr + toks[:, None] * 4 + r4[None, :], post, mask=tmask[:, None])
        tl.store(comb_ptr + toks[:, None] * 16 + r16[None, :], tl.reshape(c, [BT, 16]), mask=tmask[:, None])
    for d0 in range(d_lo, d_hi, BD):
        ds = d0 + tl.arange(0, BD)
        dm = ds < dim  # d_hi - d_lo is a multiple of BD (or d_hi == dim)
        xs = tl.load(x_ptr + toks[:, None, None] * stride_xn + r4[None, :, None] * dim + ds[None, None, :],
                     mask=tmask[:, None, None] & dm[None, None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, :, None] * xs, axis=1)
        tl.store(y_ptr + toks[:, None] * dim + ds[None, :], y.to(tl.bfloat16), mask=tmask[:, None] & dm[None, :])


@triton.jit
def _mix_chunk(x_ptr, fn_ptr, toks, tmask, k_lo, k_len, K, stride_xn, BT: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, MIXES: tl.constexpr):
    """Partial mixes [BT, 32] (fn's MIXES rows; the rest zero) and sum of squares [BT] over x columns k_lo ..
    k_lo+k_len-1."""
    r32 = tl.arange(0, 32)
    mix = tl.zeros([BT, 32], tl.float32)
    mix_mid = tl.zeros([BT, 32], tl.float32)  # bf16x3: one total per part, three independent MMA chains
    mix_lo = tl.zeros([BT, 32], tl.float32)
    ssq = tl.zeros([BT], tl.float32)
    for kk in range(0, k_len, BK):
        ks = k_lo + kk + tl.arange(0, BK)
        km = ks < K
        xk = tl.load(x_ptr + toks[:, None] * stride_xn + ks[None, :], mask=tmask[:, None] & km[None, :],
                     other=0.0)
        xf = xk.to(tl.float32)
        ssq += tl.sum(xf * xf, axis=1)
        fk = tl.load(fn_ptr + r32[None, :] * K + ks[:, None], mask=(r32[None, :] < MIXES) & km[:, None], other=0.0)
        if PREC == "bf16x3":
            # bf16 streams times fn as three bf16 parts (fn = f1 + f2 + f3 to ~2^-24 relative); every product is
            # exact in fp32. Each part's block of BK columns is summed by the tensor cores from zero, then added to
            # its fp32 total with an RNE add (an fma by 1: not folded into the MMA), so the MMA's own accumulation
            # rounding covers BK columns rather than all of K; the parts are added smallest first at the end.
            f1 = fk.to(tl.bfloat16)
            r1 = fk - f1.to(tl.float32)
            f2 = r1.to(tl.bfloat16)
            f3 = (r1 - f2.to(tl.float32)).to(tl.bfloat16)
            mix_lo = tl.fma(tl.dot(xk, f3), 1.0, mix_lo)
            mix_mid = tl.fma(tl.dot(xk, f2), 1.0, mix_mid)
            mix = tl.fma(tl.dot(xk, f1), 1.0, mix)
        else:
            mix += tl.dot(xf, fk, input_precision=PREC)
    if PREC == "bf16x3":
        mix = mix + (mix_mid + mix_lo)
    return mix, ssq


@triton.jit(do_not_specialize=["n", "iters"])
def _hc_pre_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
                   n, dim, norm_eps, hc_eps, iters, stride_xn,
                   BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """Fused: one program = BT tokens, all of K (one launch)."""
    wait_for_previous_kernel()
    pid = tl.program_id(0)
    toks = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tmask = toks < n
    K = 4 * dim
    mix, ssq = _mix_chunk(x_ptr, fn_ptr, toks, tmask, 0, K, K, stride_xn, BT, BK, PREC, 24)
    rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ssq, K.to(tl.float32)) + norm_eps))
    mix = mix * rs[:, None]
    # split: one-hot selections (exact for finite mixes) of columns 0..3, 4..7, 8..23
    r32 = tl.arange(0, 32)
    r4 = tl.arange(0, 4)
    r16 = tl.arange(0, 16)
    sel_pre = (r32[None, :] == r4[:, None]).to(tl.float32)  # [4, 32]
    sel_post = (r32[None, :] == r4[:, None] + 4).to(tl.float32)
    sel_comb = (r32[None, :] == r16[:, None] + 8).to(tl.float32)  # [16, 32]
    m_pre = tl.sum(mix[:, None, :] * sel_pre[None, :, :], axis=2)  # [BT, 4]
    m_post = tl.sum(mix[:, None, :] * sel_post[None, :, :], axis=2)
    m_comb = tl.sum(mix[:, None, :] * sel_comb[None, :, :], axis=2)  # [BT, 16]
    _split_collapse(m_pre, m_post, m_comb, toks, tmask, x_ptr, scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr,
                    comb_ptr, dim, hc_eps, iters, stride_xn, BT, BD, 0, dim, True)


@triton.jit(do_not_specialize=["n"])
def _hc_mix_partial_kernel(x_ptr, fn_ptr, ws_ptr, n, dim, k_per_split, stride_xn,
                           BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, MIXES: tl.constexpr):
    """Split-K (few tokens): program (tile, s) writes partial mixes (fn's MIXES rows) + sum of squares to ws
    [S, n, 33]."""
    wait_for_previous_kernel()
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    toks = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    tmask = toks < n
    mix, ssq = _mix_chunk(x_ptr, fn_ptr, toks, tmask, pid_s * k_per_split, k_per_split, 4 * dim, stride_xn, BT, BK,
                          PREC, MIXES)
    row = (pid_s * n + toks) * 33
    tl.store(ws_ptr + row[:, None] + tl.arange(0, 32)[None, :], mix, mask=tmask[:, None])
    tl.store(ws_ptr + row + 32, ssq, mask=tmask)


@triton.jit
def _split_sums(ws_ptr, toks, tmask, s0, n, n_splits, lo: tl.constexpr, WIDTH: tl.constexpr, SB: tl.constexpr):
    """Columns lo .. lo+WIDTH-1 of the partials ws [S, n, 33] of splits s0 .. s0+SB-1 (those < n_splits), summed
    over the splits (a fixed tree: deterministic) -> [BT, WIDTH]."""
    s = s0 + tl.arange(0, SB)
    row = (s[None, :] * n + toks[:, None]) * 33  # [BT, SB]
    ok = tmask[:, None] & (s < n_splits)[None, :]
    part = tl.load(ws_ptr + row[:, :, None] + lo + tl.arange(0, WIDTH)[None, None, :], mask=ok[:, :, None], other=0.0)
    return tl.sum(part, axis=1)


@triton.jit(do_not_specialize=["n", "iters", "n_splits"])
def _hc_finish_kernel(ws_ptr, x_ptr, scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
                      n, dim, n_splits, norm_eps, hc_eps, iters, stride_xn, d_per_prog,
                      BT: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr):
    """Sums the split-K partials in a fixed order (deterministic: SB splits a load, summed as a fixed tree, the
    groups in order; SB = 1 is the plain split order), then split + collapse; program (tile, j) collapses dims
    j*d_per_prog .. (j+1)*d_per_prog-1 (every program redoes the 4x4 Sinkhorn, j == 0 stores it)."""
    wait_for_previous_kernel()
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    toks = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tmask = toks < n
    m_pre = tl.zeros([BT, 4], tl.float32)
    m_post = tl.zeros([BT, 4], tl.float32)
    m_comb = tl.zeros([BT, 16], tl.float32)
    ssq = tl.zeros([BT, 1], tl.float32)
    for s0 in range(0, n_splits, SB):
        m_pre += _split_sums(ws_ptr, toks, tmask, s0, n, n_splits, 0, 4, SB)
        m_post += _split_sums(ws_ptr, toks, tmask, s0, n, n_splits, 4, 4, SB)
        m_comb += _split_sums(ws_ptr, toks, tmask, s0, n, n_splits, 8, 16, SB)
        ssq += _split_sums(ws_ptr, toks, tmask, s0, n, n_splits, 32, 1, SB)
    ssq = tl.sum(ssq, axis=1)
    rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ssq, (4 * dim).to(tl.float32)) + norm_eps))
    if pid_d == 0:
        _split_collapse(m_pre * rs[:, None], m_post * rs[:, None], m_comb * rs[:, None], toks, tmask, x_ptr,
                        scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr, dim, hc_eps, iters, stride_xn, BT, BD,
                        0, d_per_prog, True)
    else:
        _split_collapse(m_pre * rs[:, None], m_post * rs[:, None], m_comb * rs[:, None], toks, tmask, x_ptr,
                        scale_ptr, base_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr, dim, hc_eps, iters, stride_xn, BT, BD,
                        pid_d * d_per_prog, (pid_d + 1) * d_per_prog, False)


def takes_hc_pre(x, fn, scale, base, norm_eps, iters, hc_eps) -> str | None:
    """Why :func:`hc_pre_cuda` cannot take these inputs (None: it can): x bf16 / fp32 [n, 4, dim], fn [24, 4 dim]."""
    if not (on_device(x) and x.dim() == 3 and x.shape[1] == 4 and fn.shape == (24, 4 * x.shape[2])
            and x.dtype in (torch.bfloat16, torch.float32)):
        return UNSUPPORTED
    return None


def hc_pre_cuda(x, fn, scale, base, norm_eps, iters, hc_eps, *, bt: int | None = None, bk: int = 128,
                bd: int | None = None, num_warps: int | None = None, precision: str | None = None,
                splits: int | None = None):
    """Same signature and outputs as ``ops.hc_pre``; x [n, 4, dim] (bf16 or fp32 streams) on CUDA.

    ``precision``: the mixes GEMM as ``"bf16x3"`` (the default for bf16 streams: bf16 tensor-core MMAs of the
    streams, exact in bf16, against fn split into three bf16 parts; each part's BK-column block is summed from
    zero by the MMA and added to an fp32 total, which keeps the accuracy of ``"tf32x3"``), ``"tf32x3"`` (the
    default for fp32 streams: three TF32 products; bf16 streams are exact in TF32, so only fn's split into two
    TF32 parts rounds) or ``"ieee"`` (fp32 FMA). ``bt`` tokens per program and ``num_warps``: 64 and 8 for bf16x3
    from 1024 tokens (2.7x faster than tf32x3 at 4096 tokens on the H200: BENCHMARKS.md), else 16 and 4.
    ``splits``: split-K programs per token tile (default: about 256 programs in all for the 64-token tiles; else
    1 = the fused single launch when the tiles fill the GPU, or enough splits for ~2 programs per SM); a split
    launch is followed by one that sums the partials in a fixed order and finishes (deterministic either way)."""
    n, _, dim = x.shape
    precision = precision or ("bf16x3" if x.dtype == torch.bfloat16 else "tf32x3")
    if precision == "bf16x3" and x.dtype != torch.bfloat16:
        raise ValueError(f"hc_pre: precision 'bf16x3' takes bf16 streams, found {x.dtype}")
    wide = precision == "bf16x3" and n >= 1024
    bt = bt or (64 if wide else 16)
    num_warps = num_warps or (8 if wide else 4)
    x = x.contiguous()
    dev = x.device
    y = torch.empty((n, dim), dtype=torch.bfloat16, device=dev)
    pre = torch.empty((n, 4), dtype=torch.float32, device=dev)
    post = torch.empty((n, 4), dtype=torch.float32, device=dev)
    comb = torch.empty((n, 4, 4), dtype=torch.float32, device=dev)
    if n == 0:
        return y, pre, post, comb
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    bd = bd or max(32, 4096 // bt)  # collapse tile [bt, 4, bd]: keep it at 16K elements
    tiles = triton.cdiv(n, bt)
    k_blocks = triton.cdiv(4 * dim, bk)
    if splits is None and wide:
        splits = max(1, min(k_blocks, round(256 / tiles)))
    elif splits is None:
        splits = 1 if tiles >= 128 else min(k_blocks, triton.cdiv(264, tiles))
    per = triton.cdiv(k_blocks, max(1, splits)) * bk
    splits = triton.cdiv(4 * dim, per)
    if splits == 1:
        _hc_pre_kernel[(tiles,)](
            x, fn, scale, base, y, pre, post, comb, n, dim, float(norm_eps), float(hc_eps), int(iters), x.stride(0),
            BT=bt, BK=bk, BD=bd, PREC=precision, num_warps=num_warps, **PDL_LAUNCH)
        return y, pre, post, comb
    ws = torch.empty((splits, n, 33), dtype=torch.float32, device=dev)
    _hc_mix_partial_kernel[(tiles, splits)](x, fn, ws, n, dim, per, x.stride(0), BT=bt, BK=bk, PREC=precision,
                                            MIXES=24, num_warps=num_warps, **PDL_LAUNCH)
    bt, bd, sb = _finish_tiles(n, bt, bd, splits, 16)
    tiles = triton.cdiv(n, bt)
    d_blocks = max(1, min(triton.cdiv(dim, bd), triton.cdiv(264, tiles)))
    d_per = triton.cdiv(triton.cdiv(dim, bd), d_blocks) * bd
    _hc_finish_kernel[(tiles, triton.cdiv(dim, d_per))](
        ws, x, scale, base, y, pre, post, comb, n, dim, splits, float(norm_eps), float(hc_eps), int(iters),
        x.stride(0), d_per, BT=bt, BD=bd, SB=sb, num_warps=num_warps, **PDL_LAUNCH)
    return y, pre, post, comb


def _finish_tiles(n: int, bt: int, bd: int, splits: int, width: int) -> tuple[int, int, int]:
    """(tokens, dims, splits per load) of a split-K finish launch. A full tile of tokens keeps the mix kernels'
    tile and sums the splits one at a time; fewer tokens (decode) get a tile of their own size (a power of two)
    and load up to 2048 partials [tokens, splits, width] at once, so the split count costs one load latency per
    group rather than one per split."""
    if n >= bt:
        return bt, bd, 1
    tokens = next_pow2(n)
    return tokens, max(32, 512 // tokens), min(next_pow2(splits), max(1, 2048 // (tokens * width)))


@triton.jit(do_not_specialize=["n", "n_splits"])
def _hc_head_finish_kernel(ws_ptr, x_ptr, scale_ptr, base_ptr, y_ptr, n, dim, n_splits, norm_eps, hc_eps, stride_xn,
                           d_per_prog, BD: tl.constexpr, SB: tl.constexpr):
    """Token pid0: the split-K partials summed in a fixed order (SB splits a load as a fixed tree, the groups in
    order; SB = 1: split order), pre = sigmoid(mixes * rs * scale + base) + eps, then y = sum_i pre_i x_i over the
    dims pid1 * d_per_prog .. (pid1 + 1) * d_per_prog - 1, rounded once to bf16."""
    wait_for_previous_kernel()
    tok = tl.program_id(0).to(tl.int64)
    r4 = tl.arange(0, 4)
    one = tl.full([1], 1, tl.int1)
    mix = tl.zeros([1, 4], tl.float32)
    ssq = tl.zeros([1, 4], tl.float32)  # the sum of squares, once per lane
    for s0 in range(0, n_splits, SB):
        mix += _split_sums(ws_ptr, tok + tl.zeros([1], tl.int64), one, s0, n, n_splits, 0, 4, SB)
        ssq += _split_sums(ws_ptr, tok + tl.zeros([1], tl.int64), one, s0, n, n_splits, 32, 1, SB)
    mix = tl.reshape(mix, [4])
    ssq = tl.reshape(ssq, [4])
    rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ssq, (4 * dim).to(tl.float32)) + norm_eps))
    pre = tl.sigmoid(mix * rs * tl.load(scale_ptr) + tl.load(base_ptr + r4)) + hc_eps
    d_lo = tl.program_id(1) * d_per_prog
    for d0 in range(0, d_per_prog, BD):
        cols = d_lo + d0 + tl.arange(0, BD)
        ok = cols < dim
        x = tl.load(x_ptr + tok * stride_xn + r4[:, None] * dim + cols[None, :], mask=ok[None, :], other=0.0)
        y = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
        tl.store(y_ptr + tok * dim + cols, y.to(tl.bfloat16), mask=ok)


def takes_hc_head(x, fn, scale, base, norm_eps, hc_eps) -> str | None:
    """Why :func:`hc_head_cuda` cannot take these inputs (None: it can): x bf16 / fp32 [n, 4, dim], fn [4, 4 dim]."""
    if not (on_device(x) and x.dim() == 3 and x.shape[1] == 4 and fn.shape == (4, 4 * x.shape[2])
            and x.dtype in (torch.bfloat16, torch.float32) and scale.numel() == 1):
        return UNSUPPORTED
    return None


def hc_head_cuda(x, fn, scale, base, norm_eps, hc_eps, *, bt: int = 16, bk: int = 128, bd: int = 512,
                 num_warps: int = 4):
    """Same signature and output as ``ops.hc_head``: x [n, 4, dim] streams on CUDA -> bf16 [n, dim]: the mixes of
    ``hc_pre``'s split-K partial kernel with fn's 4 rows, then one launch for the sigmoid weights and the collapse
    (tolerance contract of ``hc_head``: fp32 sums in another order)."""
    n, _, dim = x.shape
    x = x.contiguous()
    y = torch.empty((n, dim), dtype=torch.bfloat16, device=x.device)
    if n == 0:
        return y
    tiles, k_blocks = triton.cdiv(n, bt), triton.cdiv(4 * dim, bk)
    per = triton.cdiv(k_blocks, max(1, min(k_blocks, triton.cdiv(264, tiles)))) * bk
    splits = triton.cdiv(4 * dim, per)
    ws = torch.empty((splits, n, 33), dtype=torch.float32, device=x.device)
    precision = "bf16x3" if x.dtype == torch.bfloat16 else "tf32x3"
    _hc_mix_partial_kernel[(tiles, splits)](x, fn.float().contiguous(), ws, n, dim, per, x.stride(0), BT=bt, BK=bk,
                                            PREC=precision, MIXES=4, num_warps=num_warps, **PDL_LAUNCH)
    d_per = triton.cdiv(triton.cdiv(dim, bd), max(1, min(triton.cdiv(dim, bd), triton.cdiv(132, n)))) * bd
    sb = 1 if n >= bt else min(next_pow2(splits), 512)  # as _finish_tiles: decode loads the splits at once
    _hc_head_finish_kernel[(n, triton.cdiv(dim, d_per))](
        ws, x, scale.float().contiguous(), base.float().contiguous(), y, n, dim, splits, float(norm_eps),
        float(hc_eps), x.stride(0), d_per, BD=bd, SB=sb, num_warps=num_warps, **PDL_LAUNCH)
    return y


@triton.jit(do_not_specialize=["n"])
def _hc_post_kernel(f_ptr, r_ptr, post_ptr, comb_ptr, o_ptr, n, dim, stride_fn, stride_rn, stride_on,
                    BT: tl.constexpr, BD: tl.constexpr):
    """Program (token tile, dim tile): ``out[t, k, d] = post[t, k] * f[t, d] + sum_j comb[t, j, k] * r[t, j, d]``
    in fp32 (j summed in ascending order, as the emulation), stored in the output's dtype."""
    wait_for_previous_kernel()
    toks = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    tm = toks < n
    m2 = tm[:, None] & (ds[None, :] < dim)
    r4 = tl.arange(0, 4)
    m3 = m2[:, None, :]
    f = tl.load(f_ptr + toks[:, None] * stride_fn + ds[None, :], mask=m2, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + toks[:, None] * 4 + r4[None, :], mask=tm[:, None], other=0.0)  # [BT, 4]
    rbase = r_ptr + toks[:, None, None] * stride_rn + ds[None, None, :]
    cbase = comb_ptr + toks[:, None] * 16 + r4[None, :]  # comb[t, j, k] at t*16 + j*4 + k: row j, all k
    mixed = tl.zeros([BT, 4, BD], tl.float32)
    for j in tl.static_range(4):
        rj = tl.load(rbase + j * dim, mask=m2[:, None, :], other=0.0).to(tl.float32)  # [BT, 1, BD]
        cj = tl.load(cbase + j * 4, mask=tm[:, None], other=0.0)  # [BT, 4] over k
        mixed += cj[:, :, None] * rj
    out = post[:, :, None] * f[:, None, :] + mixed
    tl.store(o_ptr + toks[:, None, None] * stride_on + r4[None, :, None] * dim + ds[None, None, :],
             out.to(o_ptr.dtype.element_ty), mask=m3)


def takes_hc_post(f, residual, post, comb, out_dtype=torch.bfloat16) -> str | None:
    """Why :func:`hc_post_cuda` cannot take these inputs (None: it can): f [n, dim], residual [n, 4, dim], post
    [n, 4], comb [n, 4, 4], a bf16 / fp32 output."""
    ok = (on_device(f) and f.dim() == 2 and residual.dim() == 3 and residual.shape[1] == 4
          and residual.shape[0] == f.shape[0] and residual.shape[2] == f.shape[1] and post.shape == (f.shape[0], 4)
          and comb.shape == (f.shape[0], 4, 4) and out_dtype in (torch.bfloat16, torch.float32))
    return None if ok else UNSUPPORTED


def hc_post_cuda(f, residual, post, comb, out_dtype=torch.bfloat16, *, bt: int = 4, bd: int = 512,
                 num_warps: int = 4):
    """Same signature and result as ``ops.hc_post`` (up to fp32 FMA contraction): f [n, dim] bf16, residual
    [n, 4, dim] (bf16 or fp32 streams), post [n, 4], comb [n, 4, 4] fp32 -> [n, 4, dim] ``out_dtype``. One launch
    reads f and the residual once and writes the new streams once (the memory floor)."""
    n, dim = f.shape
    out = torch.empty((n, 4, dim), dtype=out_dtype, device=f.device)
    if n == 0:
        return out
    f = f if f.stride(-1) == 1 else f.contiguous()
    residual = residual.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    grid = (triton.cdiv(n, bt), triton.cdiv(dim, bd))
    _hc_post_kernel[grid](f, residual, post, comb, out, n, dim, f.stride(0), residual.stride(0), out.stride(0),
                          BT=bt, BD=bd, num_warps=num_warps, **PDL_LAUNCH)
    return out
