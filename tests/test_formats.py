"""Bit-exact tests of fidelity.model.formats (spec §3) against ml_dtypes / numpy / exact rationals as oracles."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fidelity.model import formats as F

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16
EPS32 = float(np.finfo(np.float32).eps)

FAST = settings(max_examples=40)
MEDIUM = settings(max_examples=100)


# ------------------------------------------------------------------------------------------------------------------
# oracles (numpy + ml_dtypes; float32 arithmetic like the reference kernel)
# ------------------------------------------------------------------------------------------------------------------


def _grid(fmt, nbytes: int) -> np.ndarray:
    """Sorted non-negative finite values of a small float format."""
    vals = np.arange(nbytes, dtype=np.uint8).view(fmt).astype(np.float32)
    return np.unique(np.abs(vals[np.isfinite(vals)]))


E4M3_GRID = _grid(E4M3, 256)
E2M1_GRID = _grid(E2M1, 16)
E4M3_MIDS = ((E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2).astype(np.float32)
E2M1_MIDS = ((E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2).astype(np.float32)

FP8 = dict(fmt=E4M3, qmax=448.0, floor=1e-4, grid=E4M3_GRID, mids=E4M3_MIDS, kmax=119)
FP4 = dict(fmt=E2M1, qmax=6.0, floor=6 * 2.0**-126, grid=E2M1_GRID, mids=E2M1_MIDS, kmax=125)


def ref_scale(amax, qmax: float, floor: float) -> np.ndarray:
    """2^ceil(log2(max(amax, floor) / qmax)) in float32 via frexp (FP8: times fp32(1/448) like the kernel;
    FP4: the spec's plain division by 6)."""
    a = np.maximum(np.asarray(amax, dtype=np.float32), np.float32(floor))
    with np.errstate(invalid="ignore", over="ignore"):
        v = a * np.float32(1.0 / qmax) if qmax == 448.0 else a / np.float32(qmax)
    m, e = np.frexp(v.astype(np.float32))
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


def ref_blocks(x32: np.ndarray, block: int, cfg: dict):
    """Reference act-style blockwise quantization: (codes in the ml_dtypes format, scales fp32, dequant fp32)."""
    xb = x32.reshape(*x32.shape[:-1], x32.shape[-1] // block, block)
    s = ref_scale(np.abs(xb).max(axis=-1), cfg["qmax"], cfg["floor"])
    v = np.clip(xb / s[..., None], -cfg["qmax"], cfg["qmax"]).astype(np.float32)
    codes = v.astype(cfg["fmt"])
    deq = codes.astype(np.float32) * s[..., None]
    return codes.reshape(x32.shape), s, deq.reshape(x32.shape)


def e8m0_bytes(s: np.ndarray) -> np.ndarray:
    return np.asarray(s, dtype=np.float32).astype(E8M0).view(np.uint8)


def bits32(a) -> np.ndarray:
    """float32 bit patterns of a torch tensor or numpy array."""
    if isinstance(a, torch.Tensor):
        a = a.to(torch.float32).numpy()
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same_bits(actual, expected) -> None:
    """Equal float32 bits (so +0 != -0), NaN positions equal (NaN payload/sign ignored)."""
    a = actual.to(torch.float32).numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float32)
    e = expected.to(torch.float32).numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected, np.float32)
    assert a.shape == e.shape
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
    ok = ~np.isnan(a)
    np.testing.assert_array_equal(bits32(a[ok]), bits32(e[ok]))


