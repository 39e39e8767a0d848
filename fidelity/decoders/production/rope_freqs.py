"""The production path's RoPE frequencies (spec §4 ``precompute_freqs_cis``), written apart from the oracle's so
that a mistake in one shows as a difference in every mode.

Sliding-window layers: ``theta = rope_theta``. Compressed layers: ``theta = compress_rope_theta`` with YaRN when
``original_seq_len > 0``: below the ramp's low index the frequency is divided by ``rope_factor``, above its high
index it is kept, linearly blended in between. Computed in fp32 as the official code does.
"""

from __future__ import annotations

import math

import torch

from fidelity.model.config import ModelConfig


def _yarn_bounds(cfg: ModelConfig, base: float) -> tuple[float, float]:
    """The ramp's (low, high) pair indices: where a pair turns ``beta_fast`` / ``beta_slow`` times over the
    original context, floored / ceiled and clamped to [0, rd - 1]; equal bounds are split by 0.001."""
    rd = cfg.rope_head_dim

    def pair_index(turns: float) -> float:
        return rd * math.log(cfg.original_seq_len / (2 * math.pi * turns)) / (2 * math.log(base))

    low = max(math.floor(pair_index(cfg.beta_fast)), 0)
    high = min(math.ceil(pair_index(cfg.beta_slow)), rd - 1)
    return low, high + 0.001 if low == high else high


def rope_inv_freq(cfg: ModelConfig, ratio: int) -> torch.Tensor:
    """fp32 [rope_head_dim // 2]: the angular frequency of each interleaved pair in a layer of ``ratio``."""
    rd = cfg.rope_head_dim
    base = cfg.compress_rope_theta if ratio else cfg.rope_theta
    exponents = torch.arange(0, rd, 2, dtype=torch.float32) / rd
    freqs = 1.0 / (base**exponents)
    if not ratio or cfg.original_seq_len <= 0:
        return freqs
    low, high = _yarn_bounds(cfg, base)
    keep = 1 - ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freqs / cfg.rope_factor * (1 - keep) + freqs * keep
