"""RMSNorm and fused RMSNorm + FP8 activation quantization (1x128 e4m3, ue8m0 scales) in Triton.

``rms_norm``: ``(w_fp32 * (x_f32 * (1 / sqrt(mean(x^2) + eps)))).to(x.dtype)`` (spec §3: the reference norm is
torch; ``ops.rms_norm``), ``rows`` rows per program held in registers as one [rows, d/128, 128] tile (the FP8
epilogue's per-block amax is then a plain reduction, no re-layout). The mean uses a tree sum in fp32,
so ``y`` can differ from torch's by a rounding flip (one bf16 ulp) on a small fraction of elements.

``rms_norm_fp8``: the same ``y``, then the ``act_quant(y, 128, "ue8m0")`` of spec §3 on it in the same
program: per 128 elements ``amax = max(|y|, 1e-4)``, ``s = 2^(exp(v) - 127 + (mantissa(v) != 0))`` from the
bits of ``v = amax * fp32(1/448)``, codes ``e4m3(clamp(y / s, -448, 448))`` (RNE, the hardware cvt), scale
bytes ``exp(s) + 127``. Given ``y``, codes and scales are bit-identical to ``formats.quantize_fp8(y, 128)``,
NaN included (a NaN block gets scale byte 0xFF and NaN codes, as in ``fidelity.model.formats``).

``rms_norm_act_quant``: the same program storing, in place of codes and scale bytes, their product as bf16 (exact):
``y`` and ``formats.fake_quant_fp8(y, 128)``, what the production model's FP8 GEMMs multiply (profile ``fused-norm``).

``rms_norm_weightless``: the per-head query norm with every step rounded to bf16 as torch's bf16 ops round it
(``q * rsqrt(mean(q^2) + eps)``: the square, the mean of an fp32 sum, ``+ eps``, libdevice's ``rsqrtf``, the
product), one row per program.

Two launches: one-shot (one program per row group) and persistent (a few programs per SM loop over the row
groups and load the next group before reducing and storing the current one). Both give the same bits for the same
``rows`` and ``num_warps``; prefill-sized FP8 inputs take the persistent one (H200 numbers in BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    PDL_LAUNCH,
    UNSUPPORTED,
    bf16_rne,
    e4m3_blocks,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
)


@triton.jit
def _norm_store(x, w, rows, cols, mask, n_rows, n_cols, eps, y_ptr, q_ptr, s_ptr, stride_y, stride_q, stride_s,
                NB: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_Q: tl.constexpr,
                STREAM: tl.constexpr, DQ: tl.constexpr):
    """Normalize x fp32 [ROWS, NB, QB] (rows ``rows``) with w fp32 [NB, QB]; store y and/or codes + scale bytes
    (``DQ``: instead of those, the bf16 values code * s, i.e. y quantized-dequantized)."""
    ms = tl.math.div_rn(tl.sum(tl.sum(x * x, axis=2), axis=1), tl.zeros([ROWS], tl.float32) + n_cols)
    rs = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    y = (w[None, :, :] * (x * rs[:, None, None])).to(y_ptr.dtype.element_ty)
    if WRITE_Y:
        tl.store(y_ptr + rows[:, None, None] * stride_y + cols[None, :, :], y, mask=mask)
    if WRITE_Q:
        codes, sbyte, scale = e4m3_blocks(tl.reshape(y.to(tl.float32), [ROWS * NB, QB]))
        if DQ:
            deq = (codes.to(tl.float32) * scale[:, None]).to(tl.bfloat16)  # exact: a code times a power of two
            tl.store(q_ptr + rows[:, None, None] * stride_q + cols[None, :, :], tl.reshape(deq, [ROWS, NB, QB]),
                     mask=mask)
        else:
            tl.store(q_ptr + rows[:, None, None] * stride_q + cols[None, :, :], tl.reshape(codes, [ROWS, NB, QB]),
                     mask=mask, cache_modifier=".cs" if STREAM else "")
            blk = tl.arange(0, NB)
            smask = (rows < n_rows)[:, None] & (blk * QB < n_cols)[None, :]
            tl.store(s_ptr + rows[:, None] * stride_s + blk[None, :], tl.reshape(sbyte, [ROWS, NB]).to(tl.uint8),
                     mask=smask)


@triton.jit
def _row_cols(w_ptr, n_cols, NB: tl.constexpr, QB: tl.constexpr, STREAM: tl.constexpr):
    """Columns [NB, QB] of one row as NB blocks of QB, their mask, and w fp32 [NB, QB]."""
    cols = tl.arange(0, NB)[:, None] * QB + tl.arange(0, QB)[None, :]
    cmask = cols < n_cols
    # STREAM: x is read once and codes written once (kept out of the caches' way); w is read by every program
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0, eviction_policy="evict_last" if STREAM else "").to(tl.float32)
    return cols, cmask, w


@triton.jit
def _load_rows(x_ptr, rows, cols, cmask, n_rows, stride_x, STREAM: tl.constexpr):
    """x [ROWS, NB, QB] in its own dtype (0 outside the rows / columns) and the mask."""
    mask = (rows < n_rows)[:, None, None] & cmask[None, :, :]
    x = tl.load(x_ptr + rows[:, None, None] * stride_x + cols[None, :, :], mask=mask, other=0.0,
                eviction_policy="evict_first" if STREAM else "")
    return x, mask


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, n_rows, n_cols, eps, stride_x, stride_y, stride_q, stride_s,
                     NB: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr, WRITE_Y: tl.constexpr,
                     WRITE_Q: tl.constexpr, STREAM: tl.constexpr, DQ: tl.constexpr = False):
    """``ROWS`` rows per program as one [ROWS, NB, QB] tile (QB = the quantization block), so that all the rows'
    loads are in flight together and the FP8 epilogue's per-block amax is a plain reduction (no re-layout)."""
    wait_for_previous_kernel()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols, cmask, w = _row_cols(w_ptr, n_cols, NB, QB, STREAM)
    x, mask = _load_rows(x_ptr, rows, cols, cmask, n_rows, stride_x, STREAM)
    _norm_store(x.to(tl.float32), w, rows, cols, mask, n_rows, n_cols, eps, y_ptr, q_ptr, s_ptr, stride_y, stride_q,
                stride_s, NB, QB, ROWS, WRITE_Y, WRITE_Q, STREAM, DQ)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_persistent_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, n_rows, n_cols, eps, stride_x, stride_y, stride_q,
                                stride_s, NB: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr,
                                WRITE_Y: tl.constexpr, WRITE_Q: tl.constexpr, STREAM: tl.constexpr,
                                DQ: tl.constexpr = False):
    """Persistent variant: program p normalizes row groups p, p + P, p + 2P, ... (P programs) and loads group
    i + 1 before it reduces and stores group i (a register double buffer), so each program's loads overlap its
    own epilogue instead of waiting behind it; w is loaded once per program."""
    wait_for_previous_kernel()
    pid = tl.program_id(0)
    step = tl.num_programs(0).to(tl.int64) * ROWS
    cols, cmask, w = _row_cols(w_ptr, n_cols, NB, QB, STREAM)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    x, mask = _load_rows(x_ptr, rows, cols, cmask, n_rows, stride_x, STREAM)
    for _ in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        x_next, mask_next = _load_rows(x_ptr, rows + step, cols, cmask, n_rows, stride_x, STREAM)
        _norm_store(x.to(tl.float32), w, rows, cols, mask, n_rows, n_cols, eps, y_ptr, q_ptr, s_ptr, stride_y,
                    stride_q, stride_s, NB, QB, ROWS, WRITE_Y, WRITE_Q, STREAM, DQ)
        rows += step
        x, mask = x_next, mask_next


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _launch(x, weight, eps, write_y, write_q, num_warps=None, rows=None, stream=None, per_sm=None, dq=False):
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    q = torch.empty((n, d), dtype=torch.bfloat16 if dq else torch.float8_e4m3fn, device=x.device) if write_q else y
    s = torch.empty((n, d // 128), dtype=torch.uint8, device=x.device) if write_q and not dq else y
    if n:
        nb = next_pow2(triton.cdiv(d, 128))
        if per_sm is None and write_q and n >= 1024 and nb in (32, 64) and rows is None and num_warps is None:
            # H200 sweep (BENCHMARKS.md history): d = 4096 / 7168 is fastest persistent, one row per loop step,
            # 4 programs of 4 warps / 2 programs of 8 warps per SM, streaming hints
            per_sm, rows, num_warps, stream = (4, 1, 4, True) if nb == 32 else (2, 1, 8, True)
        rows = rows or (2 if n >= 1024 else 1)  # H200 sweep (BENCHMARKS.md history): two rows per program for prefill
        # H200 sweep: 2 rows of d = 4096 (nb 32) fastest with 4 warps, 2 rows of d = 7168 (nb 64) with 8
        warps = num_warps or (4 if nb <= 16 or (rows == 2 and nb <= 32) else (8 if nb <= 64 else 16))
        if rows & (rows - 1):
            raise ValueError(f"rows: expected a power of two, found {rows}")
        args = (x2, weight.contiguous(), y, q, s, n, d, float(eps), x2.stride(0), y.stride(0), q.stride(0),
                s.stride(0))
        meta = dict(NB=nb, QB=128, ROWS=rows, WRITE_Y=write_y, WRITE_Q=write_q, DQ=dq,
                    STREAM=rows > 1 and write_q if stream is None else stream, num_warps=warps)
        if per_sm:  # persistent: per_sm programs per SM, each looping over row groups
            grid = min(triton.cdiv(n, rows), per_sm * _sm_count(x.device))
            _rms_norm_persistent_kernel[(grid,)](*args, **meta, num_stages=1, **PDL_LAUNCH)
        else:
            _rms_norm_kernel[(triton.cdiv(n, rows),)](*args, **meta, **PDL_LAUNCH)
    y = y.reshape(shape)
    if not write_q:
        return y
    if dq:
        return y, q.reshape(shape)
    q, s = q.reshape(shape), s.reshape(*shape[:-1], d // 128)
    return (q, s, y) if write_y else (q, s)


def takes_rms_norm(x, weight, eps) -> str | None:
    """Why :func:`rms_norm_cuda` cannot take these inputs (None: it can): x bf16 / fp32 [..., d], d <= 32768."""
    ok = (on_device(x) and x.dtype in (torch.bfloat16, torch.float32) and x.dim() >= 1 and weight.dim() == 1
          and weight.shape[0] == x.shape[-1] and 1 <= x.shape[-1] <= 32768)
    return None if ok else UNSUPPORTED


def takes_rms_norm_fp8(x, weight, eps) -> str | None:
    """Why :func:`rms_norm_fp8_cuda` cannot take these inputs (None: it can): as ``rms_norm``, d a multiple of 128."""
    return UNSUPPORTED if x.shape[-1] % 128 else takes_rms_norm(x, weight, eps)


def takes_rms_norm_act_quant(x, weight, eps) -> str | None:
    """Why :func:`rms_norm_act_quant_cuda` cannot take these inputs (None: it can): bf16 x, d a multiple of 128."""
    return UNSUPPORTED if x.dtype != torch.bfloat16 else takes_rms_norm_fp8(x, weight, eps)


def rms_norm_cuda(x, weight, eps):
    """Same signature and result as ``ops.rms_norm`` (up to the fp32 summation order of the mean)."""
    return _launch(x, weight, eps, True, False)


def rms_norm_fp8_cuda(x, weight, eps, return_y: bool = False, *, num_warps: int | None = None,
                      rows: int | None = None, stream: bool | None = None, per_sm: int | None = None):
    """``formats.quantize_fp8(ops.rms_norm(x, weight, eps), 128)`` in one pass: (codes float8_e4m3fn [..., d],
    scale bytes uint8 [..., d/128]) plus the bf16 ``y`` when ``return_y``. d must be a multiple of 128.
    ``num_warps``, ``rows`` (per program or loop step), ``stream`` override the launch; ``per_sm`` launches the
    persistent kernel with that many programs per SM (``per_sm=0``: the one-shot kernel). Default: persistent for
    prefill (>= 1024 rows) at d in (2048, 4096] and (4096, 8192], else one-shot."""
    if x.shape[-1] % 128:
        raise ValueError(f"last dim must be a multiple of 128, found {x.shape[-1]}")
    return _launch(x, weight, eps, return_y, True, num_warps, rows, stream, per_sm)


def rms_norm_act_quant_cuda(x, weight, eps):
    """Same signature and result as ``ops.rms_norm_act_quant``: (y bf16, y quantized-dequantized 1x128 bf16) from
    one pass (``rms_norm_fp8``'s kernel storing code * scale instead of the codes and scale bytes). d must be a
    multiple of 128 and x bf16."""
    return _launch(x, weight, eps, True, True, dq=True)


@triton.jit(do_not_specialize=["n_rows"])
def _weightless_kernel(q_ptr, y_ptr, n_rows, eps, D: tl.constexpr, DP: tl.constexpr, LIBDEVICE: tl.constexpr):
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, DP)
    ok = cols < D
    q = tl.load(q_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    sq = bf16_rne(q * q)
    mean = bf16_rne(tl.math.div_rn(tl.sum(sq, axis=0), D))
    t = bf16_rne(mean + eps)
    if LIBDEVICE:
        r = bf16_rne(libdevice.rsqrt(t))
    else:  # Triton's CPU interpreter has no libdevice
        r = bf16_rne(tl.math.div_rn(1.0, tl.sqrt_rn(t)))
    tl.store(y_ptr + row * D + cols, bf16_rne(q * r).to(tl.bfloat16), mask=ok)


def takes_rms_norm_weightless(q, eps) -> str | None:
    """Why :func:`rms_norm_weightless_cuda` cannot take these inputs (None: it can): bf16 q [..., d], d <= 8192."""
    if not on_device(q) or q.dtype != torch.bfloat16 or not 0 < q.shape[-1] <= 8192:
        return UNSUPPORTED
    return None


def rms_norm_weightless_cuda(q, eps):
    """Same signature and result as ``ops.rms_norm_weightless`` for bf16 q [..., d] (d <= 8192); one launch."""
    d = q.shape[-1]
    x = q.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        _weightless_kernel[(rows,)](x, y, rows, float(eps), D=d, DP=next_pow2(d), LIBDEVICE=not INTERPRET,
                                    num_warps=4, **PDL_LAUNCH)
    return y