def to_torch(x32: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """x32 must already hold values representable in dtype."""
    return torch.from_numpy(np.ascontiguousarray(x32)).to(dtype)


def bf16_rne_exact(x: float) -> float:
    """Nearest bf16 value of a Python float (ties to even), by exact rational arithmetic."""
    if not math.isfinite(x) or x == 0:
        return x
    _, e = math.frexp(x)
    q = max(e - 1, -126) - 7  # quantum exponent
    y = round(Fraction(x) / Fraction(2) ** q) * Fraction(2) ** q  # Fraction rounds half to even
    if abs(y) >= 2**128:
        return math.copysign(math.inf, x)
    return math.copysign(float(y), x)


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


# ------------------------------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------------------------------


def unit_values(cfg: dict, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Values of x/s (float32): grid points, exact midpoints (ties), subnormal-range values, +-0, random."""
    tiny = 2.0**-6 if cfg["fmt"] is E4M3 else 1.0
    choices = [
        rng.choice(cfg["grid"], shape),
        rng.choice(cfg["mids"], shape),
        rng.uniform(0, tiny, shape),
        rng.uniform(0, cfg["qmax"], shape),
        np.zeros(shape),
    ]
    mag = np.choose(rng.integers(0, len(choices), shape), choices).astype(np.float32)
    return np.where(rng.random(shape) < 0.5, -mag, mag)


@st.composite
def scaled_blocks(draw, cfg: dict, block: int, dtype: torch.dtype, max_blocks: int = 3, max_rows: int = 3):
    """float32 array [rows, nb*block] whose blocks sit on power-of-two scales 2^k (k drawn by hypothesis over
    the whole fp32 range), mostly with an amax element in (qmax/2, qmax]*2^k so that the block scale is 2^k
    and grid midpoints are true ties; some all-zero blocks; bf16-representable when dtype is bf16."""
    rows = draw(st.integers(1, max_rows))
    nb = draw(st.integers(1, max_blocks))
    ks = draw(hnp.arrays(np.int32, (rows * nb,), elements=st.integers(-140, cfg["kmax"])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    units = unit_values(cfg, rng, (rows * nb, block))
    top = cfg["grid"][cfg["grid"] > cfg["qmax"] / 2]
    for i in range(rows * nb):
        if rng.random() < 0.75:
            units[i, rng.integers(block)] = rng.choice(top) * rng.choice([-1.0, 1.0])
        if rng.random() < 0.1:
            units[i] = rng.choice([-0.0, 0.0])
    x = np.ldexp(units, ks[:, None]).astype(np.float32)
    if dtype == torch.bfloat16:
        x = x.astype(BF16).astype(np.float32)
    return x.reshape(rows, nb * block)


any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


# ------------------------------------------------------------------------------------------------------------------
# bf16
# ------------------------------------------------------------------------------------------------------------------


@MEDIUM
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=any_f32))
def test_round_bf16_fp32_matches_ml_dtypes_bitwise(x):
    out = F.round_bf16(torch.from_numpy(x))
    assert out.dtype == torch.float32
    assert_same_bits(out, x.astype(BF16).astype(np.float32))


@MEDIUM
@given(hnp.arrays(np.float64, st.integers(1, 32), elements=st.floats(allow_nan=False, allow_subnormal=True)))
def test_round_bf16_fp64_is_single_step_rne_like_exact_rationals(x):
    out = F.round_bf16(torch.from_numpy(x))
    assert out.dtype == torch.float64
    expected = np.array([bf16_rne_exact(float(v)) for v in x])
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(np.signbit(out.numpy()), np.signbit(expected))


def test_round_bf16_fp64_avoids_double_rounding_through_fp32():
    x = torch.tensor([1 + 2.0**-8 + 2.0**-40, -(1 + 2.0**-8 + 2.0**-40)], dtype=torch.float64)
    # just above the midpoint between 1 and 1+2^-7: nearest bf16 is 1+2^-7 (rounding through fp32 gives 1.0)
    assert F.round_bf16(x).tolist() == [1 + 2.0**-7, -(1 + 2.0**-7)]
    assert F.round_bf16(x.float()).tolist() == [1.0, -1.0]  # fp32(x) is the tie itself -> even


def test_round_bf16_keeps_signed_zero_nan_inf_and_overflows_to_inf():
    big = float(np.finfo(np.float32).max)
    x = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -float("inf"), big, -big])
    for dt in (torch.float32, torch.float64):
        out = F.round_bf16(x.to(dt)).to(torch.float32)
        assert_same_bits(out, np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, np.inf, -np.inf], np.float32))


def _veltkamp_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 Veltkamp split to 8 significant bits, each step rounded (the FP8 indexer kernel's ``_round_bf16``)."""
    t = x * np.float32(65537.0)
    return t - (t - x)


@MEDIUM
@given(hnp.arrays(np.float32, st.integers(1, 64),
                  elements=st.floats(2.0**-126, 2.0**110, width=32, exclude_max=True)),
       st.integers(0, 2**31 - 1))
def test_veltkamp_split_rounds_like_the_bf16_cast_in_the_indexer_range(mag, seed):
    """Normal |x| < 2^110, random values and exact ties between neighbouring bf16 values (ties to even)."""
    rng = np.random.default_rng(seed)
    x = mag * rng.choice(np.array([-1, 1], np.float32), mag.shape)
    ties = ((x.astype(BF16).astype(np.float32).view(np.uint32) & 0xFFFF0000) + 0x8000).view(np.float32)
    ties = ties[np.abs(ties) < 2.0**110]
    for v in (x, ties):
        assert_same_bits(_veltkamp_bf16(v), v.astype(BF16).astype(np.float32))


def test_veltkamp_split_is_wrong_outside_the_range_the_kernel_guards():
    """Subnormals and |x| >= 2^111 are why the kernel checks scale and weight ranges before using it."""
    x = np.array([1e-40, 2.0**111 * 1.5], np.float32)
    assert not np.array_equal(_veltkamp_bf16(x), x.astype(BF16).astype(np.float32), equal_nan=True)


# ------------------------------------------------------------------------------------------------------------------
# element grids: FP8 e4m3 and FP4 e2m1
# ------------------------------------------------------------------------------------------------------------------


def _all_points_and_ties(grid, mids, beyond):
    mag = np.concatenate([grid, mids, np.asarray(beyond, np.float32)]).astype(np.float32)
    return np.concatenate([mag, -mag])


def test_round_fp8_e4m3_every_grid_point_and_tie_matches_ml_dtypes():
    v = _all_points_and_ties(E4M3_GRID, E4M3_MIDS, [449.0, 464.0, 479.0, 480.0, 1e30, np.inf])
    expected = np.clip(v, -448, 448).astype(E4M3)
    for dt in (torch.float32, torch.float64):
        out = F.round_fp8_e4m3(torch.from_numpy(v).to(dt))
        assert out.dtype == dt
        assert_same_bits(out, expected.astype(np.float32))
        np.testing.assert_array_equal(out.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), expected.view(np.uint8))


def test_round_fp8_e4m3_hand_picked_ties_go_to_even_and_saturate():
    v = torch.tensor([2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 464.0, 1e9, -float("inf"), -(2.0**-11)])
    assert_same_bits(F.round_fp8_e4m3(v), [0.0, 2.0**-8, 1.0, 1.25, 448.0, 448.0, -448.0, -0.0])


@MEDIUM
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=any_f32))
def test_round_fp8_e4m3_random_fp32_matches_clamped_ml_dtypes_cast(v):
    assert_same_bits(F.round_fp8_e4m3(torch.from_numpy(v)), np.clip(v, -448, 448).astype(E4M3).astype(np.float32))


