"""FP8 / FP4 linear layers in exact math (spec §3 ``fp8_gemm`` / ``fp4_gemm``): the product the official GEMMs
approximate, without their activation rounding."""

from __future__ import annotations

import torch


def act_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, k] @ weight[m, k]^T -> [n, m], in x's dtype (fp64 in the contracts)."""
    return x @ weight.T
