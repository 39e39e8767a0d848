"""Hypothesis strategies of kernel-signature inputs, one per op (``strategies.<op>_inputs``, the name
``registry.OPS[op].strategy`` gives), drawn to cover what ports get wrong. Pass one, narrowed, to
``check_against_oracle(..., strategy=...)`` to draw only inputs a kernel supports:
``strategies.sparse_attention_inputs(head_dims=(512,))``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fidelity.decoders.profiles import CHOICES
from fidelity.model.config import ModelConfig
from fidelity.model.formats import (
    dequantize_fp4,
    encode_e8m0,
    fake_quant_fp8,
    quantize_fp4,
    quantize_fp8,
)
from fidelity.testing.cases import _FLASH, BF16, EPS, FP32, HC, SINKHORN_ITERS, Case, _at
from oracles import mhc as mhc_oracle
from oracles import rope as rope_oracle

KV_SCALE_FLOORS = CHOICES["kv_scale_floor"]  # the KV FP8 round's scale rules (profile field kv_scale_floor)

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


def kv_round_inputs(max_rows: int = 16,
                    scale_floors: Sequence[str] = KV_SCALE_FLOORS) -> st.SearchStrategy[Case]:
    """``kv_round(kv bf16 [n, hd], 64, "fp8", scale_floor)``, hd = 128..512: per 64-block magnitudes 2^-30..2^12,
    all-zero blocks, blocks under the 1e-4 amax floor, blocks with one large outlier (subnormal e4m3 codes);
    ``scale_floor`` one of ``scale_floors`` (profile field ``kv_scale_floor``: "amax", the official rule, or
    "scale", FlashMLA's; they differ on blocks with amax below 0.0274)."""

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
        return Case({"kv": kv.flatten(1).to(BF16), "rope_dims": 64, "fmt": "fp8",
                     "scale_floor": draw(st.sampled_from(tuple(scale_floors)))})

    return build()


def indexer_round_inputs(dims: Sequence[int] = (64, 128), max_rows: int = 6,
                         max_heads: int = 8) -> st.SearchStrategy[Case]:
    """``indexer_round(x bf16 [n, d] (keys) or [n, h, d] (queries), fmt, rotate)``: rows of magnitude 2^-40..2^40,
    all-zero rows and 32-blocks, a large outlier in a row half the time (its block's other values land on subnormal
    e2m1 steps), fmt mostly "fp4" (also "fp8" and "bf16"), with and without the Hadamard rotation. No NaN is planted
    (the CUDA amax may drop NaN, as for ``kv_round``)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, d = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        heads = draw(st.sampled_from((0, 1, draw(st.integers(2, max_heads)))))
        g = _gen(draw)
        lead = (n, heads) if heads else (n,)
        x = _randn(g, *lead, d) * torch.exp2(_uniform(g, -40, 40, *lead, 1))
        kind = torch.randint(0, 6, (*lead, 1), generator=g)
        x = torch.where(kind == 0, 0.0, x)
        blocks = x.unflatten(-1, (-1, 32))
        blocks[..., 0, :] = torch.where((kind == 1), 0.0, blocks[..., 0, :])
        x = blocks.flatten(-2)
        x[..., 1] = torch.where(kind[..., 0] >= 4, x[..., 1] * 2.0**12, x[..., 1])
        return Case({"x": x.to(BF16), "fmt": draw(st.sampled_from(("fp4", "fp4", "fp4", "fp8", "bf16"))),
                     "rotate": draw(st.booleans())})

    return build()


def compressor_decode_inputs(dims: Sequence[int] = (64, 128, 512)) -> st.SearchStrategy[Case]:
    """``compressor_decode(kv fp32 [1, w], score fp32 [1, w], ape fp32 [r, w], carry_kv fp32 [coff r, w],
    carry_score fp32 [coff r, w], pos int64 [1], norm fp32 [d], freqs fp32 [32], eps)``: r = 4 with overlap (w = 2d,
    the CSA main and indexer compressors) or 128 (HCA, w = d); positions up to 2^20, half of them completing a
    block; a fresh carry (scores -inf, as ``CompressorCarry.empty``) a quarter of the time, else carried rows of
    mixed magnitude; V4-Flash's RoPE frequencies of that ratio."""

    @st.composite
    def build(draw: Callable) -> Case:
        ratio, d = draw(st.sampled_from((4, 4, 128))), draw(st.sampled_from(tuple(dims)))
        coff = 2 if ratio == 4 else 1
        w, g = coff * d, _gen(draw)
        block = draw(st.integers(0, 2**20 // ratio - 1))
        phase = ratio - 1 if draw(st.booleans()) else draw(st.integers(0, ratio - 1))
        carry_kv = _randn(g, coff * ratio, w) * torch.exp2(_uniform(g, -4, 4, coff * ratio, 1))
        carry_score = _randn(g, coff * ratio, w) * 3
        if draw(st.integers(0, 3)) == 0:
            carry_kv, carry_score = torch.zeros_like(carry_kv), torch.full_like(carry_score, float("-inf"))
        return Case({"kv": _randn(g, 1, w) * 4, "score": _randn(g, 1, w) * 3, "ape": _randn(g, ratio, w) * 0.5,
                     "carry_kv": carry_kv, "carry_score": carry_score,
                     "pos": torch.tensor([block * ratio + phase]), "norm": 1 + 0.1 * _randn(g, d),
                     "freqs": rope_oracle.inv_freq(_FLASH, ratio, FP32), "eps": EPS},
                    note=f"ratio {ratio}, phase {phase}")

    return build()


def kv_norm_rope_fp8_inputs(dims: Sequence[int] = (512, 512, 128), max_rows: int = 8, max_position: int = 2**20,
                            scale_floors: Sequence[str] = KV_SCALE_FLOORS) -> st.SearchStrategy[Case]:
    """``kv_norm_rope_fp8(x bf16 [n, hd], weight fp32 [hd], eps, positions int64 [n], freqs fp32 [32], fmt,
    scale_floor)``: the wkv GEMM output of rows from 2^-10 to 2^10, a large outlier in each 64-block half the time
    (subnormal codes), freqs of a ratio 0 / 4 / 128 layer of V4-Flash, positions up to ``max_position``, fmt "fp8"
    (the reference) or "bf16" (the ``bf16`` profile), ``scale_floor`` one of ``scale_floors`` (profile field
    ``kv_scale_floor``, as :func:`kv_round_inputs`). No NaN is planted (the CUDA amax may drop NaN)."""

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
                "freqs": rope_oracle.inv_freq(_FLASH, ratio, FP32), "fmt": fmt,
                "scale_floor": draw(st.sampled_from(tuple(scale_floors)))}
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


KV_ROPE_DIMS = 64  # rope dims of a packed FP8 KV row (the production layout's)


def _packed_fp8_kv(kv: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """kv [m, d] -> packed FP8 rows uint8 [m, bytes], assembled here from ``quantize_fp8`` (independent of the
    production packer): [d - rope_dims e4m3 codes (1x64 ue8m0) | rope dims as raw bf16 | scale bytes | zero pad to
    a multiple of 8]."""
    nope = kv.shape[1] - rope_dims
    codes, scales = quantize_fp8(kv[:, :nope], 64)
    parts = [codes.view(torch.uint8), kv[:, nope:].contiguous().view(torch.uint8), scales]
    used = nope + 2 * rope_dims + nope // 64
    parts.append(torch.zeros(kv.shape[0], -used % 8, dtype=torch.uint8))
    return torch.cat(parts, dim=1)


def sparse_attention_fp8kv_inputs(head_dims: Sequence[int] = (128, 512)) -> st.SearchStrategy[Case]:
    """``sparse_attention_fp8kv(q, kv_packed uint8 [m, bytes], idx, sink, scale, 64)``: the draws of
    :func:`sparse_attention_inputs` (NaN planted in q or kv included) with kv stored as packed FP8 rows."""

    def packed(case: Case) -> Case:
        a = case.args
        args = {"q": a["q"], "kv_packed": _packed_fp8_kv(a["kv"], KV_ROPE_DIMS), "idx": a["idx"], "sink": a["sink"],
                "scale": a["scale"], "rope_dims": KV_ROPE_DIMS}
        return Case(args, note=case.note)

    return sparse_attention_inputs(head_dims=head_dims).map(packed)


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


def fp8_weight_linear_inputs(dims: Sequence[int] = (128, 256, 512), out_dims: Sequence[int] = (128, 256, 384),
                             max_rows: int = 6, nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``fp8_weight_linear(x bf16 [n, groups * k], codes e4m3 [m, k], scales fp32 [m/128, k/128], act, groups)``:
    the weight as stored, 128x128 blocks with power-of-two scales (the decode GEMV path); x rows span 2^-8 .. 2^8;
    with m = 256, a third of the cases grouped (wo_a: 2 groups of 128 rows, each reading its own k columns of x)."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, k, m = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims))), draw(st.sampled_from(out_dims))
        groups = draw(st.sampled_from((1, 1, 2))) if m % 256 == 0 else 1
        g = _gen(draw)
        b = (_randn(g, m, k) * k**-0.5).reshape(m // 128, 128, k // 128, 128)
        s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(dim=(1, 3), keepdim=True).clamp(min=2.0**-100) / 448)))
        codes = (b / s).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(m, k)
        x = (_randn(g, n, groups * k) * torch.exp2(_uniform(g, -8, 8, n, 1))).to(BF16)
        args = {"x": x, "codes": codes, "scales": s[:, 0, :, 0].contiguous(),
                "act": draw(st.sampled_from(("fp8", "fp8", "bf16"))), "groups": groups}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def fp32_linear_inputs(dims: Sequence[int] = (128, 256, 512), out_dims: Sequence[int] = (16, 128, 200),
                       max_rows: int = 6, nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``fp32_linear(x bf16 [n, k], weight bf16 [m, k])``: the compressors' stacked wkv / wgate at decode; rows of
    x span 2^-8 .. 2^8, the weight's rows 2^-4 .. 2^4."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, k, m = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims))), draw(st.sampled_from(out_dims))
        g = _gen(draw)
        weight = (_randn(g, m, k) * k**-0.5 * torch.exp2(_uniform(g, -4, 4, m, 1))).to(BF16)
        x = (_randn(g, n, k) * torch.exp2(_uniform(g, -8, 8, n, 1))).to(BF16)
        args = {"x": x, "weight": weight}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def fp4_picked_linear_inputs(dims: Sequence[int] = (256, 512), out_dims: Sequence[int] = (64, 128),
                             max_rows: int = 6, nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``fp4_picked_linear(x bf16 [s, k], experts int64 [s], packed uint8 [E, n, k/2], scales uint8 [E, n, k/32],
    act)``: each row multiplies its own expert's FP4 weight (e2m1 codes, low nibble first, power-of-two 1x32
    scales as stored: e8m0 bytes); experts repeat and skip ids."""

    @st.composite
    def build(draw: Callable) -> Case:
        rows, k, n = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims))), draw(st.sampled_from(out_dims))
        e_count = draw(st.integers(1, 5))
        g = _gen(draw)
        b = (_randn(g, e_count, n, k) * k**-0.5).unflatten(-1, (-1, 32))
        s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6)))
        mag = torch.bucketize((b / s).abs(), (_FP4_VALUES[1:] + _FP4_VALUES[:-1]) / 2)  # e2m1 magnitude code 0..7
        codes = (mag + 8 * (b < 0)).to(torch.uint8).flatten(-2)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        experts = torch.randint(0, e_count, (rows,), generator=g)
        x = (_randn(g, rows, k) * torch.exp2(_uniform(g, -8, 8, rows, 1))).to(BF16)
        args = {"x": x, "experts": experts, "packed": packed, "scales": encode_e8m0(s[..., 0].contiguous()),
                "act": draw(st.sampled_from(("fp8", "fp8", "bf16")))}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def _fp4_stored(g: torch.Generator, e_count: int, rows: int, cols: int, gain: float) -> tuple[torch.Tensor, ...]:
    """e_count random FP4 weights [rows, cols] of scale gain / sqrt(cols) as stored: (packed e2m1 codes uint8
    [e_count, rows, cols/2], low nibble first; power-of-two 1x32 scales as e8m0 bytes uint8 [e_count, rows,
    cols/32])."""
    b = (_randn(g, e_count, rows, cols) * gain * cols**-0.5).unflatten(-1, (-1, 32))
    s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6)))
    mag = torch.bucketize((b / s).abs(), (_FP4_VALUES[1:] + _FP4_VALUES[:-1]) / 2)
    codes = (mag + 8 * (b < 0)).to(torch.uint8).flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), encode_e8m0(s[..., 0].contiguous())


def grouped_expert_inputs(dims: Sequence[int] = (128, 256), inter_dims: Sequence[int] = (128, 256),
                          max_rows: int = 6, nan_inputs: Sequence[str] = ("x",)) -> st.SearchStrategy[Case]:
    """``grouped_expert(x bf16 [n, dim], weights fp32 [n, k], experts int64 [n, k], w13 uint8 [E, 2 f, dim/2],
    w13_scales uint8 [E, 2 f, dim/32], w2 uint8 [E, dim, f/2], w2_scales uint8 [E, dim, f/32] (e8m0 bytes), limit,
    act, quantized)``: distinct experts per token, some experts without tokens; magnitudes as ``expert_inputs``'
    routed case (pre-activations reach ~+-30, so the clamp at 10 bites); ``quantized`` x on its e4m3 grid."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, dim = draw(st.integers(1, max_rows)), draw(st.sampled_from(tuple(dims)))
        inter, e_count = draw(st.sampled_from(tuple(inter_dims))), draw(st.integers(1, 5))
        k = draw(st.integers(1, min(3, e_count)))
        gain, g = draw(st.sampled_from((0.5, 4.0))), _gen(draw)
        w13, w13_scales = _fp4_stored(g, e_count, 2 * inter, dim, gain)
        w2, w2_scales = _fp4_stored(g, e_count, dim, inter, 1.0)
        experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(n)])
        x = (_randn(g, n, dim) * torch.exp2(_uniform(g, -2, 2, n, 1))).to(BF16)
        act, quantized = draw(st.sampled_from((("fp8", False), ("fp8", True), ("bf16", False))))
        args = {"x": fake_quant_fp8(x, 128) if quantized else x, "weights": _uniform(g, 0.05, 1.0, n, k),
                "experts": experts, "w13": w13, "w13_scales": w13_scales, "w2": w2, "w2_scales": w2_scales,
                "limit": draw(st.sampled_from((0.0, 10.0))), "act": act, "quantized": quantized}
        return Case(args, note=_plant_nan(draw, g, args, nan_inputs))

    return build()


def take_inputs(max_stack: int = 8, max_rows: int = 64) -> st.SearchStrategy[Case]:
    """``take(stack bf16 [E, r, c], index int64 [1])``: E in 1..8, rows and columns from 1 (one element) to a few
    thousand elements in all (several 4096-element blocks), any in-range index, a NaN planted now and then."""

    @st.composite
    def build(draw: Callable) -> Case:
        e, rows, cols = draw(st.integers(1, max_stack)), draw(st.integers(1, max_rows)), draw(st.integers(1, 160))
        g = _gen(draw)
        args = {"stack": _randn(g, e, rows, cols).to(BF16),
                "index": torch.tensor([draw(st.integers(0, e - 1))], dtype=torch.int64)}
        return Case(args, note=_plant_nan(draw, g, args, ("stack",)))

    return build()


def _decode_step(draw: Callable, windows: Sequence[int]) -> tuple[dict[str, Any], str]:
    """A decode step's position and layer: window, ratio (0: window only, 4: CSA with the indexer's picks, 128: HCA)
    and position drawn around the window's and the compression's boundaries."""
    window, ratio = draw(st.sampled_from(tuple(windows))), draw(st.sampled_from((0, 4, 128)))
    edge = draw(st.sampled_from((window - 2, window - 1, window, 4 * ratio - 1, 4 * ratio, 0)))
    pos = max(0, edge + draw(st.integers(-1, 1))) if draw(st.booleans()) else draw(st.integers(0, 4096))
    n_entries = max(1, (pos + 1) // ratio + draw(st.integers(0, 3))) if ratio else 0
    picks = None
    if ratio == 4:  # top-k picks: entries below and past the causal limit, and -1 (none)
        g = _gen(draw)
        k = draw(st.integers(1, 16))
        picks = torch.randint(-1, n_entries + 2, (1, k), generator=g, dtype=torch.int64)
    args = {"pos": torch.tensor([pos], dtype=torch.int64), "picks": picks, "window": window, "ratio": ratio,
            "n_compressed": n_entries if ratio == 128 else 0}
    return args, f"pos {pos}, window {window}, ratio {ratio}"


def decode_slots_inputs(windows: Sequence[int] = (1, 4, 8, 128)) -> st.SearchStrategy[Case]:
    """``decode_slots(pos int64 [1], picks int64 [1, k] | None, window, ratio, n_compressed)``: positions around the
    window's fill and the compression blocks; CSA picks below and past the causal limit and -1."""

    @st.composite
    def build(draw: Callable) -> Case:
        args, note = _decode_step(draw, windows)
        return Case(args, note=note)

    return build()


def decode_idx_inputs(windows: Sequence[int] = (1, 4, 8, 128)) -> st.SearchStrategy[Case]:
    """``decode_idx``: the inputs of :func:`decode_slots_inputs`."""
    return decode_slots_inputs(windows)


def mask_past_inputs(max_entries: int = 300) -> st.SearchStrategy[Case]:
    """``mask_past(scores bf16 [1, n], pos int64 [1], ratio)``: n from 1, positions whose causal limit lies before,
    inside and past the scores, ratio 4 or 128."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, ratio = draw(st.integers(1, max_entries)), draw(st.sampled_from((4, 128)))
        g = _gen(draw)
        pos = draw(st.integers(0, (n + 2) * ratio))
        return Case({"scores": _randn(g, 1, n).to(BF16), "pos": torch.tensor([pos], dtype=torch.int64),
                     "ratio": ratio})

    return build()


def radix_topk_inputs(max_rows: int = 4, max_entries: int = 600) -> st.SearchStrategy[Case]:
    """``radix_topk(scores bf16 / fp32 [r, n], k)``, 0 <= k <= n: scores drawn from a few values (many ties), with
    -0.0 beside +0.0, +-inf and NaN of either sign now and then."""

    @st.composite
    def build(draw: Callable) -> Case:
        rows, n = draw(st.integers(1, max_rows)), draw(st.integers(1, max_entries))
        g = _gen(draw)
        levels = draw(st.sampled_from((3, 17, 1 << 20)))
        scores = torch.randint(-levels, levels + 1, (rows, n), generator=g).float() / levels
        specials = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan"), -float("nan")])
        if draw(st.booleans()):
            where = torch.rand(rows, n, generator=g) < 0.05
            scores = torch.where(where, specials[torch.randint(0, 6, (rows, n), generator=g)], scores)
        dtype = draw(st.sampled_from((BF16, FP32)))
        return Case({"scores": scores.to(dtype), "k": draw(st.integers(0, n))}, note=f"{levels} levels")

    return build()


def moe_sum_inputs(dims: Sequence[int] = (1, 64, 1000, 2048), max_rows: int = 6) -> st.SearchStrategy[Case]:
    """``moe_sum(out bf16 [n, k, dim], shared bf16 [n, dim])``: k in 1..8 slots, magnitudes spread over 2^-8..2^8
    (the fp32 sum's order shows in its bits), a NaN planted now and then."""

    @st.composite
    def build(draw: Callable) -> Case:
        n, k, dim = draw(st.integers(0, max_rows)), draw(st.integers(1, 8)), draw(st.sampled_from(tuple(dims)))
        g = _gen(draw)
        scale = torch.exp2(_uniform(g, -8, 8, n, k, 1))
        args = {"out": (_randn(g, n, k, dim) * scale).to(BF16), "shared": _randn(g, n, dim).to(BF16)}
        return Case(args, note=_plant_nan(draw, g, args, ("out", "shared")))

    return build()


def put_at_block_end_inputs(max_capacity: int = 40,
                            widths: Sequence[int] = (1, 64, 584, 5000)) -> st.SearchStrategy[Case]:
    """``put_at_block_end(store bf16 [capacity, w], pos int64 [1], ratio, offset, row bf16 [1, w], ring)``: ratio 1
    (a window row, ring = capacity, positions past it wrap), 4 or 128 (compressed entries after an offset), positions
    at a block's last token, one before and one after."""

    @st.composite
    def build(draw: Callable) -> Case:
        cap, width = draw(st.integers(2, max_capacity)), draw(st.sampled_from(tuple(widths)))
        ratio = draw(st.sampled_from((1, 4, 128)))
        g = _gen(draw)
        if ratio == 1:
            offset, ring, pos = 0, cap, draw(st.integers(0, 4 * cap))
        else:
            offset, ring = draw(st.integers(0, cap - 1)), 0
            block = draw(st.integers(0, cap - offset - 1))  # its entry's slot fits the store
            pos = max(0, block * ratio + ratio - 1 + draw(st.integers(-1, 1)))
        args = {"store": _randn(g, cap, width).to(BF16), "pos": torch.tensor([pos], dtype=torch.int64),
                "ratio": ratio, "offset": offset, "row": _randn(g, 1, width).to(BF16), "ring": ring}
        return Case(args, note=f"pos {pos}, ratio {ratio}")

    return build()