def test_round_fp4_e2m1_every_grid_point_and_tie_matches_ml_dtypes():
    v = _all_points_and_ties(E2M1_GRID, E2M1_MIDS, [6.5, 7.0, 8.0, 1e30, np.inf])
    expected = np.clip(v, -6, 6).astype(E2M1).astype(np.float32)
    for dt in (torch.float32, torch.float64):
        assert_same_bits(F.round_fp4_e2m1(torch.from_numpy(v).to(dt)), expected)


def test_round_fp4_e2m1_ties_follow_the_spec_table():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert F.round_fp4_e2m1(ties).tolist() == want
    assert F.round_fp4_e2m1(-ties).tolist() == [-w for w in want]
    assert_same_bits(F.round_fp4_e2m1(torch.tensor([-0.25, -0.0, 9.0, -9.0])), [-0.0, -0.0, 6.0, -6.0])


@MEDIUM
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=any_f32))
def test_round_fp4_e2m1_random_fp32_matches_clamped_ml_dtypes_cast(v):
    expected = np.clip(v, -6, 6).astype(E2M1).astype(np.float32)
    out = F.round_fp4_e2m1(torch.from_numpy(v))
    finite = ~np.isnan(v)  # e2m1 has no NaN; we keep NaN as a value
    assert_same_bits(out[torch.from_numpy(finite)], expected[finite])
    assert torch.isnan(out[torch.from_numpy(~finite)]).all()


# ------------------------------------------------------------------------------------------------------------------
# ue8m0 scales
# ------------------------------------------------------------------------------------------------------------------


@MEDIUM
@given(
    hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(0, allow_infinity=False, width=32)),
    st.sampled_from([FP8, FP4]),
)
def test_ue8m0_scale_is_pow2_ceil_log2_of_amax_over_qmax(amax, cfg):
    s = F.ue8m0_scale(torch.from_numpy(amax), cfg["qmax"], cfg["floor"])
    expected = ref_scale(amax, cfg["qmax"], cfg["floor"])
    assert s.dtype == torch.float32
    np.testing.assert_array_equal(bits32(s), bits32(expected))
    np.testing.assert_array_equal(F.encode_e8m0(s).numpy(), e8m0_bytes(expected))


@pytest.mark.parametrize(("qmax", "binade"), [(448.0, 0), (6.0, -100)])
def test_ue8m0_fp32_reciprocal_multiply_equals_division_for_every_mantissa(qmax, binade):
    """Exhaustive over one fp32 binade (power-of-two scaling carries it to every normal binade): kernel.py's
    amax * fp32(1/qmax) gives the same power of two as the spec's amax / qmax, and the scale covers amax
    (qmax/2 < amax / s <= qmax, so the clamp never bites for fp32/bf16 input)."""
    mant = torch.arange(2**23, dtype=torch.int32) | (127 << 23)
    amax = mant.view(torch.float32) * 2.0**binade
    s = F.ue8m0_scale(amax, qmax, 2.0**-149)
    m, e = np.frexp((amax.numpy() / np.float32(qmax)).astype(np.float32))
    expected = np.ldexp(np.float32(1), np.where(m == 0.5, e - 1, e)).astype(np.float32)
    np.testing.assert_array_equal(s.numpy(), expected)
    assert bool((amax.double() / s.double() <= qmax).all())
    assert bool((amax.double() / s.double() > qmax / 2).all())


