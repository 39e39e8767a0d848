"""Decode GEMMs that read the weights as the release stores them (memory-bound GEMV path, a few rows).

* ``fp8_weight_linear``: y [m, n] bf16 = xq [m, k] @ W^T with W held as e4m3 codes [n, k] and its 128x128 block
  scales (decoded to fp32, [n/128, k/128]): 1 byte per weight read instead of the 4 of the dequantized fp32 copy.
  Each weight is dequantized exactly in registers (code x 2^e) and the products accumulate in fp32, as the
  emulation's fp32 GEMM does, in another order (tolerance contract of ``act_linear``).
  ``groups``: wo_a's grouped projection (output row j reads x's group j // (n / groups)), bf16 x as given.
* ``bf16_weight_linear_f32``: y [m, n] fp32 = x @ W^T with W the bf16 weight as stored (the compressors' fp32
  projections: bf16 x bf16 products are exact in fp32, summed in fp32).
* ``fp4_expert_linear``: for slots s, y [s, n] bf16 = xq[s] @ W[e_s]^T with W[e] the FP4 e2m1 codes of expert e
  (two per byte, low nibble first, [E, n, k/2]) and its 1x32 scales as stored: one e8m0 byte per block (uint8
  [E, n, k/32], ``2^(b - 127)``, 255 NaN), made into the fp32 power of two in the kernel (``e8m0_scale``: exponent
  bit moves, bit for bit ``formats.decode_e8m0``), so the scales cost 1 byte per 32 weights, not 4; the expert ids
  stay on the device, so a captured CUDA graph picks the experts without copying their weights. The codes are
  decoded a 32-bit word (eight weights) at a time and x is prepared once per call (x 2^6 in the word's nibble
  order, quantized there when asked), so the loop issues about 4.3 instructions per weight on sm_90
  (``tests/test_fp4_gemv_sass.py``), near the rate the HBM delivers nibbles to an SM, with the next step's codes
  in flight while a step's are decoded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    PDL_LAUNCH,
    UNSUPPORTED,
    bf16_rne,
    e4m3_blocks,
    e8m0_scale,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
)
from fidelity.decoders.production.kernels.act_quant import fake_quant_fp8
from fidelity.decoders.production.op_spec import GEMV_ROWS, check_fp4_picked_linear

FP8_BLOCK = 128
_FENCE = tl.constexpr(not INTERPRET)
_ASM = tl.constexpr(not INTERPRET)  # inline PTX (the interpreter cannot run it)


@triton.jit
def _activation(x_ptr, N: tl.constexpr, QUANT: tl.constexpr):
    """N activations from x_ptr as fp32; QUANT: bf16 ones quantized-dequantized in 1x128 e4m3 blocks (N a multiple
    of 128 starting at a block boundary), bit for bit ``fake_quant_fp8(x, 128)`` (``e4m3_blocks``)."""
    x = tl.load(x_ptr + tl.arange(0, N)).to(tl.float32)
    if QUANT:
        codes, _, s = e4m3_blocks(tl.reshape(x, [N // 128, 128]))
        x = tl.reshape(codes.to(tl.float32) * s[:, None], [N])
    return x


@triton.jit
def _gpu_fence():
    """``fence.acq_rel.gpu`` in every thread (this thread's writes before it are visible device-wide to a thread
    that acquires after observing a later write of this CTA); nothing under the interpreter (one program at a time)."""
    if _FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, n, k_split: tl.constexpr, stride_x, stride_w,
                 stride_s, group_rows, stride_group, M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, SPLITS: tl.constexpr, QUANT: tl.constexpr, CODES: tl.constexpr):
    """Rows pid0*BN .. +BN of all M outputs (MP: M rounded up to a power of two) over the pid1-th of SPLITS slices
    of k (``k_split`` columns, BK = a multiple of 128 per step). CODES: w holds e4m3 codes, and per 128-column
    block the products code x x are summed, then scaled by the block's 2^e; else w is bf16 and the products are
    summed as they are. Output row j reads x's columns from (j // group_rows) * stride_group on (grouped
    projections; group_rows a multiple of BN). QUANT: x is the bf16 activation, quantized here (``_activation``).
    y goes to out in its dtype; with SPLITS > 1 each slice stores its fp32 partial sums (part [SPLITS, M, n]) and
    counts itself in count[pid0] (zero on entry), and the slice that counts last adds the partials in slice order
    (deterministic: the same sums whichever slice finishes last), stores y and sets the count back to zero."""
    wait_for_previous_kernel()
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    ok = rows < n
    cols = tl.arange(0, BK)
    blocks = tl.arange(0, BK // 128)
    k_begin = tl.program_id(1) * k_split
    x_ptr += (tl.program_id(0) * BN // group_rows).to(tl.int64) * stride_group
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    for kk in range(0, k_split, BK):
        k0 = k_begin + kk
        w = tl.load(w_ptr + rows[:, None] * stride_w + (k0 + cols)[None, :], mask=ok[:, None], other=0)
        if CODES:
            wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            s = tl.load(s_ptr + (rows // 128)[:, None] * stride_s + (k0 // 128 + blocks)[None, :],
                        mask=ok[:, None], other=0.0)
        else:
            wf = w.to(tl.float32)
        for m in tl.static_range(M):
            x = _activation(x_ptr + m * stride_x + k0, BK, QUANT)
            if CODES:
                part = tl.sum(tl.reshape(wf * x[None, :], [BN, BK // 128, 128]), axis=2)  # per scale block
                dot = tl.sum(part * s, axis=1)
            else:
                dot = tl.sum(wf * x[None, :], axis=1)
            acc = tl.where(tl.arange(0, MP)[:, None] == m, acc + dot[None, :], acc)
    for m in tl.static_range(M):
        y = tl.sum(tl.where(tl.arange(0, MP)[:, None] == m, acc, 0.0), axis=0)
        if SPLITS == 1:
            tl.store(out_ptr + m * n + rows, y.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(part_ptr + (tl.program_id(1) * M + m) * n + rows, y, mask=ok)
    if SPLITS > 1:
        _gpu_fence()
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            _gpu_fence()
            for m in tl.static_range(M):
                y = tl.load(part_ptr + m * n + rows, mask=ok, other=0.0, cache_modifier=".cg")
                for i in tl.static_range(1, SPLITS):
                    y += tl.load(part_ptr + (i * M + m) * n + rows, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m * n + rows, y.to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(count_ptr + tl.program_id(0), 0)


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over the splits of p [SPLITS, total] in split order (deterministic), stored in y's dtype (bf16:
    rounded to nearest even from the bits, as the hardware's conversion does and the interpreter's does not)."""
    wait_for_previous_kernel()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    y = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for i in tl.static_range(1, SPLITS):
        y += tl.load(p_ptr + i * total + offs, mask=ok, other=0.0)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_rne(y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def k_slices(programs: int, k: int, bk: int, sms: int, per_sm: int = 2) -> int:
    """The k slices (a power of two dividing k / bk) that bring a grid of ``programs`` row blocks to about
    ``per_sm`` programs per SM on ``sms`` SMs."""
    splits = 1
    while programs * splits * 2 <= per_sm * sms and k % (splits * 2 * bk) == 0:
        splits *= 2
    return splits


def fp8_gemv_slices(programs: int, k: int, bk: int, sms: int) -> int:
    """The FP8 / bf16 GEMV's default k slices: about eight programs per SM for rows of 4096 columns or more, two
    otherwise (one H100, ``bench_weight_gemv.py``'s sweep: wo_b 4096 x 8192 in 4 slices 15.4 us against 20.0 us
    in 1; wq_a 1024 x 4096 in 8 slices 5.0 against 5.8 in 4; the k = 1024 / 2048 weights fastest unsliced)."""
    return k_slices(programs, k, bk, sms, 8 if k >= 4096 else 2)


def _sm_count(device: torch.device) -> int:
    """The device's SM count; 0 off CUDA (the interpreter: no k slices)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _split_counts(device: torch.device, programs: int) -> torch.Tensor:
    """The per-row-block arrival counts of the k-sliced GEMVs on ``device``: int32 zeros, allocated once (and grown
    outside a CUDA-graph capture); each launch leaves the counts it used at zero. Launches on one stream only (two
    GEMVs running at once on one device would share them)."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < programs:
        counts = _COUNTS[device] = torch.zeros(max(programs, 4096), dtype=torch.int32, device=device)
    return counts


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride, as the kernels index it (row stride as given: 0 for one row repeated)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _as_loaded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it (bf16 or fp32 rows, converted to fp32 on load): no conversion launch for those."""
    return _rows(x) if x.dtype in (torch.bfloat16, torch.float32) else x.float().contiguous()


def _finish(partials: torch.Tensor | None, y: torch.Tensor, splits: int) -> torch.Tensor:
    if partials is not None:
        total = y.numel()
        _sum_splits_kernel[(triton.cdiv(total, 1024),)](partials, y, total, SPLITS=splits, BLOCK=1024, num_warps=4,
                                                         **PDL_LAUNCH)
    return y


def _gemv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, *, quantize: bool, groups: int,
          out_dtype: torch.dtype, bn: int, bk: int, splits: int | None, stages: int, num_warps: int) -> torch.Tensor:
    """y [m, n] = x @ W^T over a weight w [n, k] of e4m3 codes (with 128x128 scales s) or bf16 (s None); x [m,
    groups * k], output row j reading x's group j // (n / groups)."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    bk = bk if k % bk == 0 else FP8_BLOCK
    programs = triton.cdiv(n, bn)
    splits = splits or fp8_gemv_slices(programs, k, bk, _sm_count(x.device))
    while k % (splits * bk) and bk > FP8_BLOCK:
        bk //= 2
    if k % (splits * bk):
        raise ValueError(f"weight GEMV: splits {splits} must divide k / 128 ({k // 128})")
    if groups > 1 and (n // groups) % bn:
        raise ValueError(f"weight GEMV: a group's {n // groups} rows must be a multiple of the row block {bn}")
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    partials = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    counts = _split_counts(x.device, programs) if splits > 1 else y
    _gemv_kernel[(programs, splits)](x, w, w if s is None else s, y, partials, counts, n, k // splits, x.stride(0),
                                     w.stride(0), 0 if s is None else s.stride(0), n // groups,
                                     k if groups > 1 else 0, M=m, MP=next_pow2(m), BN=bn, BK=bk, SPLITS=splits,
                                     QUANT=quantize, CODES=s is not None, num_stages=stages, num_warps=num_warps,
                                     **PDL_LAUNCH)
    return y


def fp8_weight_linear(xq: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, quantize: bool = False,
                      groups: int = 1, bn: int = 16, bk: int = 512, splits: int | None = None, stages: int = 3,
                      num_warps: int = 4) -> torch.Tensor:
    """xq [m, groups * k] (bf16 or fp32, on the e4m3 grid or not: multiplied as given; ``quantize``: bf16 x
    quantized in 1x128 e4m3 blocks inside the kernel) @ (codes [n, k] e4m3 / uint8 x scales fp32 [n/128,
    k/128])^T -> bf16 [m, n]; k a multiple of 128, m <= 8. ``groups`` > 1: output row j multiplies x's group
    j // (n / groups) (wo_a's grouped projection). ``splits`` (default: enough for about two programs per SM)
    slices k, each slice's fp32 partial sums then added in slice order."""
    m, n, k = xq.shape[0], codes.shape[0], codes.shape[1]
    if xq.shape[1] != groups * k or k % FP8_BLOCK or scales.shape != ((n + 127) // 128, k // 128) or \
            not 1 <= m <= 8 or n % groups:
        raise ValueError(f"fp8_weight_linear: expected xq [m<=8, groups * k], codes [n, k], scales [n/128, k/128] "
                         f"with k % 128 == 0 and n % groups == 0, found xq {tuple(xq.shape)}, codes "
                         f"{tuple(codes.shape)}, scales {tuple(scales.shape)}, groups {groups}")
    x = _rows(xq) if quantize else _as_loaded(xq)
    return _gemv(x, codes.view(torch.uint8), scales.float().contiguous(), quantize=quantize, groups=groups,
                 out_dtype=torch.bfloat16, bn=bn, bk=bk, splits=splits, stages=stages, num_warps=num_warps)


def bf16_weight_linear_f32(x: torch.Tensor, weight: torch.Tensor, *, bn: int = 16, bk: int = 512,
                           splits: int | None = None, stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    """x [m, k] (bf16 or fp32) @ W^T with W bf16 [n, k] as stored -> fp32 [m, n]: the products (exact in fp32)
    summed in fp32, m <= 8 and k a multiple of 128 (the compressors' fp32 projections at decode)."""
    m, k = x.shape
    if weight.dtype != torch.bfloat16 or weight.shape[1] != k or k % FP8_BLOCK or not 1 <= m <= 8:
        raise ValueError(f"bf16_weight_linear_f32: expected x [m<=8, k], weight bf16 [n, k] with k % 128 == 0, found "
                         f"x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    return _gemv(_as_loaded(x), weight.contiguous(), None, quantize=False, groups=1,
                 out_dtype=torch.float32, bn=bn, bk=bk, splits=splits, stages=stages, num_warps=num_warps)


@triton.jit
def _e4m3_bytes(word, t: tl.constexpr):
    """Byte t of uint32 words holding four e4m3 codes, as fp32 (the interpreter's path of ``_four_e4m3``)."""
    return ((word >> (8 * t)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _four_e4m3(word):
    """The four e4m3 codes of uint32 words (byte 0 first) as four fp32 tensors: on the GPU two
    ``cvt.rn.f16x2.e4m3x2`` (one per 16-bit half, low byte to the low half, as Triton's own fp8 conversion
    packs) and four exact f16 -> f32 conversions; under the interpreter byte by byte (``_e4m3_bytes``)."""
    if _ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 a0, a1, h0, h1, h2, h3;
            .reg .b32 d0, d1;
            mov.b32 {a0, a1}, $4;
            cvt.rn.f16x2.e4m3x2 d0, a0;
            cvt.rn.f16x2.e4m3x2 d1, a1;
            mov.b32 {h0, h1}, d0;
            mov.b32 {h2, h3}, d1;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }""", "=f,=f,=f,=f,r", [word], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
            pack=1)
    else:
        return _e4m3_bytes(word, 0), _e4m3_bytes(word, 1), _e4m3_bytes(word, 2), _e4m3_bytes(word, 3)


@triton.jit
def _fp4_input_kernel(x_ptr, xp_ptr, k, stride_x, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    """Columns pid1*BLOCK .. +BLOCK of row pid0 of x (bf16 or fp32) as the FP4 expert GEMV reads them: x 2^6
    (exact), quantized first when QUANT (``_activation``, BLOCK = 128), stored fp32 in planes: column c of the row
    at plane c % 8, position c // 8 (xp [rows, 8, k / 8]), the order of the nibbles of a 32-bit weight word."""
    wait_for_previous_kernel()
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = _activation(x_ptr + tl.program_id(0).to(tl.int64) * stride_x + tl.program_id(1) * BLOCK, BLOCK, QUANT)
    tl.store(xp_ptr + tl.program_id(0).to(tl.int64) * k + (c % 8) * (k // 8) + c // 8, x * 64.0)


@triton.jit
def _fp4_expert_kernel(xp_ptr, e_ptr, w_ptr, s_ptr, out_ptr, n, slots, k_split: tl.constexpr, PLANE: tl.constexpr,
                       stride_x, stride_we, stride_wn, stride_se, stride_sn, BN: tl.constexpr, BB: tl.constexpr,
                       EVEN: tl.constexpr, FINAL: tl.constexpr):
    """Rows pid0*BN .. +BN of slot pid1's output over the pid2-th slice of k (``k_split`` weights), BB blocks of
    32 weights per step. The codes are read as 32-bit words of eight nibbles (weight 8j + i at bits 4i..4i+3);
    by bit moves on whole words the even and the odd nibbles become the e4m3 bytes of their values x 2^-6 (e2m1
    magnitude bits << 2, the sign to bit 7; e = 0 lands on e4m3's subnormals), converted by the hardware four
    at a time (``_four_e4m3``). x comes prepared (``_fp4_input_kernel``: x 2^6, fp32, plane i holding the columns
    8j + i, planes ``PLANE`` = k / 8 floats apart), so every product is the exact code value x x and x is read with
    vector loads, once per thread for all its rows. Per row and 32-weight block the products are summed (FMA
    chains over the 8 planes, then the 4 words), scaled by the block's e8m0 byte made fp32 (``e8m0_scale``: 2^(b
    - 127) exactly, NaN for 255) and added to that block column's sum; the columns are added once at the end.
    Each step loads the next step's codes and scales before it decodes its own (two steps in flight per thread).
    EVEN: n a multiple of BN (no row masks). FINAL: bf16 y, else fp32 partial sums [splits, slots, n]."""
    wait_for_previous_kernel()
    slot = tl.program_id(1)
    e = tl.load(e_ptr + slot).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    ok = rows < n
    words = tl.arange(0, 4 * BB)
    w_base = w_ptr + e * stride_we + rows[:, None] * stride_wn + words[None, :]
    s_base = s_ptr + e * stride_se + rows[:, None] * stride_sn + tl.arange(0, BB)[None, :]
    x_base = xp_ptr + slot * stride_x + words
    rows_ok = ok[:, None] | EVEN  # all true when EVEN: folded away
    b_begin = tl.program_id(2) * (k_split // 32)
    acc = tl.zeros([BN, BB], dtype=tl.float32)
    b_last = b_begin + k_split // 32 - BB  # the last step's blocks (read again by its look-ahead: an L2 hit)
    w_next = tl.load(w_base + 4 * b_begin, mask=rows_ok, other=0)
    s_next = tl.load(s_base + b_begin, mask=rows_ok, other=127)
    for bb in range(0, k_split // 32, BB):
        b0 = b_begin + bb
        w = w_next.to(tl.uint32, bitcast=True)
        s = e8m0_scale(s_next)
        ahead = tl.minimum(b0 + BB, b_last)  # the next step's codes, in flight while this step's are used
        w_next = tl.load(w_base + 4 * ahead, mask=rows_ok, other=0)
        s_next = tl.load(s_base + ahead, mask=rows_ok, other=127)
        lo0, lo1, lo2, lo3 = _four_e4m3(((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080))  # weights 0, 2, 4, 6
        hi0, hi1, hi2, hi3 = _four_e4m3(((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080))  # weights 1, 3, 5, 7
        x = x_base + 4 * b0
        p = lo0 * tl.load(x)[None, :]
        p += hi0 * tl.load(x + PLANE)[None, :]
        p += lo1 * tl.load(x + 2 * PLANE)[None, :]
        p += hi1 * tl.load(x + 3 * PLANE)[None, :]
        p += lo2 * tl.load(x + 4 * PLANE)[None, :]
        p += hi2 * tl.load(x + 5 * PLANE)[None, :]
        p += lo3 * tl.load(x + 6 * PLANE)[None, :]
        p += hi3 * tl.load(x + 7 * PLANE)[None, :]
        acc += tl.sum(tl.reshape(p, [BN, BB, 4]), axis=2) * s
    y = tl.sum(acc, axis=1)
    if FINAL:  # rounded from the bits (the interpreter's own conversion truncates)
        tl.store(out_ptr + slot * n + rows, bf16_rne(y).to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + (tl.program_id(2) * slots + slot) * n + rows, y, mask=ok)


def _fp4_input(x: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, int]:
    """x [s, k] as ``_fp4_expert_kernel`` reads it (``_fp4_input_kernel``: x 2^6 in planes, quantized first when
    ``quantize``), one launch: (xp fp32 [rows, k], the slots' row stride in xp). A row repeated for every slot
    (stride 0, one token's experts) is prepared once and read with stride 0."""
    slots, k = x.shape
    rows = 1 if x.stride(0) == 0 else slots
    xp = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    block = FP8_BLOCK if k % FP8_BLOCK == 0 else 32
    _fp4_input_kernel[(rows, k // block)](x, xp, k, x.stride(0), BLOCK=block, QUANT=quantize, num_warps=1,
                                          **PDL_LAUNCH)
    return xp, 0 if rows == 1 else k


def _fp4_words(packed: torch.Tensor) -> torch.Tensor:
    """The packed FP4 codes [E, n, k/2] (uint8) as 32-bit words [E, n, k/8] (a view where the strides allow it)."""
    w = packed.view(torch.uint8)
    try:
        return w.view(torch.int32)
    except RuntimeError:  # an offset or stride not a multiple of 4 bytes
        return w.contiguous().view(torch.int32)


def fp4_expert_linear(xq: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
                      quantize: bool = False, bn: int = 32, bb: int = 8, splits: int | None = None,
                      num_warps: int = 4) -> torch.Tensor:
    """For each slot s: xq[s] [k] @ W[experts[s]]^T -> bf16 [slots, n], W[e] = FP4 codes packed [E, n, k/2] (uint8)
    x 1x32 scales as stored, e8m0 bytes uint8 [E, n, k/32] (``2^(b - 127)``, 255 NaN). ``experts`` int [slots] on
    the device (not read on the host); ``quantize`` and ``splits`` as in :func:`fp8_weight_linear` (``quantize``
    needs k a multiple of 128). Two launches (x prepared, then the GEMV; a third adds the k slices' sums):
    ``bn`` output rows and ``bb`` blocks of 32 weights per program and step."""
    slots, k = xq.shape
    e_count, n, half = packed.shape
    if scales.dtype != torch.uint8:
        raise ValueError(f"fp4_expert_linear: scales: expected e8m0 scale bytes uint8 [{e_count}, {n}, {k // 32}], "
                         f"found {scales.dtype} {list(scales.shape)}")
    if half * 2 != k or k % 32 or scales.shape != (e_count, n, k // 32) or experts.shape != (slots,):
        raise ValueError(f"fp4_expert_linear: expected xq [s, k], experts [s], packed [E, n, k/2], scales [E, n, "
                         f"k/32] with k % 32 == 0, found xq {tuple(xq.shape)}, experts {tuple(experts.shape)}, "
                         f"packed {tuple(packed.shape)}, scales {tuple(scales.shape)}")
    if quantize and k % FP8_BLOCK:
        raise ValueError(f"fp4_expert_linear: quantize needs k a multiple of 128, found {k}")
    blocks = k // 32
    while blocks % bb:
        bb //= 2
    programs = triton.cdiv(n, bn) * slots
    splits = splits or k_slices(programs, blocks, bb, _sm_count(xq.device))
    while blocks % (splits * bb) and bb > 1:
        bb //= 2
    if blocks % (splits * bb):
        raise ValueError(f"fp4_expert_linear: splits {splits} must divide k / 32 ({blocks})")
    xp, stride_x = _fp4_input(_rows(xq) if quantize else _as_loaded(xq), quantize)
    w = _fp4_words(packed)
    s = scales if scales.stride(-1) == 1 else scales.contiguous()
    y = torch.empty((slots, n), dtype=torch.bfloat16, device=xq.device)
    partials = torch.empty((splits, slots, n), dtype=torch.float32, device=xq.device) if splits > 1 else None
    grid = (triton.cdiv(n, bn), slots, splits)
    _fp4_expert_kernel[grid](xp, experts, w, s, y if partials is None else partials, n, slots, k // splits, k // 8,
                             stride_x, w.stride(0), w.stride(1), s.stride(0), s.stride(1), BN=bn, BB=bb,
                             EVEN=n % bn == 0, FINAL=partials is None, num_warps=num_warps, **PDL_LAUNCH)
    return _finish(partials, y, splits)


def takes_fp8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, act: str = "fp8",
                            groups: int = 1) -> str | None:
    """Why :func:`fp8_weight_linear_cuda` cannot take these inputs (None: it can): bf16 x of 1..GEMV_ROWS rows."""
    m, n = x.shape[0], codes.shape[0]
    if act not in ("fp8", "bf16") or x.dtype != torch.bfloat16 or not 1 <= m <= GEMV_ROWS or \
            codes.shape[1] % FP8_BLOCK or n % groups or (n // groups) % 16 or not on_device(x):
        return UNSUPPORTED
    return None


def fp8_weight_linear_cuda(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, act: str = "fp8",
                           groups: int = 1) -> torch.Tensor:
    """Same signature and result (within the ``act_linear`` contract) as ``ops.fp8_weight_linear``: the FP8 GEMV
    with the 1x128 activation quantization in the same launch (``act == "fp8"``; ``"bf16"``: x as given)."""
    return fp8_weight_linear(x, codes, scales, quantize=act == "fp8", groups=groups)


def takes_fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`fp32_linear_cuda` cannot take these inputs (None: it can): a bf16 weight, 1..GEMV_ROWS rows."""
    m, k = x.shape
    if weight.dtype != torch.bfloat16 or not 1 <= m <= GEMV_ROWS or k % FP8_BLOCK or not on_device(x):
        return UNSUPPORTED
    return None


def fp32_linear_cuda(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same signature and result (within its contract) as ``ops.fp32_linear``: one GEMV over the bf16 weight."""
    return bf16_weight_linear_f32(x, weight)


def takes_fp4_picked_linear(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                            act: str = "fp8") -> str | None:
    """Why :func:`fp4_picked_linear_cuda` cannot take these inputs (None: it can): act "fp8", bf16 x of
    1..8 GEMV_ROWS rows, k a multiple of 32. Inputs of a wrong dtype or shape raise (``check_fp4_picked_linear``:
    packed codes uint8 [E, n, k/2], e8m0 scale bytes uint8 [E, n, k/32])."""
    check_fp4_picked_linear(x, experts, packed, scales)
    s, k = x.shape
    if act != "fp8" or x.dtype != torch.bfloat16 or not 1 <= s <= 8 * GEMV_ROWS or k % 32 or not on_device(x):
        return UNSUPPORTED
    return None


def fp4_picked_linear_cuda(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                           act: str = "fp8") -> torch.Tensor:
    """Same signature and result (within the ``act_linear`` contract) as ``ops.fp4_picked_linear``."""
    if x.shape[1] % FP8_BLOCK:
        return fp4_expert_linear(fake_quant_fp8(x, 128), experts, packed, scales)
    return fp4_expert_linear(x, experts, packed, scales, quantize=True)
