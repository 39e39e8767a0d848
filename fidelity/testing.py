"""Test your own kernels against the oracle: one contract per production op (spec §3-§4).

Every op of ``fidelity.production.registry.REGISTRY`` has an :class:`OpContract` in :data:`CONTRACTS`:

* a hypothesis strategy of :class:`Case` objects: inputs with the *kernel signature* (argument order, shapes
  and dtypes as the production model calls the op: bf16 activations, fp32 weights / sinks / mixing
  coefficients, int32 attention indices), drawn to cover what ports get wrong: lengths around the 4 / 64 /
  128 boundaries, top-k wider than the entries available, an empty compressed cache, -1 indices anywhere
  after the always-valid first one, whole 64-blocks of -1, 1..16 heads, RoPE positions up to 2^20, a NaN;
* the expected result: the oracle op (``oracles/``) in fp64 on the same inputs (kind ``tolerance``), or a
  bit-exact reference function (kind ``bitexact``: ``kv_round``, whose exact-math oracle is the identity);
* per output, a :class:`Tolerance` derived from the rounding steps the official reference itself takes.

A per-element relative error ``<= r`` gives, for every row (last dim), ``calc_diff = |x-y|^2/(|x|^2+|y|^2)
<= r^2/2`` and ``1 - cos <= r^2/2``; r counts the bf16 roundings (u = 2^-8) on the reference path, x1.25
for the fp32 arithmetic around them. Non-finite values must sit exactly where the expected result has them;
metrics use the coordinates finite in both.

=====================  ==========================================================================
op                     limit (per row; u = 2^-8)
=====================  ==========================================================================
act_linear             |err| <= (2^-4 + k 2^-23) sum_k |x_k w_jk| + 1.25u |y| elementwise (one e4m3 rounding)
rms_norm, hc_post,     r = 1.25u: calc_diff <= 1.19e-5, cos >= 1 - 1.19e-5 (one rounding)
hc_head, hc_pre.y      (apply_rope: same, and the nope dims exactly unchanged)
rms_norm_weightless    calc_diff <= 1.46e-4 (r = 3.5 x 1.25u, bf16 ops); cos >= 1 - 1.19e-5
sparse_attention       r = 2.5u: calc_diff, 1 - cos <= 4.77e-5 (P and the output rounded to bf16)
index_scores,          |err| <= 4u sum_h |w_h| relu(q_h.k) + d 2^-23 sum_h |w_h| |q_h|.|k| elementwise
index_scores_fp4       (on the dequantized FP4 keys)
sinkhorn_split, gate,  r = 2^-14 (fp32 math): calc_diff, 1 - cos <= 1.86e-9; gate indices: same set
hc_pre.pre/post/comb
expert                 r = 2 x 2^-4 + 4u (two e4m3 activation roundings): calc_diff <= 9.9e-3, cos >= 0.990
kv_round               bit-exact vs fake_quant_fp8(nope, 1x64) + unchanged rope dims
rms_norm_fp8           codes: |code*s - y| <= half an e4m3 step + 1.25u|y|; scale bytes of the exact amax
rms_norm_act_quant     y: as rms_norm; xq: rms_norm_fp8's bound on code * scale
kv_norm_rope_fp8       nope: half an e4m3 step (1x64) + 1.25u|y|; rope: 2 x 1.25u (|y_2i| + |y_2i+1|) elementwise
=====================  ==========================================================================

Usage (in your pytest suite)::

    from fidelity.testing import check_against_oracle

    def test_my_kernel():
        check_against_oracle("sparse_attention", my_sparse_attention, device="cuda")

Requires hypothesis (the ``test`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import hypothesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fidelity.config import ModelConfig
from fidelity.formats import (
    FP8_AMAX_FLOOR,
    FP8_MAX,
    dequantize_fp4,
    dequantize_fp8,
    fake_quant_fp8,
    quantize_fp4,
    ue8m0_scale,
)
from oracles import attention as attention_oracle
from oracles import indexer as indexer_oracle
from oracles import linear as linear_oracle
from oracles import mhc as mhc_oracle
from oracles import moe as moe_oracle
from oracles import norms as norms_oracle
from oracles import rope as rope_oracle

__all__ = [
    "CONTRACTS",
    "Case",
    "OpContract",
    "Output",
    "Tolerance",
    "check_against_oracle",
    "check_all_registered",
    "check_case",
    "kv_round_reference",
    "strategies",
]

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
U_BF16 = 2.0**-8  # bf16 unit roundoff (8-bit significand, round to nearest even)
U_FP8 = 2.0**-4  # e4m3 unit roundoff (4-bit significand)
SLACK = 1.25  # fp32 arithmetic around the bf16 roundings (accumulation, exp, rsqrt), relative to u
FP32_REL = 2.0**-14  # fp32-output ops: fp32 roundoff 2^-24 grown by <= 2^10-term sums and 20 Sinkhorn rounds
EPS = 1e-6  # norm_eps and hc_eps of every DSv4 config
HC = 4  # hc_mult
SINKHORN_ITERS = 20
_FLASH = ModelConfig.preset("flash")


# --------------------------------------------------------------------------------------------------------------
# data model
# --------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Case:
    """One kernel call: ``fn(*args.values(), **kwargs)``; ``note`` says which edge cases the draw hit."""

    args: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def __getitem__(self, name: str) -> Any:
        return self.kwargs[name] if name in self.kwargs else self.args[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.kwargs.get(name, self.args.get(name, default))

    def describe(self) -> str:
        """``q: bf16[3, 4, 512], kv: bf16[150, 512], ..., scale=0.0442`` (+ note)."""
        parts = [f"{k}{_short(v)}" for k, v in {**self.args, **self.kwargs}.items()]
        return ", ".join(parts) + (f"  [{self.note}]" if self.note else "")

    def __repr__(self) -> str:
        return f"Case({self.describe()})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' falsifying-example printer
        p.text(repr(self))


@dataclass(frozen=True)
class Tolerance:
    """Limits for one floating output vs the expected tensor.

    cos_min / calc_diff_max: per row (last dim), fp64, over coordinates finite in both; ``None`` = unchecked.
    bound: elementwise ``|found - expected| <= bound(case)`` (fp64, the output's shape).
    why: the rounding argument the limits come from.
    """

    cos_min: float | None = None
    calc_diff_max: float | None = None
    bound: Callable[[Case], torch.Tensor] | None = None
    why: str = ""


@dataclass(frozen=True)
class Output:
    """One output of an op: its name, required dtype (``None``: any integer dtype) and how it is judged
    (``tolerance``; ``None`` = bit-exact: equal values, NaN where the reference has NaN)."""

    name: str
    dtype: torch.dtype | None
    tolerance: Tolerance | None = None


@dataclass(frozen=True)
class OpContract:
    """What a port of ``op`` must satisfy (see the module docstring).

    inputs: ``inputs()`` is the default hypothesis strategy of :class:`Case`.
    expected: Case -> tuple of expected outputs (fp64 oracle for ``kind == "tolerance"``, the bit-exact
    reference's outputs for ``kind == "bitexact"``), computed on CPU.
    canonical: optional map applied to both found and expected outputs before comparing (e.g. sort top-k).
    """

    op: str
    kind: str
    inputs: Callable[[], st.SearchStrategy[Case]]
    expected: Callable[[Case], tuple[torch.Tensor, ...]]
    outputs: tuple[Output, ...]
    why: str
    canonical: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        name = str(v.dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")
        return f": {name}{list(v.shape)}"
    if isinstance(v, ModelConfig):
        return (f"=ModelConfig(n_routed_experts={v.n_routed_experts}, n_activated_experts={v.n_activated_experts}, "
                f"route_scale={v.route_scale}, score_func={v.score_func!r})")
    if isinstance(v, float):
        return f"={v:.6g}"
    return f"={v!r}"


def _rel(r: float, why: str, cos_r: float | None = None) -> Tolerance:
    """Per-element relative error <= r  =>  calc_diff <= r^2/2 and 1 - cos <= r^2/2 for every row."""
    c = r if cos_r is None else cos_r
    return Tolerance(cos_min=1 - c * c / 2, calc_diff_max=r * r / 2, why=why)


# --------------------------------------------------------------------------------------------------------------
# strategy helpers
# --------------------------------------------------------------------------------------------------------------


def _gen(draw: Callable) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=FP32)


def _uniform(g: torch.Generator, lo: float, hi: float, *shape: int) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=FP32)


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _on_fp4_grid(m: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] (K % 32 == 0) -> nearby values e2m1 x 2^k per 1x32 block (exact dequantized FP4)."""
    b = m.unflatten(-1, (-1, 32))
    s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6)))
    q = _FP4_VALUES[torch.bucketize((b / s).abs(), (_FP4_VALUES[1:] + _FP4_VALUES[:-1]) / 2)]
    return (q.copysign(b) * s).flatten(-2)


