"""Manifold-constrained hyper-connections (mHC): hc_pre with Sinkhorn, hc_post, hc_head (spec §3-§4).

Streams x are [n, hc, dim]. ``fn`` [(2+hc)*hc, hc*dim], ``base`` [(2+hc)*hc], ``scale`` [3].
"""

from __future__ import annotations

import torch


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """[n, hc, dim] -> [n, rows(fn)]: ``(flatten(x) @ fn^T) * rsqrt(mean(flatten(x)^2) + eps)``."""
    xf = x.flatten(1)  # [n, hc*dim]
    return (xf @ fn.to(x.dtype).T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[n, hc, hc] logits C[j, k] -> doubly-stochastic matrix, ending column-normalised.

    ``softmax_k + eps``, divide by (column sum + eps), then ``iters - 1`` rounds of row then column.
    """
    comb = comb_logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """mixes [n, (2+hc)*hc] -> pre [n, hc], post [n, hc], comb [n, hc, hc] (``hc_split_sinkhorn``)."""
    scale, base = scale.to(mixes.dtype), base.to(mixes.dtype)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb_logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    return pre, post, sinkhorn(comb_logits, iters, eps)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[n, hc, dim], [n, hc] -> [n, dim]: ``sum_i pre_i * x_i``."""
    return (pre.unsqueeze(-1) * x).sum(dim=1)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * f + sum_j comb[j, k] * residual_j (comb applied transposed). -> [n, hc, dim]."""
    mixed = (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(dim=1)  # sum over j, the FIRST index
    return post.unsqueeze(-1) * f.unsqueeze(-2) + mixed


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final collapse [n, hc, dim] -> [n, dim] with ``pre = sigmoid(mixes * scale + base) + eps``."""
    mixes = hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale.to(x.dtype) + base.to(x.dtype)) + hc_eps
    return hc_collapse(x, pre)
