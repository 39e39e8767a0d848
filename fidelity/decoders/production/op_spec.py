"""The op specs the CPU emulation (``ops``) and the GPU kernels (``kernels/``) share: what inputs an op takes (the
dtype / shape checks that name the wrong tensor), the decode GEMV's row limit and the fp32 RoPE angle table both
rotate with. Torch only: importing it needs no triton, and neither side imports the other for these."""

from __future__ import annotations

import torch

GEMV_ROWS = 8  # GEMMs of at most this many rows may read the stored FP8 / FP4 weights (weight_gemv.py)


def check_grouped_expert(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                         w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor) -> None:
    """Raise ValueError naming the first of op ``grouped_expert``'s tensors with a wrong dtype or shape: x bf16
    [n, dim], weights fp32 [n, k], experts integer [n, k], w13 uint8 [E, 2 f, dim/2] with e8m0 scale bytes uint8
    [E, 2 f, dim/32], w2 uint8 [E, dim, f/2] with e8m0 scale bytes uint8 [E, dim, f/32] (the stored FP4 experts,
    spec §2). Reads no tensor's values (the expert-id range is checked where the ids are read)."""
    def bad(name: str, t: torch.Tensor, want: str) -> None:
        raise ValueError(f"grouped_expert: {name}: expected {want}, found {t.dtype} {list(t.shape)}")

    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 32:
        bad("x", x, "bf16 [n, dim] with 32 | dim")
    n, dim = x.shape
    if experts.dtype.is_floating_point or experts.dtype == torch.bool or experts.dim() != 2 or experts.shape[0] != n:
        bad("experts", experts, f"integer ids [{n}, k]")
    k = experts.shape[1]
    if weights.dtype != torch.float32 or tuple(weights.shape) != (n, k):
        bad("weights", weights, f"fp32 [{n}, {k}]")
    if w13.dtype != torch.uint8 or w13.dim() != 3 or w13.shape[2] * 2 != dim or w13.shape[1] % 64:
        bad("w13", w13, f"packed FP4 codes uint8 [E, 2 f, {dim // 2}] with 32 | f")
    e_count, f = w13.shape[0], w13.shape[1] // 2
    if w13_scales.dtype != torch.uint8 or tuple(w13_scales.shape) != (e_count, 2 * f, dim // 32):
        bad("w13_scales", w13_scales, f"e8m0 scale bytes uint8 [{e_count}, {2 * f}, {dim // 32}]")
    if w2.dtype != torch.uint8 or tuple(w2.shape) != (e_count, dim, f // 2):
        bad("w2", w2, f"packed FP4 codes uint8 [{e_count}, {dim}, {f // 2}]")
    if w2_scales.dtype != torch.uint8 or tuple(w2_scales.shape) != (e_count, dim, f // 32):
        bad("w2_scales", w2_scales, f"e8m0 scale bytes uint8 [{e_count}, {dim}, {f // 32}]")


def check_fp4_picked_linear(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor,
                            scales: torch.Tensor) -> None:
    """Raise ValueError naming the first of op ``fp4_picked_linear``'s tensors with a wrong dtype or shape: x
    [s, k] with 32 | k, experts integer [s], packed FP4 codes uint8 [E, n, k/2] and their e8m0 scale bytes uint8
    [E, n, k/32] (the stored FP4 experts, spec §2). Reads no tensor's values."""
    def bad(name: str, t: torch.Tensor, want: str) -> None:
        raise ValueError(f"fp4_picked_linear: {name}: expected {want}, found {t.dtype} {list(t.shape)}")

    if x.dim() != 2 or x.shape[1] % 32:
        bad("x", x, "[s, k] with 32 | k")
    s, k = x.shape
    if experts.dtype.is_floating_point or experts.dtype == torch.bool or tuple(experts.shape) != (s,):
        bad("experts", experts, f"integer ids [{s}]")
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] * 2 != k:
        bad("packed", packed, f"packed FP4 codes uint8 [E, n, {k // 2}]")
    e_count, n = packed.shape[:2]
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (e_count, n, k // 32):
        bad("scales", scales, f"e8m0 scale bytes uint8 [{e_count}, {n}, {k // 32}]")


def expert_range_error(lo: int, hi: int, e_count: int) -> str | None:
    """The message for expert ids spanning [lo, hi] outside [0, e_count) (None: in range)."""
    if lo < 0 or hi >= e_count:
        return f"grouped_expert: experts: expected ids in [0, {e_count}), found [{lo}, {hi}]"
    return None


def rope_table(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """complex64 [n, rd/2] = polar(1, position * freq) with fp32 angles (``precompute_freqs_cis``)."""
    angles = torch.outer(positions.to(torch.float32), freqs.to(torch.float32))
    return torch.polar(torch.ones_like(angles), angles)