def test_ue8m0_zero_amax_uses_the_floor():
    z = torch.zeros(3)
    assert F.encode_e8m0(F.ue8m0_scale(z, F.FP8_MAX, F.FP8_AMAX_FLOOR)).tolist() == [105] * 3  # 2^-22
    assert F.encode_e8m0(F.ue8m0_scale(z, F.FP4_MAX, F.FP4_AMAX_FLOOR)).tolist() == [1] * 3  # 2^-126


def test_ue8m0_bit_rule_for_subnormal_zero_inf_and_nan():
    amax = torch.tensor([2.0**-140, 0.0, float("inf"), float("nan")])
    s = F.ue8m0_scale(amax, 1.0, 2.0**-149)  # v = amax: subnormal -> 2^-126 (fast_log2_ceil), tiny floor
    assert s[0].item() == 2.0**-126
    assert s[1].item() == 2.0**-126  # floor 2^-149 is subnormal too
    assert s[2].item() == float("inf") and math.isnan(s[3].item())
    assert F.encode_e8m0(s).tolist() == [1, 1, 255, 255]


def test_e8m0_decode_and_encode_cover_all_256_bytes_like_ml_dtypes_and_torch():
    b = torch.arange(256, dtype=torch.uint8)
    dec = F.decode_e8m0(b)
    assert_same_bits(dec, np.arange(256, dtype=np.uint8).view(E8M0).astype(np.float32))
    assert_same_bits(dec, b.view(torch.float8_e8m0fnu).to(torch.float32))
    assert_same_bits(F.decode_e8m0(b.view(torch.float8_e8m0fnu)), dec)
    assert F.encode_e8m0(dec).tolist() == list(range(256))
    assert dec[0].item() == 2.0**-127 and dec[127].item() == 1.0 and dec[254].item() == 2.0**127


# ------------------------------------------------------------------------------------------------------------------
# FP8 activation blocks
# ------------------------------------------------------------------------------------------------------------------


@st.composite
def fp8_case(draw):
    block = draw(st.sampled_from(F.FP8_ACT_BLOCKS))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    return block, dtype, draw(scaled_blocks(FP8, block, dtype))


@MEDIUM
@given(fp8_case())
def test_quantize_fp8_codes_and_scales_match_ml_dtypes_bytes(case):
    block, dtype, x32 = case
    codes, scales = F.quantize_fp8(to_torch(x32, dtype), block)
    ref_codes, ref_s, _ = ref_blocks(x32, block, FP8)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    np.testing.assert_array_equal(codes.view(torch.uint8).numpy(), ref_codes.view(np.uint8))
    np.testing.assert_array_equal(scales.numpy(), e8m0_bytes(ref_s))


@MEDIUM
@given(fp8_case())
def test_fake_quant_fp8_equals_reference_inplace_act_quant(case):
    block, dtype, x32 = case
    out = F.fake_quant_fp8(to_torch(x32, dtype), block)
    _, _, deq = ref_blocks(x32, block, FP8)
    if dtype == torch.bfloat16:
        deq = deq.astype(BF16).astype(np.float32)
    assert out.dtype == dtype
    assert_same_bits(out, deq)


@FAST
@given(
    st.sampled_from(F.FP8_ACT_BLOCKS),
    st.sampled_from([torch.bfloat16, torch.float32, torch.float64, torch.float16]),
    st.integers(0, 2**32 - 1),
)
def test_dequantize_of_quantize_fp8_equals_fake_quant_even_with_nan_inf(block, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 2 * block)) * np.exp2(rng.integers(-30, 30, (2, 3, 1)))
    x.flat[rng.integers(0, x.size, 3)] = rng.choice([np.nan, np.inf, -np.inf, 0.0], 3)
    xt = torch.from_numpy(x).to(dtype)
    codes, scales = F.quantize_fp8(xt, block)
    assert codes.shape == xt.shape and scales.shape == (2, 3, 2)
    assert_same_bits(F.dequantize_fp8(codes, scales, block).to(dtype), F.fake_quant_fp8(xt, block))
    assert_same_bits(
        F.dequantize_fp8(codes.view(torch.uint8), scales.view(torch.float8_e8m0fnu), block),
        F.dequantize_fp8(codes, scales, block),
    )


