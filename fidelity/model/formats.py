"""Bit-exact number formats of the official DeepSeek-V4 reference (spec §2 storage, spec §3 kernel.py numerics).

Everything here is plain torch on CPU, vectorised, and works on any leading shape.

Formats
-------
* bf16: :func:`round_bf16` (round to nearest, ties to even; one rounding step even for fp64 input).
* ue8m0 / e8m0: power-of-two scales.  :func:`ue8m0_scale` reproduces ``fast_round_scale`` of kernel.py:
  ``v = fp32(amax_clamped * fp32(1/qmax))`` then ``2^(exp(v) - 127 + (mantissa(v) != 0))`` from the fp32 bits
  (``fast_log2_ceil``).  For qmax=6 this gives exactly the spec's ``2^ceil(log2(amax/6))``, and for qmax=448
  the fp32 product with ``fp32(1/448)`` gives the same power of two as the division would, for every normal
  fp32 ``amax`` (tests check every mantissa of a binade; power-of-two scaling carries it to the rest).  Bytes
  are the biased exponent (byte ``b`` is ``2^(b-127)``, ``0xFF`` is NaN), i.e. the bits of
  ``torch.float8_e8m0fnu``.
* Scale floor (``floor_on``, FP8 only): ``"amax"`` is the official rule above (the amax floored at 1e-4 before
  the division); ``"scale"`` is FlashMLA's (``max(amax / 448, 1e-4)``, then the same power-of-two rounding).  The
  two give the same scale, hence the same codes, for every block with ``amax > 448 * 2^-14`` (0.02734; they
  agree on ``v`` from ``amax >= 448e-4 = 0.0448`` and on ``2^ceil(log2 v)`` below that down to 448 * 2^-14);
  below it FlashMLA's scale stays 2^-13 where the official one shrinks with the amax (down to 2^-22).
  :func:`fp8_scale_follows_rule` says whether stored bytes can come from a rule.
* FP8 e4m3 (``torch.float8_e4m3fn``): RNE, saturating: the value is clamped to [-448, 448] before rounding,
  as the reference does (a raw ml_dtypes cast of 464 or more gives NaN; torch's cast has varied by version).
* FP4 e2m1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, RNE with ties to the even code, clamped to [-6, 6].
  Nibble code = sign (bit 3) | magnitude index (0..7); two codes per byte, low nibble = element 2i.
* :func:`hadamard`: Sylvester-order Walsh-Hadamard transform scaled by n^-0.5 (spec §3 ``rotate_activation``).

Arithmetic
----------
bf16/fp16/fp32 inputs are upcast to fp32 (exact), fp64 inputs stay fp64.  The block amax is rounded to fp32
(RNE) before the scale rule, which is always evaluated in fp32.  ``x / s`` is exact (s is a power of two) and
is rounded onto the FP8/FP4 grid in one step from the working dtype (no double rounding through fp32 for fp64
input).  Dequantization is ``fp32(code) * fp32(s)``, then a cast to the caller's dtype; this is exact except
that it overflows to +-inf for ``|x| >= 248 * 2^120`` (FP8) or ``|x| >= 3.5 * 2^126`` (FP4), as the fp32
reference does.  Dequantized bf16 values are exact, so ``fake_quant_*`` of a bf16 tensor equals the
reference's in-place ``act_quant`` (current revision) / ``fp4_act_quant``.

NaN / Inf
---------
Non-finite values poison their own block and nothing else:

* NaN in a block: the amax is NaN, so the scale is NaN (byte ``0xFF``); every FP8 code of that block is NaN;
  every FP4 code of that block is ``0x7`` (e2m1 has no NaN; the code is irrelevant because the scale byte is
  NaN); all dequantized / fake-quantized values of the block are NaN.
* +-Inf in a block (no NaN): ``amax * (1/qmax)`` is +inf, ``fast_log2_ceil`` gives 128 and the fp32 scale is
  +inf (as ``fast_pow2(128)`` in the reference), stored as byte ``0xFF`` (e8m0 has no inf).  Finite elements
  get code +-0 (``x / inf``), the infinite ones NaN (FP8) or ``0x7`` (FP4); all dequantized /
  fake-quantized values of the block are NaN (``0 * inf`` and ``NaN``).
* fp64 input whose block amax exceeds the fp32 range behaves like +-Inf (fp32(amax) = +inf).
* :func:`round_bf16` keeps NaN and +-inf and rounds finite values past the bf16 range to +-inf (RNE).
* :func:`round_fp8_e4m3` / :func:`round_fp4_e2m1` keep NaN and saturate +-inf to +-448 / +-6.
* :func:`hadamard` spreads a non-finite value over its whole row: a NaN makes every output NaN, a single
  +-Inf makes every output +-inf, several Infs can give NaN (Inf - Inf).

The CUDA kernel's ``T.max`` / ``T.clamp`` may have ``fmaxf`` semantics (NaN dropped from the amax); that
cannot be checked on CPU, so this module propagates NaN as described instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = [
    "E8M0_NAN",
    "FP4_AMAX_FLOOR",
    "FP4_BLOCK",
    "FP4_MAX",
    "FP4_VALUES",
    "FP8_ACT_BLOCKS",
    "FP8_AMAX_FLOOR",
    "FP8_MAX",
    "FP8_WEIGHT_BLOCK",
    "SCALE_FLOORS",
    "Block",
    "decode_e8m0",
    "dequantize_fp4",
    "dequantize_fp8",
    "encode_e8m0",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "fp4_code_values",
    "fp8_scale_follows_rule",
    "hadamard",
    "pack_fp4_codes",
    "quantize_fp4",
    "quantize_fp8",
    "round_bf16",
    "round_fp4_e2m1",
    "round_fp8_e4m3",
    "ue8m0_scale",
    "unpack_fp4_codes",
]

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4  # applied as the fp32 value nearest 1e-4, like the kernel's constant
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP8_ACT_BLOCKS = (32, 64, 128)
FP8_WEIGHT_BLOCK = (128, 128)
FP4_BLOCK = 32
E8M0_NAN = 0xFF
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# where the FP8 scale rule applies its floor: "amax" (official kernel.py: max(amax, floor) / qmax) or "scale"
# (FlashMLA: max(amax / qmax, floor)); see ``ue8m0_scale``
SCALE_FLOORS = ("amax", "scale")

Block = int | tuple[int, int]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    """Raise ValueError unless ``x`` is a floating tensor of a supported dtype with at least one dim."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype in {_FLOAT_DTYPES}, found {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: expected at least 1 dim, found a 0-d tensor")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Working precision: fp64 for fp64 input, fp32 otherwise (bf16/fp16 upcast exactly)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2^e`` built from bits.  e: int tensor; fp32 supports e in [-149, 127], fp64 e in [-1022, 1023]."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    e = e.to(torch.int32)
    normal = ((e.clamp(min=-126) + 127) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def _round_to_grid(v: torch.Tensor, mant_bits: int, min_exp: int) -> torch.Tensor:
    """Round ``v`` (fp32/fp64) to the nearest value with ``mant_bits`` fraction bits, ties to even.

    The grid is that of a binary float with minimum normal exponent ``min_exp`` (subnormals included) and
    unbounded range; callers clamp or handle overflow.  Exact: only power-of-two scalings and ``torch.round``
    (half to even).  Signed zeros and NaN propagate; the caller's value range must keep
    ``2^(mant_bits - floor(log2|v|))`` representable in ``v.dtype``.
    """
    _, e = torch.frexp(v)  # v = m * 2^e, |m| in [0.5, 1)
    e = torch.clamp(e.to(torch.int32) - 1, min=min_exp)  # floor(log2|v|), at least the min normal exponent
    shift = mant_bits - e
    return torch.round(v * _pow2(shift, v.dtype)) * _pow2(-shift, v.dtype)


@functools.lru_cache(maxsize=64)
def _fp32_const(value: float) -> torch.Tensor:
    """A 0-d fp32 tensor holding ``value`` rounded to fp32 (the kernel's immediate); one per value, shared: an
    operand, never written."""
    return torch.tensor(value, dtype=torch.float32)


def _act_block(x: torch.Tensor, block: object, allowed: tuple[int, ...]) -> int:
    """Validate an activation-style block size along the last dim of ``x``; returns it."""
    if isinstance(block, bool) or not isinstance(block, int) or block not in allowed:
        raise ValueError(f"block: expected one of {allowed}, found {block!r}")
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dim must be a multiple of block: expected K % {block} == 0, found K={k}")
    return block


def _fp8_block(x: torch.Tensor, block: object) -> Block:
    """Validate an FP8 block spec: an int in FP8_ACT_BLOCKS, or FP8_WEIGHT_BLOCK for a 2-D tensor."""
    if isinstance(block, (tuple, list)):
        if tuple(block) != FP8_WEIGHT_BLOCK:
            raise ValueError(f"block: expected {FP8_WEIGHT_BLOCK} or one of {FP8_ACT_BLOCKS}, found {block!r}")
        if x.dim() != 2:
            raise ValueError(f"block {FP8_WEIGHT_BLOCK}: expected a 2-D [out, in] tensor, found shape {tuple(x.shape)}")
        return FP8_WEIGHT_BLOCK
    return _act_block(x, block, FP8_ACT_BLOCKS)


def _scale_shape(shape: torch.Size, block: Block) -> tuple[int, ...]:
    """Shape of the scale tensor for a tensor of ``shape`` quantized with ``block``."""
    if isinstance(block, tuple):
        return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    return (*shape[:-1], shape[-1] // block)


def _blockwise(
    x: torch.Tensor, block: Block, qmax: float, floor: float, round_fn: Callable[[torch.Tensor], torch.Tensor],
    floor_on: str = "amax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared quantizer: returns (grid values ``round_fn(clamp(x/s))`` in the working dtype, x's shape;
    fp32 scales of shape ``_scale_shape``; the scale rule of ``ue8m0_scale(..., floor_on)``).  ``s`` may be
    +inf / NaN for non-finite blocks."""
    xw = x.to(_work_dtype(x.dtype))
    if isinstance(block, tuple):
        (bo, bi), (rows, cols) = block, xw.shape
        nbo, nbi = _scale_shape(xw.shape, block)
        xp = torch.nn.functional.pad(xw, (0, nbi * bi - cols, 0, nbo * bo - rows)).view(nbo, bo, nbi, bi)
        s = ue8m0_scale(xp.abs().amax(dim=(1, 3)), qmax, floor, floor_on)
        q = round_fn(xp / s.to(xw.dtype)[:, None, :, None])
        return q.reshape(nbo * bo, nbi * bi)[:rows, :cols], s
    xb = xw.unflatten(-1, (xw.shape[-1] // block, block))
    s = ue8m0_scale(xb.abs().amax(dim=-1), qmax, floor, floor_on)
    q = round_fn(xb / s.to(xw.dtype)[..., None])
    return q.flatten(-2), s


def _times_scales(v: torch.Tensor, s: torch.Tensor, block: Block) -> torch.Tensor:
    """``v * s`` with each per-block scale of ``s`` broadcast over its block of ``v`` (fp32; ragged edge blocks of a
    2-D block cropped). A view, not a copy of the scales at element size, where the blocks tile ``v`` exactly."""
    if isinstance(block, tuple):
        (bo, bi), (rows, cols) = block, v.shape
        if rows % bo == 0 and cols % bi == 0:
            return (v.view(rows // bo, bo, cols // bi, bi) * s[:, None, :, None]).view(rows, cols)
        full = s.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)
        return v * full[:rows, :cols]
    return (v.unflatten(-1, (v.shape[-1] // block, block)) * s[..., None]).flatten(-2)


def _scale_bytes(scales: torch.Tensor, expected: tuple[int, ...], name: str = "scales") -> torch.Tensor:
    """Validate a ue8m0 scale tensor (uint8 or float8_e8m0fnu) of ``expected`` shape; return its uint8 bytes."""
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise ValueError(f"{name}: expected dtype uint8 or float8_e8m0fnu, found {scales.dtype}")
    if tuple(scales.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, found {tuple(scales.shape)}")
    return scales


# --------------------------------------------------------------------------------------------------------------
# element formats
# --------------------------------------------------------------------------------------------------------------


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest bf16 value (RNE), returned in x's dtype (spec §3/§4: every bf16 store).

    x: float tensor of any shape (fp16/bf16/fp32/fp64).  fp64 is rounded in one step (torch's and ml_dtypes'
    fp64->bf16 casts round twice, through fp32).  Finite values past the bf16 range become +-inf; NaN stays NaN.
    """
    _check_float(x)
    if x.dtype != torch.float64:
        return x.to(torch.bfloat16).to(x.dtype)
    r = _round_to_grid(x, 7, -126)
    return torch.where(r.abs() >= 2.0**128, torch.copysign(torch.full_like(r, float("inf")), r), r)


def round_fp8_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Saturating RNE onto the e4m3fn grid: ``e4m3(clamp(v, -448, 448))`` as values in v's dtype (spec §3).

    v: fp32 or fp64 tensor, any shape.  Subnormals (multiples of 2^-9 below 2^-6), signed zeros and NaN are
    kept; +-inf saturates to +-448.  The result is exactly representable in ``torch.float8_e4m3fn``.
    """
    if v.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"v: expected dtype float32 or float64, found {v.dtype}")
    if v.dtype == torch.float32:  # torch's fp32 -> e4m3fn cast rounds to nearest even (checked against ml_dtypes)
        return torch.clamp(v, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return _round_to_grid(torch.clamp(v, -FP8_MAX, FP8_MAX), 3, -6)  # fp64: one rounding, not two through fp32


def round_fp4_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Saturating RNE onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (with sign), values in v's dtype (spec §3).

    v: fp32 or fp64 tensor, any shape.  Ties go to the even code (.25->0, .75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4); signed zeros and NaN are kept; |v| > 6 (and +-inf) saturates to +-6.
    """
    if v.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"v: expected dtype float32 or float64, found {v.dtype}")
    return _round_to_grid(torch.clamp(v, -FP4_MAX, FP4_MAX), 1, 0)


# --------------------------------------------------------------------------------------------------------------
# ue8m0 scales
# --------------------------------------------------------------------------------------------------------------


def ue8m0_scale(amax: torch.Tensor, qmax: float, floor: float, floor_on: str = "amax") -> torch.Tensor:
    """Power-of-two block scale of kernel.py ``fast_round_scale`` (spec §3), as fp32, amax's shape.

    amax: block absolute maxima, any float dtype (rounded to fp32 first).  ``floor_on="amax"`` (the official
    rule): ``a = max(amax, fp32(floor))``, ``v = fp32(a * fp32(1/qmax))``; ``floor_on="scale"`` (FlashMLA's KV
    quantizer): ``v = max(fp32(amax * fp32(1/qmax)), fp32(floor))``.  Then scale ``= 2^(exp(v) - 127 +
    (mantissa(v) != 0))`` from v's bits, i.e. ``2^ceil(log2 v)`` for normal v.  Use (FP8_MAX, FP8_AMAX_FLOOR) for
    FP8 and (FP4_MAX, FP4_AMAX_FLOOR) for FP4 (where this equals ``2^ceil(log2(a/6))`` exactly).  A subnormal v
    gives 2^-126 and v == 0 gives 2^-127 (bit rule; unreachable with the reference floors).  +inf amax gives
    +inf, NaN amax gives NaN (either rule).
    """
    if not (qmax > 0 and qmax < float("inf")):
        raise ValueError(f"qmax: expected a finite positive number, found {qmax!r}")
    if not (floor > 0 and floor < float("inf")):
        raise ValueError(f"floor: expected a finite positive number, found {floor!r}")
    _check_floor_on(floor_on)
    if floor_on == "amax":
        v = torch.maximum(amax.to(torch.float32), _fp32_const(floor)) * _fp32_const(1.0 / qmax)
    else:
        v = torch.maximum(amax.to(torch.float32) * _fp32_const(1.0 / qmax), _fp32_const(floor))
    # kernel.py ``fast_log2_ceil`` as bits: a mantissa other than zero carries into the exponent field, which is
    # then the scale's (a normal or subnormal v > 0: 2^ceil(log2 v), 2^-126 at least; past 2^127 the field is
    # all ones, +inf); v == 0 gives 2^-127, a NaN v NaN
    s = ((v.contiguous().view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(v > 0, s, torch.where(v == 0, 2.0**-127, v))


def _check_floor_on(floor_on: object) -> None:
    if floor_on not in SCALE_FLOORS:
        raise ValueError(f"floor_on: expected one of {SCALE_FLOORS}, found {floor_on!r}")


def encode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Biased-exponent byte (uint8, scale's shape) of power-of-two scales: byte ``b`` <=> ``2^(b-127)``.

    scale: float tensor of powers of two in [2^-127, 2^127]; NaN and +-inf map to 0xFF (e8m0fnu NaN).  The
    bytes equal ``scale.to(torch.float8_e8m0fnu).view(torch.uint8)`` for these values.  Anything else
    (non-power-of-two, zero, negative, out of range) raises ValueError naming the first offender.
    """
    if not isinstance(scale, torch.Tensor) or scale.dtype not in _FLOAT_DTYPES:
        found = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale: expected a floating tensor, found {found}")
    s = scale.to(torch.float32)
    bits = s.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    nonfinite = exp == 0xFF
    normal_pow2 = (bits > 0) & (exp > 0) & (man == 0)
    sub_2m127 = bits == 0x00400000
    ok = nonfinite | normal_pow2 | sub_2m127
    if not bool(ok.all()):
        bad = s[~ok].flatten()[0].item()
        raise ValueError(f"scale: expected powers of two in [2^-127, 2^127] or NaN/Inf, found {bad!r}")
    return _e8m0_bytes(s)


def _e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    """:func:`encode_e8m0` of fp32 scales already known to be valid (``ue8m0_scale``'s), with no host read of
    the values (a quantizer inside a CUDA-graph-captured decode step must not sync)."""
    bits = s.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return torch.where(exp == 0xFF, E8M0_NAN, torch.where(bits == 0x00400000, 0, exp)).to(torch.uint8)


def decode_e8m0(b: torch.Tensor) -> torch.Tensor:
    """fp32 value of e8m0 bytes (uint8 or torch.float8_e8m0fnu, any shape): ``2^(b-127)``, 0xFF -> NaN."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    if b.dtype != torch.uint8:
        raise ValueError(f"b: expected dtype uint8 or float8_e8m0fnu, found {b.dtype}")
    e = b.to(torch.int32)
    s = _pow2(e - 127, torch.float32)
    return torch.where(e == E8M0_NAN, torch.full_like(s, float("nan")), s)


# --------------------------------------------------------------------------------------------------------------
# FP8 e4m3 blocks
# --------------------------------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, block: Block, floor_on: str = "amax") -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 e4m3 quantization with ue8m0 scales (spec §3 ``act_quant``, spec §2 weight layout).

    x: float tensor.  ``block`` an int in (32, 64, 128): blocks of contiguous elements along the last dim
    (K must be a multiple), scales [..., K/block].  ``block=(128, 128)``: x must be 2-D [out, in], scales
    [ceil(out/128), ceil(in/128)], edge blocks may be ragged.  Floor 1e-4 on the amax (``floor_on="amax"``, the
    official rule) or on the scale (``"scale"``, FlashMLA's), scale rule of :func:`ue8m0_scale` with qmax 448,
    codes ``e4m3(clamp(x/s, -448, 448))`` (RNE).
    Returns (codes: float8_e4m3fn, x's shape; scales: uint8 e8m0 bytes).
    """
    _check_float(x)
    block = _fp8_block(x, block)
    q, s = _blockwise(x, block, FP8_MAX, FP8_AMAX_FLOOR, round_fp8_e4m3, floor_on)
    return q.to(torch.float8_e4m3fn), _e8m0_bytes(s.to(torch.float32))


def _fp8_code_bits(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (float8_e4m3fn, or their uint8 bits) as uint8 bits; ValueError for another dtype or a 0-d tensor."""
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected dtype float8_e4m3fn (or uint8 bits), found {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("codes: expected at least 1 dim, found a 0-d tensor")
    return codes


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, block: Block) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``fp32(code) * 2^(scale_byte-127)`` as fp32, codes' shape (exact).

    codes: float8_e4m3fn (or its uint8 bits); scales: uint8 or float8_e8m0fnu with the shape
    :func:`quantize_fp8` produces for ``block``.  A 0xFF scale byte makes its block NaN.
    """
    codes = _fp8_code_bits(codes).view(torch.float8_e4m3fn)
    block = _fp8_block(codes, block)
    sb = _scale_bytes(scales, _scale_shape(codes.shape, block))
    return _times_scales(codes.to(torch.float32), decode_e8m0(sb), block)


def fake_quant_fp8(x: torch.Tensor, block: Block, floor_on: str = "amax") -> torch.Tensor:
    """FP8 quantize-dequantize in x's dtype: the reference's in-place ``act_quant`` (current rev., spec §3).

    x: float tensor, same block rules as :func:`quantize_fp8` (``floor_on``: its scale rule).  Result
    ``dtype(fp32(q) * s)``; for a bf16 x and ``floor_on="amax"`` this is bit-identical to ``act_quant(x, block,
    "ue8m0", inplace=True)``.  Always equals ``dequantize_fp8(*quantize_fp8(x, block, floor_on), block).to(x.dtype)``.
    """
    _check_float(x)
    block = _fp8_block(x, block)
    q, s = _blockwise(x, block, FP8_MAX, FP8_AMAX_FLOOR, round_fp8_e4m3, floor_on)
    return _times_scales(q.to(torch.float32), s, block).to(x.dtype)


def fp8_scale_follows_rule(codes: torch.Tensor, scales: torch.Tensor, block: int,
                           floor_on: str = "amax") -> torch.Tensor:
    """bool [..., K/block]: whether each block's stored ue8m0 scale is one the FP8 rule ``floor_on`` gives
    (:func:`ue8m0_scale` with qmax 448, floor 1e-4) for some block amax that rounds onto the block's largest
    |code| at that scale; i.e. whether a quantizer with that rule can have written these bytes, whatever the
    unrounded values were (spec §3 scales; §5 FP8 KV rows).

    codes: float8_e4m3fn (or its uint8 bits) [..., K]; scales: uint8 / float8_e8m0fnu [..., K/block]; ``block``
    an int in (32, 64, 128).  With m the largest |code| and [lo, hi] its rounding interval on the e4m3 grid
    (midpoints to the neighbouring codes; 0 to 2^-10 for m = 0, up to +inf for m = 448), the rule's scale is
    monotone in the amax, so the answer is ``rule(s * lo) <= s <= rule(s * hi)``.  Both ends are taken closed,
    so an amax exactly on a rounding tie is allowed either way.  Bytes re-quantized from already rounded values
    (a block whose largest value rounded down to 224 s, stored again at s / 2) follow the rule too.  A NaN code
    or scale byte (0xFF) never does.
    """
    codes = _fp8_code_bits(codes)
    block = _act_block(codes, block, FP8_ACT_BLOCKS)
    sb = _scale_bytes(scales, _scale_shape(codes.shape, block))
    _check_floor_on(floor_on)
    mag = (codes & 0x7F).unflatten(-1, (codes.shape[-1] // block, block)).amax(-1).to(torch.int32)  # e4m3 order
    nan = mag == 0x7F
    mag = mag.clamp(max=0x7E)

    def value(bits: torch.Tensor) -> torch.Tensor:
        return bits.clamp(0, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)

    m = value(mag)
    lo = torch.where(mag > 0, (value(mag - 1) + m) * 0.5, 0.0)
    hi = torch.where(mag < 0x7E, (m + value(mag + 1)) * 0.5, float("inf"))
    s = decode_e8m0(sb)
    low, high = (ue8m0_scale(s * bound, FP8_MAX, FP8_AMAX_FLOOR, floor_on) for bound in (lo, hi))
    return (low <= s) & (s <= high) & ~nan & ~torch.isnan(s)


# --------------------------------------------------------------------------------------------------------------
# FP4 e2m1 blocks
# --------------------------------------------------------------------------------------------------------------


def _fp4_codes(q: torch.Tensor) -> torch.Tensor:
    """Nibble codes (uint8 0..15) of e2m1 grid values q (fp32/fp64); NaN -> 0x7."""
    a = q.abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a * 0.5 + 4))
    nan = torch.isnan(q)
    idx = torch.where(nan, 7.0, idx).to(torch.uint8)
    sign = (torch.signbit(q) & ~nan).to(torch.uint8) << 3
    return idx | sign


def fp4_code_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each e2m1 nibble code (0..15; code 8 is -0.0), computed from its bits on the codes' device
    (no table copied from the host, so a CUDA-graph capture can run it): exponent field e, mantissa bit m,
    ``(m / 2) * 2^0`` for e = 0, ``(1 + m / 2) * 2^(e - 1)`` otherwise."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, (1.0 + m * 0.5) * torch.exp2((e - 1).to(torch.float32)))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack nibble codes uint8 [..., K] (values 0..15, K even) into uint8 [..., K/2] (spec §2).

    Byte i holds element 2i in the low nibble and element 2i+1 in the high nibble.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected dtype uint8, found {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        found = "a 0-d tensor" if codes.dim() == 0 else f"K={codes.shape[-1]}"
        raise ValueError(f"codes: expected an even last dim, found {found}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: expected nibble values 0..15, found max {int(codes.max())}")
    return _pack_nibbles(codes)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """:func:`pack_fp4_codes` without the checks (no host read of the codes: quantize_fp4 makes codes 0..15)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 [..., K/2] into nibble codes uint8 [..., K] (low nibble first; spec §2 convert.py).

    Also accepts int8 (checkpoint storage) and torch.float4_e2m1fn_x2, read as their raw bytes.
    """
    if packed.dtype == torch.int8 or packed.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected dtype uint8, int8 or float4_e2m1fn_x2, found {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed: expected at least 1 dim, found a 0-d tensor")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_fp4(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP4 e2m1 quantization along the last dim (spec §3 ``fp4_act_quant``, spec §2 expert layout).

    x: float tensor [..., K], K a multiple of 32 (block must be 32).  amax floor 6*2^-126, scale
    ``2^ceil(log2(amax/6))`` (:func:`ue8m0_scale` with qmax 6), codes ``e2m1(clamp(x/s, -6, 6))`` (RNE).
    Returns (packed: uint8 [..., K/2], low nibble = element 2i; scales: uint8 e8m0 [..., K/32]).
    """
    _check_float(x)
    block = _act_block(x, block, (FP4_BLOCK,))
    q, s = _blockwise(x, block, FP4_MAX, FP4_AMAX_FLOOR, round_fp4_e2m1)
    return _pack_nibbles(_fp4_codes(q)), _e8m0_bytes(s.to(torch.float32))


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`: fp32 [..., K] from packed [..., K/2] and scales [..., K/32] (exact).

    packed: uint8 / int8 / float4_e2m1fn_x2; scales: uint8 or float8_e8m0fnu.  A 0xFF scale makes its block NaN.
    """
    codes = unpack_fp4_codes(packed)
    block = _act_block(codes, block, (FP4_BLOCK,))
    sb = _scale_bytes(scales, _scale_shape(codes.shape, block))
    table = fp4_code_values(torch.arange(16, dtype=torch.uint8, device=codes.device))  # the 16 code values
    return _times_scales(table[codes.to(torch.int64)], decode_e8m0(sb), block)


def fake_quant_fp4(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """FP4 quantize-dequantize in x's dtype: the reference's ``fp4_act_quant(x, 32, inplace=True)`` (spec §3).

    x: float tensor [..., K], K a multiple of 32.  Result ``dtype(fp32(q) * s)``; always equals
    ``dequantize_fp4(*quantize_fp4(x, block), block).to(x.dtype)``.
    """
    _check_float(x)
    block = _act_block(x, block, (FP4_BLOCK,))
    q, s = _blockwise(x, block, FP4_MAX, FP4_AMAX_FLOOR, round_fp4_e2m1)
    return _times_scales(q.to(torch.float32), s, block).to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# Hadamard
# --------------------------------------------------------------------------------------------------------------


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform along the last dim, Sylvester order, scaled by n^-0.5 (spec §3 rotate_activation).

    x: float tensor [..., n], n a power of two.  ``y = (H_n @ x) * n^-0.5`` with ``H_1 = [1]``,
    ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; O(n log n) butterflies in fp32 (fp64 for fp64 input), the scale
    applied last as one multiply by the working-dtype constant n^-0.5, result cast to x's dtype.
    """
    _check_float(x)
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"last dim: expected a power of two, found {n}")
    wd = _work_dtype(x.dtype)
    lead = x.shape[:-1]
    y = x.to(wd)
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    y = y.reshape(*lead, n) * torch.tensor(n**-0.5, dtype=wd)
    return y.to(x.dtype)


KV_SCALE_BLOCK = 64  # nope dims of a packed KV row per ue8m0 scale byte


def packed_kv_row_bytes(head_dim: int, rope_dims: int) -> int:
    """Bytes of one KV row in the packed FP8 layout (spec §5; FlashMLA's MODEL1 row): e4m3 codes of the head_dim -
    rope_dims nope dims, the rope dims as bf16, one ue8m0 byte per 64 nope dims, padded to a multiple of 8 (584 at
    head_dim 512, 64 rope dims)."""
    nope = head_dim - rope_dims
    return -(-(nope + 2 * rope_dims + nope // KV_SCALE_BLOCK) // 8) * 8