def _on_fp8_grid(m: torch.Tensor) -> torch.Tensor:
    """fp32 [R, C] (multiples of 128) -> nearby values e4m3 x 2^k per 128x128 block (exact dequantized FP8)."""
    r, c = m.shape
    b = m.reshape(r // 128, 128, c // 128, 128)
    amax = b.abs().amax(dim=(1, 3), keepdim=True).clamp(min=2.0**-100)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return ((b / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(FP32) * s).reshape(r, c)


def _row_scales(draw: Callable, g: torch.Generator, n: int) -> torch.Tensor:
    """[n, 1] per-row magnitudes 2^U(-s, s), sometimes with an all-zero row."""
    s = draw(st.sampled_from((0.0, 4.0, 10.0)))
    scales = torch.exp2(_uniform(g, -s, s, n, 1))
    if draw(st.integers(0, 5)) == 5:  # the high end, so that shrinking drops it
        scales[_randint(g, 0, n - 1)] = 0.0
    return scales


def _plant_nan(draw: Callable, g: torch.Generator, args: dict[str, Any], names: Sequence[str]) -> str:
    """With probability ~1/5 put one NaN into one of ``args[names]`` (in place on a clone); returns a note."""
    names = [n for n in names if n in args and args[n].numel()]
    if not names or draw(st.integers(0, 4)) != 4:  # the high end, so that shrinking drops it
        return ""
    name = draw(st.sampled_from(names))
    t = args[name].clone()
    flat = _randint(g, 0, t.numel() - 1)
    t.view(-1)[flat] = float("nan")
    args[name] = t
    return f"NaN planted in {name}{_at(t.shape, flat)}"


def _at(shape: Sequence[int], flat: int) -> list[int]:
    """Coordinates of flat index ``flat`` in ``shape``."""
    coord = []
    for size in reversed(tuple(shape)):
        coord.append(flat % size)
        flat //= size
    return coord[::-1]


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


# --------------------------------------------------------------------------------------------------------------
# strategies (kernel-signature inputs)
# --------------------------------------------------------------------------------------------------------------


def rms_norm_inputs(dims: Sequence[int] = (16, 64, 128, 512, 1024), max_rows: int = 8,
                    nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``rms_norm(x bf16 [n, d], weight fp32 [d], eps)``; rows from 2^-10 to 2^10 (eps matters at the low end)
    and all-zero rows."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, d = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        x = (_randn(g, n, d) * _row_scales(draw, g, n)).to(BF16)
        signed = draw(st.booleans())
        weight = _randn(g, d) if signed else 1 + 0.25 * _randn(g, d)
        args = {"x": x, "weight": weight, "eps": EPS}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def rms_norm_fp8_inputs(dims: Sequence[int] = (128, 256, 512, 1024), max_rows: int = 8) -> st.SearchStrategy[Case]:
    """``rms_norm_fp8(x bf16 [n, d], weight fp32 [d], eps)``, d a multiple of 128; rows from 2^-10 to 2^10 and
    all-zero rows (scale at the 1e-4 amax floor); one large outlier per block half the time (subnormal codes).
    No NaN is planted (the CUDA amax may drop NaN)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, d = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        x = _randn(g, n, d) * _row_scales(draw, g, n)
        if draw(st.booleans()):
            x[:, ::128] *= 300.0
        weight = _randn(g, d) if draw(st.booleans()) else 1 + 0.25 * _randn(g, d)
        return Case({"x": x.to(BF16), "weight": weight, "eps": EPS})

    return build()


def rms_norm_weightless_inputs(dims: Sequence[int] = (64, 128, 512), max_heads: int = 16, max_rows: int = 6,
                               nan_inputs: Sequence[str] = ("q",)) -> st.SearchStrategy[Case]:
    """``rms_norm_weightless(q bf16 [n, H, d], eps)`` (per-head query norm)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, h, d = draw(st.integers(1, max_rows)), draw(st.integers(1, max_heads)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        q = (_randn(g, n, h, d) * _row_scales(draw, g, n).view(n, 1, 1)).to(BF16)
        args = {"q": q, "eps": EPS}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


_POSITION_EDGES = (0, 1, 3, 4, 127, 128, 129, 4095, 65535, 65536, 2**20 - 1)


def apply_rope_inputs(dims: Sequence[int] = (64, 128, 512), max_heads: int = 16, max_rows: int = 8,
                      max_position: int = 2**20, nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``apply_rope(x bf16 [n, d] or [n, H, d], positions int64 [n], freqs fp32 [32])`` plus ``inverse=True``
    half the time; freqs of a ratio 0 / 4 / 128 layer of V4-Flash (YaRN on compressed layers), rope on the
    last 64 dims; positions consecutive or scattered, up to ``max_position`` (default 2^20)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, d = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        heads = draw(st.one_of(st.none(), st.integers(1, max_heads)))
        ratio = draw(st.sampled_from((0, 4, 128)))
        top = max(max_position - n, 0)
        base = draw(st.one_of(st.sampled_from([min(p, top) for p in _POSITION_EDGES]), st.integers(0, top)))
        g = _gen(draw)
        if draw(st.booleans()):
            positions = base + torch.arange(n)
        else:
            positions = torch.randint(0, max_position, (n,), generator=g)
        shape = (n, d) if heads is None else (n, heads, d)
        x = (_randn(g, *shape) * _row_scales(draw, g, n).view(n, *([1] * (len(shape) - 1)))).to(BF16)
        args = {"x": x, "positions": positions, "freqs": rope_oracle.inv_freq(_FLASH, ratio, FP32)}
        kwargs = {"inverse": True} if draw(st.booleans()) else {}
        return Case(args, kwargs, note=_join(f"ratio {ratio}", _plant_nan(draw, g, args, nan_inputs)))

    return build()


def kv_round_inputs(max_rows: int = 16) -> st.SearchStrategy[Case]:
    """``kv_round(kv bf16 [n, hd], 64, "fp8")``, hd = 128..512: per 64-block magnitudes 2^-30..2^12, all-zero
    blocks, blocks under the 1e-4 amax floor, blocks with one large outlier (subnormal e4m3 codes)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, blocks = draw(st.integers(1, max_rows)), draw(st.integers(1, 7))
        g = _gen(draw)
        kv = _randn(g, n, blocks + 1, 64)
        kind = torch.randint(0, 5, (n, blocks + 1, 1), generator=g)
        mag = torch.exp2(_uniform(g, -30, 12, n, blocks + 1, 1))
        kv = kv * torch.where(kind == 1, 0.0, torch.where(kind == 2, 1e-6, mag))
        outlier = (kind == 3).squeeze(-1)
        kv[..., 0] = torch.where(outlier, kv[..., 0] * 1e4, kv[..., 0])
        return Case({"kv": kv.flatten(1).to(BF16), "rope_dims": 64, "fmt": "fp8"})

    return build()


def kv_norm_rope_fp8_inputs(dims: Sequence[int] = (512, 512, 128), max_rows: int = 8,
                            max_position: int = 2**20) -> st.SearchStrategy[Case]:
    """``kv_norm_rope_fp8(x bf16 [n, hd], weight fp32 [hd], eps, positions int64 [n], freqs fp32 [32], fmt)``:
    the wkv GEMM output of rows from 2^-10 to 2^10, a large outlier in each 64-block half the time (subnormal
    codes), freqs of a ratio 0 / 4 / 128 layer of V4-Flash, positions up to ``max_position``, fmt "fp8" (the
    reference) or "bf16" (the ``bf16`` profile). No NaN is planted (the CUDA amax may drop NaN)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, d = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        ratio = draw(st.sampled_from((0, 4, 128)))
        g = _gen(draw)
        x = _randn(g, n, d) * _row_scales(draw, g, n)
        if draw(st.booleans()):
            x[:, ::64] *= 300.0
        weight = _randn(g, d) if draw(st.booleans()) else 1 + 0.25 * _randn(g, d)
        positions = torch.randint(0, max_position, (n,), generator=g)
        fmt = draw(st.sampled_from(("fp8", "fp8", "bf16")))
        args = {"x": x.to(BF16), "weight": weight, "eps": EPS, "positions": positions,
                "freqs": rope_oracle.inv_freq(_FLASH, ratio, FP32), "fmt": fmt}
        return Case(args, note=f"ratio {ratio}")

    return build()


_KEY_COUNTS = (0, 1, 2, 3, 4, 5, 31, 32, 33, 127, 128, 129)


def index_scores_inputs(dims: Sequence[int] = (32, 64, 128), max_heads: int = 16, max_queries: int = 6,
                        nan_inputs: Sequence[str] = ("q", "keys")) -> st.SearchStrategy[Case]:
    """``index_scores(q bf16 [n, h, d], keys bf16 [e, d], weights bf16 [n, h], torch.bfloat16)``: e = 0 (empty
    compressed cache) .. 160 keys, signed head weights, q / keys on the FP4 grid half the time."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, h, d = draw(st.integers(1, max_queries)), draw(st.integers(1, max_heads)), draw(st.sampled_from(tuple(dims)))
        e = draw(st.one_of(st.sampled_from(_KEY_COUNTS), st.integers(0, 160)))
        fp4 = draw(st.booleans())
        g = _gen(draw)
        q, keys = _randn(g, n, h, d), _randn(g, e, d)
        if fp4:
            q, keys = _on_fp4_grid(q), _on_fp4_grid(keys)
        weights = _randn(g, n, h) * (d**-0.5 * h**-0.5) * 2 ** float(draw(st.integers(-4, 4)))
        args = {"q": q.to(BF16), "keys": keys.to(BF16), "weights": weights.to(BF16), "dtype": BF16}
        return Case(args, note=_join(f"{e} keys", "fp4 grid" if fp4 else "", _plant_nan(draw, g, args, nan_inputs)))

    return build()


def index_scores_fp4_inputs(dims: Sequence[int] = (32, 64, 128), max_heads: int = 16,
                            max_queries: int = 6) -> st.SearchStrategy[Case]:
    """``index_scores_fp4(q bf16 [n, h, d], codes uint8 [e, d/2], scales uint8 [e, d/32], weights bf16 [n, h],
    torch.bfloat16)``: the keys of :func:`index_scores_inputs` quantized to the packed FP4 cache
    (``formats.quantize_fp4``, blocks of 32), key magnitudes spread over 2^+-20; a NaN only in q (the cache
    cannot hold one)."""

    @st.composite
    def build(draw: Callable) -> Case:
        c = draw(index_scores_inputs(dims, max_heads, max_queries, nan_inputs=("q",)))
        g = _gen(draw)
        keys = c["keys"].float()
        keys = keys * torch.exp2(_uniform(g, -20, 20, keys.shape[0], 1).round())
        codes, scales = quantize_fp4(keys, 32)
        args = {"q": c["q"], "codes": codes, "scales": scales, "weights": c["weights"], "dtype": BF16}
        return Case(args, note=c.note)

    return build()


def _fp4_keys_case(c: Case) -> Case:
    """The index_scores case on the dequantized keys of an index_scores_fp4 case."""
    keys = dequantize_fp4(c["codes"].cpu(), c["scales"].cpu(), 32).to(BF16)
    return Case({"q": c["q"], "keys": keys, "weights": c["weights"], "dtype": c["dtype"]})


_WINDOW_WIDTHS = (1, 2, 3, 4, 5, 63, 64, 65, 127, 128)
_TOPK_WIDTHS = (0, 1, 3, 4, 5, 63, 64, 65, 128, 129)
_MASKS = ("none", "scatter", "blocks", "all_but_first", "shuffle")


def sparse_attention_inputs(head_dims: Sequence[int] = (64, 128, 512), max_heads: int = 16, max_queries: int = 6,
                            nan_inputs: Sequence[str] = ("q", "kv")) -> st.SearchStrategy[Case]:
    """``sparse_attention(q bf16 [n, H, d], kv bf16 [m, d], idx int32 [n, K], sink fp32 [H], d^-0.5, "bf16")``.

    kv = [window rows | compressed rows] (compressed part possibly empty); each query's idx = window width
    (1..128) of valid rows with trailing -1, then a top-k part (0..129 wide, often wider than the compressed
    rows available, -1 padded); then -1 scattered, whole 64-blocks set to -1, everything but the first set to
    -1, or the columns shuffled (valid after -1). ``idx[:, 0]`` is always valid (DSv4 invariant).
    """

    @st.composite
    def build(draw: Callable) -> Case:
        h, d = draw(st.integers(1, max_heads)), draw(st.sampled_from(tuple(head_dims)))
        n = draw(st.integers(1, max_queries))
        win, topk = draw(st.sampled_from(_WINDOW_WIDTHS)), draw(st.sampled_from(_TOPK_WIDTHS))
        n_comp = draw(st.one_of(st.sampled_from((0, 1, 3, 4, 5, 64, 65)), st.integers(0, 140))) if topk else 0
        n_win = draw(st.integers(1, 160))
        mask = draw(st.sampled_from(_MASKS))
        temperature = draw(st.sampled_from((0.0, 0.5, 1.0, 3.0, 8.0)))
        kv_scale = draw(st.sampled_from((1 / 16, 1.0, 16.0)))
        g = _gen(draw)
        idx = torch.full((n, win + topk), -1, dtype=torch.int64)
        for i in range(n):
            w = _randint(g, 1, min(win, n_win))
            start = _randint(g, 0, n_win - w)
            idx[i, :w] = torch.arange(start, start + w)
            c = _randint(g, 0, min(topk, n_comp))
            idx[i, win : win + c] = n_win + torch.randperm(n_comp, generator=g)[:c]
        rest = idx[:, 1:]
        if mask == "scatter":
            p = draw(st.sampled_from((0.1, 0.5, 0.9)))
            rest[torch.rand(rest.shape, generator=g) < p] = -1
        elif mask == "blocks":
            for b in range(0, idx.shape[1], 64):
                if torch.rand((), generator=g) < 0.5:
                    idx[:, max(b, 1) : b + 64] = -1
        elif mask == "all_but_first":
            rest[:] = -1
        elif mask == "shuffle":
            for i in range(n):
                rest[i] = rest[i, torch.randperm(rest.shape[1], generator=g)]
        kv = (_randn(g, n_win + n_comp, d) * kv_scale).to(BF16)
        q = (_randn(g, n, h, d) * (temperature / kv_scale)).to(BF16)
        sink = _randn(g, h) * 2 + draw(st.sampled_from((0.0, 4.0, -8.0)))
        args = {"q": q, "kv": kv, "idx": idx.to(torch.int32), "sink": sink, "scale": d**-0.5, "fmt": "bf16"}
        note = f"window {win}, top-k {topk}, {n_comp} compressed rows, mask {mask}"
        return Case(args, note=_join(note, _plant_nan(draw, g, args, nan_inputs)))

    return build()


def _hc_weights(g: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    """fp32 [rows, HC * dim] mixing projection with O(1) outputs on rms-normalised streams."""
    return _randn(g, rows, HC * dim) * (HC * dim) ** -0.5


def hc_pre_inputs(dims: Sequence[int] = (16, 64, 128, 256), max_rows: int = 6,
                  nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``hc_pre(x bf16 [n, 4, dim], fn fp32 [24, 4*dim], scale fp32 [3], base fp32 [24], eps, 20, eps)``;
    comb logits up to ~10 wide (peaky Sinkhorn inputs)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, dim = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        x = (_randn(g, n, HC, dim) * _row_scales(draw, g, n).view(n, 1, 1)).to(BF16)
        scale = _uniform(g, 0.05, draw(st.sampled_from((0.5, 2.0, 5.0))), 3)
        args = {"x": x, "fn": _hc_weights(g, (2 + HC) * HC, dim), "scale": scale, "base": _randn(g, (2 + HC) * HC),
                "norm_eps": EPS, "iters": SINKHORN_ITERS, "hc_eps": EPS}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def hc_post_inputs(dims: Sequence[int] = (16, 64, 128, 256), max_rows: int = 6,
                   nan_inputs: Sequence[str] = ("f", "residual")) -> st.SearchStrategy[Case]:
    """``hc_post(f bf16 [n, dim], residual bf16 [n, 4, dim], post fp32 [n, 4], comb fp32 [n, 4, 4], bf16)``;
    comb = a 20-round Sinkhorn result (doubly stochastic, not symmetric)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, dim = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        f = (_randn(g, n, dim) * _row_scales(draw, g, n)).to(BF16)
        residual = (_randn(g, n, HC, dim) * _row_scales(draw, g, n).view(n, 1, 1)).to(BF16)
        post = 2 * torch.sigmoid(_randn(g, n, HC))
        comb = mhc_oracle.sinkhorn(_randn(g, n, HC, HC) * draw(st.sampled_from((0.5, 2.0, 4.0))), SINKHORN_ITERS, EPS)
        args = {"f": f, "residual": residual, "post": post, "comb": comb, "out_dtype": BF16}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def hc_head_inputs(dims: Sequence[int] = (16, 64, 128, 256), max_rows: int = 6,
                   nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``hc_head(x bf16 [n, 4, dim], fn fp32 [4, 4*dim], scale fp32 [1], base fp32 [4], eps, eps)``."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, dim = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        x = (_randn(g, n, HC, dim) * _row_scales(draw, g, n).view(n, 1, 1)).to(BF16)
        args = {"x": x, "fn": _hc_weights(g, HC, dim), "scale": _uniform(g, 0.05, 3.0, 1), "base": _randn(g, HC),
                "norm_eps": EPS, "hc_eps": EPS}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def sinkhorn_split_inputs(max_rows: int = 8, nan_inputs: Sequence[str] = ("mixes",)) -> st.SearchStrategy[Case]:
    """``sinkhorn_split(mixes fp32 [n, 24], scale fp32 [3], base fp32 [24], 4, 20, eps)``; logits from flat
    (converged after a few rounds) to ~20 wide (not converged after 20)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n = draw(st.integers(1, max_rows))
        g = _gen(draw)
        width = draw(st.sampled_from((0.1, 1.0, 3.0)))
        args = {"mixes": _randn(g, n, (2 + HC) * HC) * width, "scale": _uniform(g, 0.1, 3.0, 3),
                "base": _randn(g, (2 + HC) * HC), "hc": HC, "iters": SINKHORN_ITERS, "eps": EPS}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def gate_inputs(dims: Sequence[int] = (32, 64, 256), max_rows: int = 8) -> st.SearchStrategy[Case]:
    """``gate(x fp32 [n, dim], weight fp32 [E, dim], bias fp32 [E] | None, tid2eid int64 [64, k] | None,
    ids int64 [n], cfg)``: sqrt-softplus scores, biased top-k (bias large enough to change the selection)
    or a hash table; E in 4..64, k in 1..6, route_scale 1 / 1.5 / 2.5."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, dim = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        experts = draw(st.sampled_from((4, 8, 16, 64)))
        k = draw(st.integers(1, min(6, experts)))
        hashed = draw(st.booleans())
        cfg = ModelConfig(n_routed_experts=experts, n_activated_experts=k,
                          route_scale=draw(st.sampled_from((1.0, 1.5, 2.5))), score_func="sqrtsoftplus")
        g = _gen(draw)
        x = _randn(g, n, dim).to(BF16).float()
        weight = (_randn(g, experts, dim) * dim**-0.5).to(BF16).float()
        vocab = 64
        tid2eid = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(vocab)]) if hashed else None
        bias = None if hashed else _randn(g, experts) * draw(st.sampled_from((0.01, 0.3)))
        args = {"x": x, "weight": weight, "bias": bias, "tid2eid": tid2eid,
                "ids": torch.randint(0, vocab, (n,), generator=g), "cfg": cfg}
        return Case(args, note="hash layer" if hashed else "biased top-k")

    return build()


def expert_inputs(dims: Sequence[int] = (128, 256), inter_dims: Sequence[int] = (128, 256), max_rows: int = 6,
                  nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``expert(x bf16 [n, dim], w1 fp32 [inter, dim], w2 fp32 [dim, inter], w3 fp32 [inter, dim], limit,
    weight fp32 [n, 1] | None, "fp8")``: weights are exactly dequantized FP4 (routed) or FP8 128x128
    (shared) values; gate / up pre-activations reach ~+-30 so the swiglu clamp at 10 bites (not far beyond: past
    it, FP8 noise on a large pre-activation decides which side of the clamp it lands)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, dim = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        inter = draw(st.sampled_from(tuple(inter_dims)))
        routed = draw(st.booleans())
        limit = draw(st.sampled_from((0.0, 10.0)))
        gain = draw(st.sampled_from((0.5, 4.0)))
        g = _gen(draw)

        def w(rows: int, cols: int, scale: float) -> torch.Tensor:
            m = _randn(g, rows, cols) * scale * cols**-0.5
            return _on_fp4_grid(m) if routed else _on_fp8_grid(m)

        x = (_randn(g, n, dim) * torch.exp2(_uniform(g, -2, 2, n, 1))).to(BF16)
        weight = _uniform(g, 0.05, 1.0, n, 1) if routed else None
        args = {"x": x, "w1": w(inter, dim, gain), "w2": w(dim, inter, 1.0), "w3": w(inter, dim, gain),
                "limit": limit, "weight": weight, "act": "fp8"}
        note = _join("routed (FP4 weights)" if routed else "shared (FP8 weights)",
                     _plant_nan(draw, g, args, nan_inputs))
        return Case(args, note=note)

    return build()


def act_linear_inputs(dims: Sequence[int] = (128, 256, 512), out_dims: Sequence[int] = (128, 384),
                      max_rows: int = 6, nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``act_linear(x bf16 [n, k], weight fp32 [m, k], act)``: weights are exactly dequantized FP8 128x128 or
    FP4 1x32 values; rows of x span 2^-8 .. 2^8; act "fp8" (every FP8 / FP4 GEMM) or "bf16" (no activation
    quantization: the ``bf16`` profile)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, k, m = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims))), draw(st.sampled_from(out_dims))
        fp4 = draw(st.booleans())
        g = _gen(draw)
        w = _randn(g, m, k) * k**-0.5
        x = (_randn(g, n, k) * torch.exp2(_uniform(g, -8, 8, n, 1))).to(BF16)
        args = {"x": x, "weight": _on_fp4_grid(w) if fp4 else _on_fp8_grid(w),
                "act": draw(st.sampled_from(("fp8", "fp8", "bf16")))}
        note = _join("FP4 weights" if fp4 else "FP8 weights", _plant_nan(draw, g, args, nan_inputs))
        return Case(args, note=note)

    return build()


strategies = SimpleNamespace(
    act_linear_inputs=act_linear_inputs,
    rms_norm_inputs=rms_norm_inputs,
    rms_norm_fp8_inputs=rms_norm_fp8_inputs,
    rms_norm_weightless_inputs=rms_norm_weightless_inputs,
    apply_rope_inputs=apply_rope_inputs,
    kv_round_inputs=kv_round_inputs,
    kv_norm_rope_fp8_inputs=kv_norm_rope_fp8_inputs,
    index_scores_inputs=index_scores_inputs,
    index_scores_fp4_inputs=index_scores_fp4_inputs,
    sparse_attention_inputs=sparse_attention_inputs,
    hc_pre_inputs=hc_pre_inputs,
    hc_post_inputs=hc_post_inputs,
    hc_head_inputs=hc_head_inputs,
    sinkhorn_split_inputs=sinkhorn_split_inputs,
    gate_inputs=gate_inputs,
    expert_inputs=expert_inputs,
)
"""Namespace of the input strategies: ``strategies.sparse_attention_inputs(head_dims=(512,))`` etc. Pass one
to ``check_against_oracle(..., strategy=...)`` to narrow the inputs to what a kernel supports."""


# --------------------------------------------------------------------------------------------------------------
# expected results (oracle in fp64, or the bit-exact reference)
# --------------------------------------------------------------------------------------------------------------


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(FP64)


def _expected_act_linear(c: Case) -> tuple[torch.Tensor, ...]:
    return (linear_oracle.act_linear(_d(c["x"]), _d(c["weight"])),)


def _act_linear_bound(c: Case) -> torch.Tensor:
    """|error| <= (u8 + k 2^-23) sum_k |x_k| |w_jk| + 1.25u |y_j|: the e4m3 rounding of each x_k (u8 = 2^-4;
    0 for act "bf16"), the fp32 accumulation, and the bf16 rounding of the output."""
    x, w = _d(c["x"]), _d(c["weight"])
    absdot = x.abs() @ w.abs().T
    u8 = U_FP8 if c["act"] == "fp8" else 0.0
    return ((u8 + x.shape[-1] * 2.0**-23) * absdot + _ONE * (x @ w.T).abs()).nan_to_num(0.0)


def _expected_rms_norm(c: Case) -> tuple[torch.Tensor, ...]:
    return (norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"]),)


def _rms_norm_fp8_exact(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 y [n, d] and the lowest / highest ue8m0 scale [n, d/128] a bf16-rounded y (+-1.25u) can give."""
    y = norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"])
    amax = y.unflatten(-1, (-1, 128)).abs().amax(-1)
    lo, hi = (ue8m0_scale(amax * (1 + k * _ONE), FP8_MAX, FP8_AMAX_FLOOR).to(FP64) for k in (-1, 1))
    return y, lo, hi


def _expected_rms_norm_fp8(c: Case) -> tuple[torch.Tensor, ...]:
    """(exact y, mid-point of the admissible scale bytes); compared after :func:`_dequantize_codes`."""
    y, lo, hi = _rms_norm_fp8_exact(c)
    return y, (torch.log2(lo) + torch.log2(hi)) / 2 + 127


def _rms_norm_fp8_value_bound(c: Case) -> torch.Tensor:
    """|code * s - y| <= half an e4m3 step (2^-4 |y|, or 2^-10 s among the subnormal codes) + 1.25u |y|."""
    y, _, hi = _rms_norm_fp8_exact(c)
    return torch.maximum(U_FP8 * y.abs(), 2.0**-10 * hi.repeat_interleave(128, -1)) + _ONE * y.abs()


def _rms_norm_fp8_scale_bound(c: Case) -> torch.Tensor:
    _, lo, hi = _rms_norm_fp8_exact(c)
    return (torch.log2(hi) - torch.log2(lo)) / 2


def _dequantize_codes(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(codes e4m3, scale bytes) -> (dequantized fp64 values, scale bytes); expected outputs pass unchanged."""
    codes, scales = outs
    if codes.dtype != torch.float8_e4m3fn:
        return outs
    return dequantize_fp8(codes, scales, 128).to(FP64), scales


def _expected_rms_norm_weightless(c: Case) -> tuple[torch.Tensor, ...]:
    return (norms_oracle.rms_norm_weightless(_d(c["q"]), c["eps"]),)


def _expected_apply_rope(c: Case) -> tuple[torch.Tensor, ...]:
    """The oracle rotation in fp64, at the reference's fp32 angles ``fp32(position) * fp32(freq)``
    (``precompute_freqs_cis``): at position 2^20 an fp32 angle is off the exact product by up to 2^-4 rad, and
    that rounding is part of the model's definition, not error (one oracle call per row, position 1)."""
    return (_rope_at_fp32_angles(_d(c["x"]), c["positions"], c["freqs"], c.get("inverse", False)),)


def _rope_at_fp32_angles(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                         inverse: bool = False) -> torch.Tensor:
    """The oracle rotation of fp64 x [n, ...] at the angles ``fp32(position) * fp32(freq)``."""
    angles = positions.to(FP32)[:, None] * freqs.to(FP32)[None, :]
    one = torch.ones(1, dtype=torch.int64)
    return torch.cat([rope_oracle.apply_rope(x[i : i + 1], one, _d(angles[i]), inverse) for i in range(x.shape[0])])


def _rope_bound(c: Case) -> torch.Tensor:
    """Elementwise limit: 0 on the nope dims (must pass through unchanged), unbounded on the rope dims."""
    bound = torch.zeros(c["x"].shape, dtype=FP64)
    bound[..., -2 * c["freqs"].numel() :] = math.inf
    return bound


def kv_round_reference(kv: torch.Tensor, rope_dims: int, fmt: str) -> torch.Tensor:
    """Bit-exact reference of ``kv_round``: the reference's in-place ``act_quant(kv[..., :-rope_dims], 64,
    "ue8m0")`` = :func:`fidelity.formats.fake_quant_fp8` in 1x64 blocks on the nope dims; rope dims unchanged."""
    if fmt != "fp8":
        return kv
    return torch.cat((fake_quant_fp8(kv[..., :-rope_dims], 64), kv[..., -rope_dims:]), dim=-1)


def _expected_kv_round(c: Case) -> tuple[torch.Tensor, ...]:
    return (kv_round_reference(c["kv"], c["rope_dims"], c["fmt"]),)


def _expected_kv_norm_rope_fp8(c: Case) -> tuple[torch.Tensor, ...]:
    """The exact kv_norm then RoPE (fp64, reference angles); exact math has no FP8 rounding."""
    y = norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"])
    return (_rope_at_fp32_angles(y, c["positions"], c["freqs"]),)


def _kv_norm_rope_fp8_bound(c: Case) -> torch.Tensor:
    """Elementwise: the bf16 rounding of the norm (1.25u |y|); on the nope dims under "fp8" the e4m3 step
    (half an ulp: 2^-4 |y|, or 2^-10 s on the subnormal codes of a 1x64 block whose ue8m0 scale s may come
    from an amax 1.25u high); on the rope dims the norm's rounding carried through the rotation plus the
    output's rounding: 2 x 1.25u (|y_2i| + |y_2i+1|) for both elements of a pair."""
    y = norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"])
    rd = 2 * c["freqs"].numel()
    bound = _ONE * y.abs()
    nope = y[:, :-rd]
    if c["fmt"] == "fp8":
        amax = nope.unflatten(-1, (-1, 64)).abs().amax(-1)
        hi = ue8m0_scale(amax * (1 + _ONE), FP8_MAX, FP8_AMAX_FLOOR).to(FP64).repeat_interleave(64, -1)
        bound[:, :-rd] += torch.maximum(U_FP8 * nope.abs(), 2.0**-10 * hi)
    pairs = y[:, -rd:].abs().unflatten(-1, (-1, 2)).sum(-1, keepdim=True)
    bound[:, -rd:] = (2 * _ONE * pairs).expand(-1, -1, 2).flatten(1)
    return bound


def _expected_index_scores(c: Case) -> tuple[torch.Tensor, ...]:
    """``oracles.indexer.index_scores`` with nothing causally masked (every key visible)."""
    q, keys = _d(c["q"]), _d(c["keys"])
    positions = torch.full((q.shape[0],), keys.shape[0], dtype=torch.int64)
    return (indexer_oracle.index_scores(q, keys, _d(c["weights"]), positions, ratio=1),)


def _index_scores_bound(c: Case) -> torch.Tensor:
    """|error| <= 4u * sum_h |w_h| relu(q_h.k) + d 2^-23 * sum_h |w_h| (|q_h|.|k|): the bf16 dot, product and
    head-sum roundings (3u, +1u slack) of the terms, plus the fp32 dot accumulation (d 2^-24, x2)."""
    q, keys, w = _d(c["q"]), _d(c["keys"]), _d(c["weights"]).abs()
    terms = torch.einsum("nhd,ed->nhe", q, keys).relu()
    absdots = torch.einsum("nhd,ed->nhe", q.abs(), keys.abs())
    bound = 4 * U_BF16 * (terms * w[..., None]).sum(1) + q.shape[-1] * 2.0**-23 * (absdots * w[..., None]).sum(1)
    return bound.nan_to_num(0.0)


def _expected_sparse_attention(c: Case) -> tuple[torch.Tensor, ...]:
    """Gather ``kv[idx]``, rows of -1 zeroed (the kernel's ``if_then_else``) and masked, then
    ``oracles.attention.sparse_attention`` in fp64."""
    idx, kv = c["idx"].long(), _d(c["kv"])
    valid = idx >= 0
    rows = torch.where(valid[..., None], kv[idx.clamp(min=0)], 0.0)
    return (attention_oracle.sparse_attention(_d(c["q"]), rows, valid, _d(c["sink"]), c["scale"]),)


def _expected_hc_pre(c: Case) -> tuple[torch.Tensor, ...]:
    x = _d(c["x"])
    mixes = mhc_oracle.hc_mixes(x, _d(c["fn"]), c["norm_eps"])
    pre, post, comb = mhc_oracle.hc_split(mixes, _d(c["scale"]), _d(c["base"]), x.shape[1], c["iters"], c["hc_eps"])
    return mhc_oracle.hc_collapse(x, pre), pre, post, comb


def _expected_hc_post(c: Case) -> tuple[torch.Tensor, ...]:
    return (mhc_oracle.hc_post(_d(c["f"]), _d(c["residual"]), _d(c["post"]), _d(c["comb"])),)


def _expected_hc_head(c: Case) -> tuple[torch.Tensor, ...]:
    return (mhc_oracle.hc_head(_d(c["x"]), _d(c["fn"]), _d(c["scale"]), _d(c["base"]), c["norm_eps"], c["hc_eps"]),)


def _expected_sinkhorn_split(c: Case) -> tuple[torch.Tensor, ...]:
    return mhc_oracle.hc_split(_d(c["mixes"]), _d(c["scale"]), _d(c["base"]), c["hc"], c["iters"], c["eps"])


def _expected_gate(c: Case) -> tuple[torch.Tensor, ...]:
    return moe_oracle.gate(_d(c["x"]), _d(c["weight"]), _d(c["bias"]), c["tid2eid"], c["ids"], c["cfg"])


def _sort_topk(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(weights, indices) with each row sorted by expert id (top-k order is not part of the contract)."""
    weights, indices = outs
    indices, order = indices.long().sort(dim=-1)
    return weights.gather(-1, order), indices


def _expected_expert(c: Case) -> tuple[torch.Tensor, ...]:
    return (moe_oracle.expert(_d(c["x"]), _d(c["w1"]), _d(c["w2"]), _d(c["w3"]), c["limit"], _d(c["weight"])),)


# --------------------------------------------------------------------------------------------------------------
# contracts
# --------------------------------------------------------------------------------------------------------------

_ONE = SLACK * U_BF16  # one bf16 rounding of an fp32 result
_FP32_TOL = _rel(FP32_REL, "fp32 math throughout: roundoff 2^-24 grown by sums of <= 2^10 terms and 20 Sinkhorn "
                           "rounds stays under 2^-14 relative; a single bf16 rounding (2^-8) anywhere is 64x over")
_ONE_ROUNDING = "fp32 math rounded once to bf16: relative error <= u = 2^-8 (x1.25 for fp32 noise)"

CONTRACTS: dict[str, OpContract] = {
    "act_linear": OpContract(
        "act_linear", "tolerance", act_linear_inputs, _expected_act_linear,
        (Output("y", BF16, Tolerance(bound=_act_linear_bound, why=(
            "elementwise forward-error bound: one e4m3 rounding per activation (2^-4, act 'fp8') times "
            "sum_k |x_k w_jk|, fp32 accumulation (k 2^-23), one bf16 rounding of y (1.25u): rows of signed "
            "products cancel, so a per-row relative limit cannot hold"))),),
        "The FP8 / FP4 GEMM of every linear layer: x quantized e4m3 in 1x128 blocks with ue8m0 scales (spec §3 "
        "act_quant; not for act 'bf16'), products with the exactly dequantized weight accumulated in fp32, output "
        "bf16 (spec §3 fp8_gemm / fp4_gemm)."),
    "rms_norm": OpContract(
        "rms_norm", "tolerance", rms_norm_inputs, _expected_rms_norm,
        (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)),),
        "RMSNorm in fp32 with the fp32 weight, one bf16 rounding at the end (spec §3 'No fused RMSNorm kernel')."),
    "rms_norm_fp8": OpContract(
        "rms_norm_fp8", "tolerance", rms_norm_fp8_inputs, _expected_rms_norm_fp8,
        (Output("codes", torch.float8_e4m3fn, Tolerance(bound=_rms_norm_fp8_value_bound, why=(
            "dequantized codes vs the exact y, elementwise: the e4m3 round-to-nearest step (half an ulp: "
            "<= 2^-4 |y|, or 2^-10 s on the subnormal codes) plus the bf16 rounding of y (1.25u |y|)"))),
         Output("scales", torch.uint8, Tolerance(bound=_rms_norm_fp8_scale_bound, why=(
             "the ue8m0 byte of 2^ceil(log2(max(amax, 1e-4) / 448)) per 1x128 block, for an amax within "
             "1.25u of the exact one (two bytes are admissible only where that straddles a power of two)")))),
        "RMSNorm (as rms_norm) then the 1x128 e4m3 activation quantization of every FP8 GEMM input "
        "(spec §3 act_quant, ue8m0 scales). Exact math has no FP8 rounding, so the codes are judged by the "
        "rounding step they may take from the exact y.", canonical=_dequantize_codes),
    "rms_norm_act_quant": OpContract(
        "rms_norm_act_quant", "tolerance", rms_norm_fp8_inputs, lambda c: (_rms_norm_fp8_exact(c)[0],) * 2,
        (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)),
         Output("xq", BF16, Tolerance(bound=_rms_norm_fp8_value_bound, why=(
             "y quantized-dequantized vs the exact y, elementwise: rms_norm_fp8's bound on code * scale")))),
        "RMSNorm (as rms_norm) and the same y quantized-dequantized in 1x128 e4m3 blocks with ue8m0 scales, bf16 "
        "(spec §3 act_quant in place): the input of every FP8 GEMM the norm feeds, made once."),
    "rms_norm_weightless": OpContract(
        "rms_norm_weightless", "tolerance", rms_norm_weightless_inputs, _expected_rms_norm_weightless,
        (Output("q", BF16, _rel(3.5 * SLACK * U_BF16, cos_r=_ONE, why=(
            "every op in bf16: square (averaged in the mean), mean, +eps and rsqrt roundings give a per-row "
            "scale error <= 2.5u, plus u for the final product: |rel| <= 3.5u; the row scale does not move "
            "cos, so cos is held to one rounding (u)"))),),
        "q * rsqrt(mean(q^2) + eps) with each op rounding to bf16 (spec §4 Attention step 1)."),
    "apply_rope": OpContract(
        "apply_rope", "tolerance", apply_rope_inputs, _expected_apply_rope,
        (Output("x", BF16, replace(_rel(_ONE, _ONE_ROUNDING + "; the nope dims (all but the last 64) pass "
                                        "through: elementwise bound 0 there"), bound=_rope_bound)),),
        "Interleaved pairs (x[2i], x[2i+1]) of the last 64 dims rotated by fp32(position) * fp32(freq_i) (the "
        "reference's fp32 angle table: at 2^20 its rounding moves the phase by up to 2^-4 rad, so ports must "
        "reproduce it), cos/sin and the rotation in fp32, one bf16 rounding; inverse=True rotates by the "
        "conjugate (spec §4 Attention step 3)."),
    "kv_round": OpContract(
        "kv_round", "bitexact", kv_round_inputs, _expected_kv_round,
        (Output("kv", BF16, None),),
        "Exact math has no FP8 rounding, so the contract is bit-exactness (+0 == -0) against "
        "fake_quant_fp8(kv[..., :-64], 64) (the in-place act_quant, e4m3 RNE with 1x64 ue8m0 scales) with the "
        "64 rope dims unchanged (spec §3 'Where quantization lives'). No NaN is planted: the CUDA amax may "
        "drop NaN (fmaxf), which the CPU reference cannot decide."),
    "kv_norm_rope_fp8": OpContract(
        "kv_norm_rope_fp8", "tolerance", kv_norm_rope_fp8_inputs, _expected_kv_norm_rope_fp8,
        (Output("kv", BF16, Tolerance(bound=_kv_norm_rope_fp8_bound, why=(
            "elementwise vs the exact norm + rotation: one bf16 rounding of the norm (1.25u |y|), then on the "
            "nope dims the e4m3 round-to-nearest step of 1x64 blocks (fmt 'fp8'), on the rope dims that rounding "
            "carried through the rotation plus the output's (2 x 1.25u over the pair)"))),),
        "The attention KV path (spec §4 Attention steps 2-3): kv_norm (RMSNorm with weight, bf16 out), "
        "interleaved RoPE on the last 64 dims at fp32 angles (bf16 out), and the 1x64 ue8m0 e4m3 round of the "
        "nope dims (act_quant in place; fmt 'fp8'). Exact math has no FP8 rounding, so the nope dims are judged "
        "by the step they may take from the exact value."),
    "index_scores": OpContract(
        "index_scores", "tolerance", index_scores_inputs, _expected_index_scores,
        (Output("scores", BF16, Tolerance(bound=_index_scores_bound, why=(
            "elementwise forward-error bound 4u * sum_h |w_h| relu(q_h.k) + d 2^-23 * sum_h |w_h| |q_h|.|k|: "
            "signed head weights cancel, so a per-row relative (cos / calc_diff) limit cannot hold when a "
            "score is near 0; the bound is relative to the terms instead"))),),
        "sum_h w_h * relu(q_h . k_j) with the einsum, ReLU, product and head sum each rounding to bf16 "
        "(spec §4 Indexer), no causal mask (the caller masks)."),
    "index_scores_fp4": OpContract(
        "index_scores_fp4", "tolerance", index_scores_fp4_inputs,
        lambda c: _expected_index_scores(_fp4_keys_case(c)),
        (Output("scores", BF16, Tolerance(bound=lambda c: _index_scores_bound(_fp4_keys_case(c)), why=(
            "index_scores' elementwise bound on the dequantized keys (dequantization is exact)"))),),
        "index_scores against the packed FP4 key cache (codes: low nibble = element 2i; ue8m0 scale byte per "
        "32 dims; spec §3 fp4_act_quant, §4 Indexer), the keys' values e2m1 * 2^(b-127)."),
    "sparse_attention": OpContract(
        "sparse_attention", "tolerance", sparse_attention_inputs, _expected_sparse_attention,
        (Output("o", BF16, _rel(2 * SLACK * U_BF16, (
            "two bf16 roundings: P is cast to bf16 before P.V (the denominator keeps fp32 P), and the output; "
            "|rel| <= 2u per (query, head) row"))),),
        "Online softmax over idx (-1: row zeroed, logit -inf), sink in the denominator only "
        "(exp(sink - m), no value row), fp32 logits x scale, P rounded to bf16 for P.V, bf16 output "
        "(spec §3 sparse_attn). Expected: oracles.attention.sparse_attention in fp64 on the gathered rows."),
    "hc_pre": OpContract(
        "hc_pre", "tolerance", hc_pre_inputs, _expected_hc_pre,
        (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)), Output("pre", FP32, _FP32_TOL),
         Output("post", FP32, _FP32_TOL), Output("comb", FP32, _FP32_TOL)),
        "mixes = (flatten(x) @ fn^T) * rsqrt(mean(x^2) + eps) in fp32, hc_split_sinkhorn (20 rounds), "
        "y = sum_i pre_i x_i in fp32 -> bf16 (spec §4 mHC block)."),
    "hc_post": OpContract(
        "hc_post", "tolerance", hc_post_inputs, _expected_hc_post,
        (Output("out", BF16, _rel(_ONE, _ONE_ROUNDING)),),
        "out_k = post_k f + sum_j comb[j, k] residual_j (comb transposed) in fp32 -> bf16 (spec §4 mHC block)."),
    "hc_head": OpContract(
        "hc_head", "tolerance", hc_head_inputs, _expected_hc_head,
        (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)),),
        "pre = sigmoid(mixes * scale + base) + eps, y = sum_i pre_i x_i in fp32 -> bf16 (spec §4 head)."),
    "sinkhorn_split": OpContract(
        "sinkhorn_split", "tolerance", sinkhorn_split_inputs, _expected_sinkhorn_split,
        (Output("pre", FP32, _FP32_TOL), Output("post", FP32, _FP32_TOL), Output("comb", FP32, _FP32_TOL)),
        "hc_split_sinkhorn in fp32: sigmoid pre (+eps), 2*sigmoid post, comb = softmax + eps, column division, "
        "then 19 row/column rounds, ending column-normalised (spec §3)."),
    "gate": OpContract(
        "gate", "tolerance", gate_inputs, _expected_gate,
        (Output("weights", FP32, _FP32_TOL), Output("indices", None, None)),
        "sqrt(softplus(x @ W^T)) in fp32, top-k of scores + bias (or tid2eid[ids]), unbiased scores gathered, "
        "normalised, x route_scale (spec §4 MoE). Indices must be the same set per row (compared sorted).",
        canonical=_sort_topk),
    "expert": OpContract(
        "expert", "tolerance", expert_inputs, _expected_expert,
        (Output("y", BF16, _rel(2 * U_FP8 + 4 * U_BF16, (
            "two FP8 e4m3 activation roundings (x before w1/w3, the weighted h before w2; 2^-4 each) plus bf16 "
            "roundings of g, u, h and y: |rel| <= 2^-3 + 2^-6 per token row. Below this resolution: where "
            "the routing weight is applied (before/after w2 differ only by act-quant noise)"))),),
        "Clamped SwiGLU with FP8 (1x128 ue8m0) activation quantization before each GEMM, fp32 accumulation, "
        "routing weight applied to h before w2, bf16 output (spec §4 MoE)."),
}


# --------------------------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------------------------


def _nonfinite_code(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf (same shape, int8)."""
    code = torch.zeros(x.shape, dtype=torch.int8)
    if not x.is_floating_point():
        return code
    return code.masked_fill(x.isnan(), 1).masked_fill(x == math.inf, 2).masked_fill(x == -math.inf, 3)




def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _fmt_cos(v: float) -> str:
    return f"1 - {1 - v:.3g}" if 0.99 < v < 1 else _fmt(v)


def _exact_problems(name: str, found: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """Equal values (+0 == -0), NaN exactly where the reference has NaN."""
    f, r = found.to(FP64) if found.is_floating_point() else found, ref.to(FP64) if ref.is_floating_point() else ref
    bad = (f != r) & ~(_nonfinite_code(f).eq(1) & _nonfinite_code(r).eq(1))
    if not bool(bad.any()):
        return []
    first = int(bad.flatten().nonzero()[0])
    at = _at(ref.shape, first)
    return [f"output {name!r}: not exact: {int(bad.sum())} of {bad.numel()} elements differ; first at {at}: "
            f"expected {ref.flatten()[first].item()!r}, found {found.flatten()[first].item()!r}"]


def _tolerance_problems(name: str, found: torch.Tensor, ref: torch.Tensor, tol: Tolerance, case: Case) -> list[str]:
    problems = []
    cf, cr = _nonfinite_code(found), _nonfinite_code(ref)
    mismatch = cf != cr
    if bool(mismatch.any()):
        first = int(mismatch.flatten().nonzero()[0])
        problems.append(
            f"output {name!r}: non-finite pattern differs at {int(mismatch.sum())} of {mismatch.numel()} positions; "
            f"first at {_at(ref.shape, first)}: expected {ref.flatten()[first].item()!r}, "
            f"found {found.flatten()[first].item()!r}")
    both = (cf == 0) & (cr == 0)
    x = torch.where(both, ref.to(FP64), 0.0)
    y = torch.where(both, found.to(FP64), 0.0)
    if (tol.cos_min is not None or tol.calc_diff_max is not None) and ref.numel():
        d = ref.shape[-1] if ref.ndim else 1
        xr, yr = x.reshape(-1, d), y.reshape(-1, d)
        dot, xx, yy = (xr * yr).sum(-1), xr.square().sum(-1), yr.square().sum(-1)
        both_zero = (xx == 0) & (yy == 0)
        cos = torch.where(xx * yy > 0, dot / (xx * yy).sqrt(), both_zero.to(FP64))
        calc_diff = torch.where(both_zero, 0.0, 1 - 2 * dot / (xx + yy).clamp(min=1e-300))
        rows = ref.shape[:-1] if ref.ndim else torch.Size([])
        for metric, values, limit, worst_fn, ok in (
            ("cos", cos, tol.cos_min, torch.argmin, lambda v, lim: v >= lim),
            ("calc_diff", calc_diff, tol.calc_diff_max, torch.argmax, lambda v, lim: v <= lim),
        ):
            if limit is None or values.numel() == 0:
                continue
            w = int(worst_fn(values))
            v = float(values[w])
            if not ok(v, limit):
                e = int((xr[w] - yr[w]).abs().argmax())
                op, fmt = (">=", _fmt_cos) if metric == "cos" else ("<=", _fmt)
                problems.append(
                    f"output {name!r}: {metric} expected {op} {fmt(limit)}, found {fmt(v)} at row {_at(rows, w)} "
                    f"(rows over {list(rows)}, {d} elements each); worst element [{e}] of that row: "
                    f"expected {_fmt(float(xr[w, e]))}, found {_fmt(float(yr[w, e]))}")
    if tol.bound is not None:
        limit = tol.bound(case).to(FP64)
        err = (x - y).abs()
        over = err > limit
        if bool(over.any()):
            excess = torch.where(over, err - limit, -1.0)
            first = int(excess.flatten().argmax())
            problems.append(
                f"output {name!r}: elementwise error bound exceeded at {int(over.sum())} of {over.numel()} "
                f"positions; worst at {_at(ref.shape, first)}: expected {_fmt(float(x.flatten()[first]))} "
                f"+- {_fmt(float(limit.flatten()[first]))}, found {_fmt(float(y.flatten()[first]))}")
    return problems


def _to(v: Any, device: torch.device | str | None) -> Any:
    """A copy of tensor ``v`` on ``device`` (a copy even on the same device: kernels may work in place)."""
    return v.to(v.device if device is None else device, copy=True) if isinstance(v, torch.Tensor) else v


def check_case(op_name: str, fn: Callable[..., Any], case: Case, device: torch.device | str | None = None) -> None:
    """Run ``fn`` on one :class:`Case` (tensors moved to ``device``, results back to CPU) and compare with the
    contract of ``op_name``; raises AssertionError naming the op, output, metric, expected vs found and the
    input shapes."""
    contract = _contract(op_name)
    head = f"{op_name}: implementation {getattr(fn, '__name__', repr(fn))!r} fails its {contract.kind} contract"
    where = f"inputs: {case.describe()}"
    expected = contract.expected(case)
    args = [_to(v, device) for v in case.args.values()]
    kwargs = {k: _to(v, device) for k, v in case.kwargs.items()}
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # a crash on valid inputs is a contract failure too
        raise AssertionError(f"{head}\n  raised {type(exc).__name__}: {exc}\n  {where}") from exc
    found = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    names = [o.name for o in contract.outputs]
    if len(found) != len(names) or not all(isinstance(t, torch.Tensor) for t in found):
        kinds = [type(t).__name__ for t in found]
        raise AssertionError(f"{head}\n  expected {len(names)} tensor output(s) {names}, found {kinds}\n  {where}")
    found = tuple(t.detach().cpu() for t in found)
    problems = []
    for out, f, e in zip(contract.outputs, found, expected, strict=True):
        if tuple(f.shape) != tuple(e.shape):
            problems.append(f"output {out.name!r}: shape expected {list(e.shape)}, found {list(f.shape)}")
        if out.dtype is None and (f.is_floating_point() or f.is_complex() or f.dtype == torch.bool):
            problems.append(f"output {out.name!r}: dtype expected an integer dtype, found {f.dtype}")
        elif out.dtype is not None and f.dtype != out.dtype:
            problems.append(f"output {out.name!r}: dtype expected {out.dtype}, found {f.dtype}")
    if not problems:
        if contract.canonical is not None:
            found, expected = contract.canonical(found), contract.canonical(expected)
        for out, f, e in zip(contract.outputs, found, expected, strict=True):
            if out.tolerance is None:
                problems += _exact_problems(out.name, f, e)
            else:
                problems += _tolerance_problems(out.name, f, e, out.tolerance, case)
    if problems:
        raise AssertionError("\n  ".join([head, *problems, where]))


def _contract(op_name: str) -> OpContract:
    if op_name not in CONTRACTS:
        raise KeyError(f"op {op_name!r}: no contract; expected one of {sorted(CONTRACTS)}")
    return CONTRACTS[op_name]


def check_against_oracle(op_name: str, fn: Callable[..., Any], *, max_examples: int = 50,
                         device: torch.device | str | None = None, seed: int = 0,
                         strategy: st.SearchStrategy[Case] | None = None) -> None:
    """Property-test ``fn`` (called like the production op ``op_name``) against the op's contract.

    Hypothesis draws ``max_examples`` inputs from ``strategy`` (default: the contract's), derandomized by
    ``seed``, no deadline, no example database; inputs are moved to ``device`` (if given), outputs back to
    CPU. On failure raises AssertionError for the shrunk example (op, output, metric, expected vs found,
    input shapes; hypothesis adds the falsifying ``Case``).
    """
    contract = _contract(op_name)
    inputs = strategy if strategy is not None else contract.inputs()

    @settings(max_examples=max_examples, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=inputs)
    def run(case: Case) -> None:
        check_case(op_name, fn, case, device)

    hypothesis.seed(seed)(run)()


def check_all_registered(impl: str = "cpu", *, max_examples: int = 25, device: torch.device | str | None = None,
                         seed: int = 0) -> list[str]:
    """Check every op of the production REGISTRY that has implementation ``impl``; returns the op names
    checked, raises one AssertionError listing every failing op (and ops without a contract)."""
    from fidelity.production.registry import REGISTRY

    checked, failures = [], []
    for op, impls in sorted(REGISTRY.items()):
        if impl not in impls:
            continue
        checked.append(op)
        try:
            check_against_oracle(op, impls[impl], max_examples=max_examples, device=device, seed=seed)
        except (AssertionError, KeyError) as exc:
            failures.append(str(exc))
    if failures:
        raise AssertionError(f"{len(failures)} of {len(checked)} {impl!r} ops fail:\n" + "\n".join(failures))
    return checked