@FAST
@given(st.sampled_from(F.FP8_ACT_BLOCKS), st.integers(0, 2**32 - 1))
def test_quantize_fp8_leading_shape_is_independent_rows(block, seed):
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((2, 3, 2 * block)).astype(np.float32))
    c, s = F.quantize_fp8(x, block)
    c2, s2 = F.quantize_fp8(x.reshape(6, -1), block)
    assert torch.equal(c.view(torch.uint8).reshape(6, -1), c2.view(torch.uint8))
    assert torch.equal(s.reshape(6, -1), s2)


def test_fp8_zero_blocks_take_the_floor_scale_and_keep_the_sign_of_zero():
    x = torch.tensor([[0.0, -0.0] * 16, [-0.0] * 32], dtype=torch.bfloat16)
    codes, scales = F.quantize_fp8(x, 32)
    assert scales.tolist() == [[105], [105]]  # 2^ceil(log2(fp32(1e-4) * fp32(1/448))) = 2^-22
    assert codes.view(torch.uint8)[0, :2].tolist() == [0x00, 0x80]
    assert (codes.view(torch.uint8)[1] == 0x80).all()
    assert_same_bits(F.fake_quant_fp8(x, 32), x)


def test_fp8_fp64_input_rounds_once_from_fp64():
    x = torch.zeros(32, dtype=torch.float64)
    x[0], x[1] = 448.0, 0.5 + 2.0**-5 + 2.0**-40  # just above the e4m3 tie 0.53125 at scale 1
    assert F.fake_quant_fp8(x, 32)[1].item() == 0.5625
    assert F.fake_quant_fp8(x.float(), 32)[1].item() == 0.5  # in fp32 the input is the tie itself -> even


def test_fp8_fp64_amax_rounded_down_to_fp32_saturates_at_448():
    x = torch.zeros(32, dtype=torch.float64)
    x[0], x[1] = 448.0 * (1 + 2.0**-30), -448.0 * (1 + 2.0**-30)  # fp32(amax) = 448 -> s = 1, x/s > 448
    codes, scales = F.quantize_fp8(x, 32)
    assert scales.tolist() == [127]
    assert codes[:2].float().tolist() == [448.0, -448.0]


@FAST
@given(hnp.arrays(np.float32, (64,), elements=finite_f32.filter(lambda v: abs(v) < 1e30)))
def test_fp8_fp64_input_equals_fp32_path_when_values_are_fp32(x):
    x64 = torch.from_numpy(x).double()
    assert_same_bits(F.fake_quant_fp8(x64, 32), F.fake_quant_fp8(x64.float(), 32))


# ------------------------------------------------------------------------------------------------------------------
# FP8 128x128 weight blocks
# ------------------------------------------------------------------------------------------------------------------


@settings(max_examples=15)
@given(
    st.sampled_from([1, 5, 128, 129, 200]),
    st.sampled_from([1, 7, 128, 130, 300]),
    st.sampled_from([torch.bfloat16, torch.float32]),
    st.integers(0, 2**32 - 1),
)
def test_fp8_ragged_128x128_weight_blocks_match_per_block_oracle(rows, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-40, 40, (rows, 1)))).astype(np.float32)
    if rng.random() < 0.3:
        x[:128, :128] = 0.0
    x32 = to_torch(x, dtype).float().numpy()
    codes, scales = F.quantize_fp8(to_torch(x32, dtype), (128, 128))
    nbo, nbi = -(-rows // 128), -(-cols // 128)
    assert scales.shape == (nbo, nbi) and codes.shape == (rows, cols)
    deq = F.dequantize_fp8(codes, scales, (128, 128))
    for i in range(nbo):
        for j in range(nbi):
            sl = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            blk = x32[sl]
            s = ref_scale(np.abs(blk).max(), 448.0, 1e-4)
            ref = np.clip(blk / s, -448, 448).astype(E4M3)
            assert scales[i, j].item() == e8m0_bytes(s).item()
            np.testing.assert_array_equal(codes[sl].view(torch.uint8).numpy(), ref.view(np.uint8))
            assert_same_bits(deq[sl], ref.astype(np.float32) * s)
    assert_same_bits(F.fake_quant_fp8(to_torch(x32, dtype), (128, 128)), deq.to(dtype))


# ------------------------------------------------------------------------------------------------------------------
# FP4
# ------------------------------------------------------------------------------------------------------------------


def test_fp4_packing_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4, 0xF, 0x8]], dtype=torch.uint8)
    packed = F.pack_fp4_codes(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x8F]]
    assert torch.equal(F.unpack_fp4_codes(packed), codes)
    # the reference convert.py unpacking: stack([T[x & 0xF], T[(x >> 4) & 0xF]])
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([0.5, -1.0, 6.0, -0.0])
    packed, scales = F.quantize_fp4(x)
    assert scales.tolist() == [[127]]  # amax 6 -> scale 1
    assert packed[0, :3].tolist() == [0xA1, 0x87, 0x00]
    assert packed.shape == (1, 16)


