"""Interleaved partial RoPE on the last ``rope_head_dim`` dims, with YaRN on compressed layers (spec §4).

Sliding-window-only layers (ratio 0): theta = rope_theta, no YaRN. Compressed layers (ratio 4 / 128):
theta = compress_rope_theta with YaRN when original_seq_len > 0. No mscale anywhere (unit magnitude).
Frequencies follow the official ``precompute_freqs_cis`` recipe, evaluated in the oracle's dtype (fp32
reproduces the reference's fp32 angles bit for bit; fp64 is the exact-math variant).
"""

from __future__ import annotations

import math

import torch

from fidelity.model.config import ModelConfig


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original_seq_len: int):
    """(low, high) frequency indices of the YaRN ramp, clamped to [0, dim - 1]."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


def inv_freq(cfg: ModelConfig, ratio: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rope_head_dim // 2] angular frequency per interleaved pair for a layer of this compress ratio."""
    dim = cfg.rope_head_dim
    base = cfg.compress_rope_theta if ratio else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    if ratio and cfg.original_seq_len > 0:
        low, high = yarn_correction_range(cfg.beta_fast, cfg.beta_slow, dim, base, cfg.original_seq_len)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of the last ``2 * len(freqs)`` dims by ``position * freqs[i]``.

    x [n, ..., d] with one position per row of dim 0; positions [n] int. ``inverse`` rotates by the
    conjugate (de-rotation of the attention output at the query position).
    """
    rd = 2 * freqs.numel()
    angles = positions.to(freqs.dtype)[:, None] * freqs[None, :]  # [n, rd/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (rd // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -rd:].unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated), dim=-1)
