"""RMSNorm, weighted and weightless (spec §4). Exact math in the input's dtype."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim. x [..., d], weight [d]."""
    return weight.to(x.dtype) * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def rms_norm_weightless(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head query norm without a weight: ``x / sqrt(mean(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