def test_fp4_code_values_match_ml_dtypes_for_every_code():
    """Computed from the code bits (no host table), equal to ml_dtypes' float4_e2m1fn decoding, -0.0 included."""
    codes = np.arange(16, dtype=np.uint8)
    ref = torch.from_numpy(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    got = F.fp4_code_values(torch.from_numpy(codes))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@st.composite
def fp4_case(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    return dtype, draw(scaled_blocks(FP4, 32, dtype, max_blocks=4))


@MEDIUM
@given(fp4_case())
def test_quantize_fp4_packed_codes_and_scales_match_ml_dtypes_bytes(case):
    dtype, x32 = case
    packed, scales = F.quantize_fp4(to_torch(x32, dtype))
    ref_codes, ref_s, _ = ref_blocks(x32, 32, FP4)
    nib = ref_codes.view(np.uint8)
    np.testing.assert_array_equal(packed.numpy(), nib[..., 0::2] | (nib[..., 1::2] << 4))
    np.testing.assert_array_equal(scales.numpy(), e8m0_bytes(ref_s))


@MEDIUM
@given(fp4_case())
def test_fake_quant_fp4_equals_reference_fp4_act_quant(case):
    dtype, x32 = case
    out = F.fake_quant_fp4(to_torch(x32, dtype))
    _, _, deq = ref_blocks(x32, 32, FP4)
    if dtype == torch.bfloat16:
        deq = deq.astype(BF16).astype(np.float32)
    assert out.dtype == dtype
    assert_same_bits(out, deq)


@FAST
@given(st.sampled_from([torch.bfloat16, torch.float32, torch.float64]), st.integers(0, 2**32 - 1))
def test_dequantize_of_quantize_fp4_equals_fake_quant_even_with_nan_inf(dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 2, 96)) * np.exp2(rng.integers(-60, 60, (3, 2, 1)))
    x.flat[rng.integers(0, x.size, 3)] = rng.choice([np.nan, np.inf, -np.inf, -0.0], 3)
    xt = torch.from_numpy(x).to(dtype)
    packed, scales = F.quantize_fp4(xt)
    assert packed.shape == (3, 2, 48) and scales.shape == (3, 2, 3)
    deq = F.dequantize_fp4(packed, scales)
    assert_same_bits(deq.to(dtype), F.fake_quant_fp4(xt))
    assert_same_bits(F.dequantize_fp4(packed.view(torch.int8), scales.view(torch.float8_e8m0fnu)), deq)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert_same_bits(F.dequantize_fp4(packed.view(torch.float4_e2m1fn_x2), scales), deq)


def test_fp4_zero_blocks_take_the_floor_scale_and_keep_the_sign_of_zero():
    x = torch.tensor([[0.0, -0.0] * 16], dtype=torch.bfloat16)
    packed, scales = F.quantize_fp4(x)
    assert scales.tolist() == [[1]]  # 2^-126
    assert (packed == 0x80).all()
    assert_same_bits(F.fake_quant_fp4(x), x)


def test_fp4_fp64_amax_rounded_down_to_fp32_saturates_at_6():
    x = torch.zeros(32, dtype=torch.float64)
    x[0], x[1] = 6.0 * (1 + 2.0**-30), -6.0 * (1 + 2.0**-30)
    packed, scales = F.quantize_fp4(x)
    assert scales.tolist() == [127] and packed[0].item() == 0xF7


# ------------------------------------------------------------------------------------------------------------------
# NaN / Inf
# ------------------------------------------------------------------------------------------------------------------


def test_nan_poisons_only_its_fp8_block_scale_codes_and_outputs():
    x = torch.ones(2, 64)
    x[0, 5] = float("nan")
    codes, scales = F.quantize_fp8(x, 32)
    assert scales.tolist() == [[255, 119], [119, 119]]
    assert torch.isnan(codes[0, :32].float()).all() and not torch.isnan(codes[0, 32:].float()).any()
    fq = F.fake_quant_fp8(x, 32)
    assert torch.isnan(fq[0, :32]).all() and (fq[0, 32:] == 1).all() and (fq[1] == 1).all()


def test_inf_gives_nan_scale_zero_codes_for_finite_elements_and_all_nan_fp8_outputs():
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = float("inf"), -2.0
    codes, scales = F.quantize_fp8(x, 32)
    assert scales.tolist() == [[255, 119]]
    c = codes[0, :32].float()
    assert torch.isnan(c[0]) and bits32(c[1:2]).item() == 0x80000000 and (c[2:] == 0).all()
    assert F.ue8m0_scale(torch.tensor([float("inf")]), 448.0, 1e-4).item() == float("inf")
    fq = F.fake_quant_fp8(x, 32)
    assert torch.isnan(fq[0, :32]).all() and (fq[0, 32:] == 1).all()


def test_nan_and_inf_poison_only_their_fp4_block_with_code_7_for_nan():
    x = torch.ones(3, 64)
    x[0, 0] = float("nan")
    x[1, 33] = -float("inf")
    packed, scales = F.quantize_fp4(x)
    assert scales.tolist() == [[255, 125], [125, 255], [125, 125]]  # amax 1 -> 2^ceil(log2(1/6)) = 2^-2
    codes = F.unpack_fp4_codes(packed)
    assert codes[0, 0].item() == 0x7 and codes[1, 33].item() == 0x7 and codes[1, 32].item() == 0x0
    fq = F.fake_quant_fp4(x)
    nan = torch.zeros(3, 64, dtype=torch.bool)
    nan[0, :32] = nan[1, 32:] = True
    assert torch.equal(torch.isnan(fq), nan)
    assert_same_bits(F.dequantize_fp4(packed, scales), fq)


def test_dequantized_values_overflow_to_inf_near_the_fp32_max_like_the_fp32_reference():
    x = torch.full((1, 32), 248 * 2.0**120, dtype=torch.bfloat16)  # e4m3(248) = 256 -> 256 * 2^120 = 2^128
    assert torch.isinf(F.fake_quant_fp8(x, 32)).all()
    assert F.fake_quant_fp8(x * 0.5, 32).float()[0, 0].item() == 2.0**127
    y = torch.full((1, 32), 3.5 * 2.0**126)  # e2m1(3.5) = 4 -> 4 * 2^126 = 2^128
    assert torch.isinf(F.fake_quant_fp4(y)).all()


# ------------------------------------------------------------------------------------------------------------------
# Hadamard
# ------------------------------------------------------------------------------------------------------------------


@FAST
@given(st.integers(0, 9), st.integers(0, 2**32 - 1))
def test_hadamard_matches_explicit_sylvester_matrix(log_n, seed):
    n = 2**log_n
    x = np.random.default_rng(seed).standard_normal((3, n)).astype(np.float32)
    expected = x.astype(np.float64) @ sylvester(n).T / math.sqrt(n)
    out = F.hadamard(torch.from_numpy(x))
    assert out.dtype == torch.float32
    tol = (log_n + 2) * math.sqrt(n) * EPS32 * float(np.abs(x).max())
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=tol)
    out64 = F.hadamard(torch.from_numpy(x).double())
    np.testing.assert_allclose(out64.numpy(), expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n", [1, 4, 16, 64, 256])
def test_hadamard_is_exact_for_integer_inputs_when_n_is_a_power_of_4(n):
    x = np.random.default_rng(n).integers(-1000, 1000, (2, n)).astype(np.float32)
    expected = (x.astype(np.float64) @ sylvester(n).T / math.sqrt(n)).astype(np.float32)
    np.testing.assert_array_equal(F.hadamard(torch.from_numpy(x)).numpy(), expected)


def test_hadamard_row_order_is_sylvester():
    assert F.hadamard(torch.eye(16) * 4).tolist() == sylvester(16).T.tolist()


@FAST
@given(st.integers(1, 10), st.integers(0, 2**32 - 1))
def test_hadamard_applied_twice_is_identity_within_fp32_eps(log_n, seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy((rng.standard_normal((4, 2**log_n)) * 10.0 ** rng.integers(-5, 5)).astype(np.float32))
    err = (F.hadamard(F.hadamard(x)) - x).norm(dim=-1) / x.norm(dim=-1)
    assert float(err.max()) <= 16 * EPS32


@FAST
@given(st.integers(0, 8), st.integers(0, 2**32 - 1))
def test_hadamard_of_bf16_is_the_bf16_rounded_fp32_transform(log_n, seed):
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((2, 2**log_n)).astype(np.float32))
    xb = x.to(torch.bfloat16)
    out = F.hadamard(xb)
    assert out.dtype == torch.bfloat16
    assert_same_bits(out, F.round_bf16(F.hadamard(xb.float())))


def test_hadamard_spreads_nan_and_a_single_inf_over_the_row():
    x = torch.zeros(2, 8)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    y = F.hadamard(x)
    assert torch.isnan(y[0]).all()
    assert torch.isinf(y[1]).all() and torch.equal(torch.sign(y[1]), torch.from_numpy(sylvester(8)[:, 5]).float())


# ------------------------------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------------------------------

_u8 = torch.uint8
BAD_INPUTS = [
    (lambda: F.quantize_fp8(torch.zeros(2, 100), 64), r"expected K % 64 == 0, found K=100"),
    (lambda: F.quantize_fp8(torch.zeros(2, 96), 48), r"expected one of \(32, 64, 128\), found 48"),
    (lambda: F.quantize_fp8(torch.zeros(2, 128), True), r"expected one of .*found True"),
    (lambda: F.quantize_fp8(torch.zeros(2, 128), (64, 64)), r"expected \(128, 128\).*found \(64, 64\)"),
    (lambda: F.quantize_fp8(torch.zeros(2, 2, 128), (128, 128)), r"expected a 2-D .*found shape \(2, 2, 128\)"),
    (lambda: F.quantize_fp8(torch.zeros(2, 128, dtype=torch.int32), 128), r"expected dtype .*found torch.int32"),
    (lambda: F.quantize_fp8(torch.tensor(1.0), 32), r"expected at least 1 dim, found a 0-d"),
    (lambda: F.fake_quant_fp8(torch.zeros(3, 33), 32), r"expected K % 32 == 0, found K=33"),
    (lambda: F.quantize_fp4(torch.zeros(2, 48)), r"expected K % 32 == 0, found K=48"),
    (lambda: F.quantize_fp4(torch.zeros(2, 64), 16), r"expected one of \(32,\), found 16"),
    (lambda: F.fake_quant_fp4(torch.zeros(2, 64), 64), r"expected one of \(32,\), found 64"),
    (
        lambda: F.dequantize_fp8(torch.zeros(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=_u8), 32),
        r"expected shape \(2, 2\), found \(2, 1\)",
    ),
    (
        lambda: F.dequantize_fp8(torch.zeros(2, 64), torch.zeros(2, 2, dtype=_u8), 32),
        r"expected dtype float8_e4m3fn.*found torch.float32",
    ),
    (
        lambda: F.dequantize_fp8(torch.zeros(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 2), 32),
        r"expected dtype uint8 or float8_e8m0fnu, found torch.float32",
    ),
    (
        lambda: F.dequantize_fp4(torch.zeros(2, 16, dtype=_u8), torch.zeros(2, 2, dtype=_u8)),
        r"expected shape \(2, 1\), found \(2, 2\)",
    ),
    (
        lambda: F.dequantize_fp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=_u8)),
        r"expected dtype uint8, int8 or float4_e2m1fn_x2, found torch.float32",
    ),
    (lambda: F.pack_fp4_codes(torch.zeros(5, dtype=_u8)), r"expected an even last dim, found K=5"),
    (lambda: F.pack_fp4_codes(torch.tensor([16, 0], dtype=_u8)), r"expected nibble values 0..15, found max 16"),
    (lambda: F.pack_fp4_codes(torch.zeros(4, dtype=torch.int64)), r"expected dtype uint8, found torch.int64"),
    (lambda: F.encode_e8m0(torch.tensor([1.0, 3.0])), r"expected powers of two .*found 3.0"),
    (lambda: F.encode_e8m0(torch.tensor([0.0])), r"expected powers of two .*found 0.0"),
    (lambda: F.encode_e8m0(torch.tensor([-2.0])), r"expected powers of two .*found -2.0"),
    (lambda: F.decode_e8m0(torch.tensor([1.0])), r"expected dtype uint8 or float8_e8m0fnu, found torch.float32"),
    (lambda: F.ue8m0_scale(torch.ones(1), 0.0, 1e-4), r"qmax: expected a finite positive number, found 0.0"),
    (lambda: F.ue8m0_scale(torch.ones(1), 448.0, 0.0), r"floor: expected a finite positive number, found 0.0"),
    (lambda: F.round_fp8_e4m3(torch.zeros(2, dtype=torch.bfloat16)), r"expected dtype float32 or float64"),
    (lambda: F.round_bf16(torch.zeros(2, dtype=torch.int64)), r"expected dtype .*found torch.int64"),
    (lambda: F.hadamard(torch.zeros(3, 12)), r"expected a power of two, found 12"),
    (lambda: F.hadamard(torch.zeros(3, 0)), r"expected a power of two, found 0"),
]


@pytest.mark.parametrize(("call", "message"), BAD_INPUTS)
def test_bad_inputs_raise_value_error_naming_expected_and_found(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "expected" in str(info.value) and "found" in str(info.value)
