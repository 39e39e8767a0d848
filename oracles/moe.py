"""Mixture of experts: sqrt-softplus gate, biased / hash selection, clamped SwiGLU experts (spec §4)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fidelity.model.config import ModelConfig


def gate_scores(x: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x [n, dim] -> s [n, n_routed_experts] = score_func(x @ W^T)."""
    logits = x @ weight.to(x.dtype).T
    if cfg.score_func == "softmax":
        return logits.softmax(dim=-1)
    if cfg.score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def selection_scores(scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a score-routed layer takes the top-k of: ``s + bias`` (the bias selects only)."""
    return scores + bias.to(scores.dtype) if bias is not None else scores


def gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
         ids: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, dim] -> (weights [n, k], expert ids [n, k]).

    Scores s = score_func(x @ W^T); selection by top-k of ``s + bias`` (bias selects only) or by
    ``tid2eid[token id]`` on hash layers; weights are the unbiased s gathered, normalised (no eps) for
    non-softmax scores, times route_scale.
    """
    scores = gate_scores(x, weight, cfg)
    if tid2eid is not None:
        indices = tid2eid[ids].long()
    else:
        indices = selection_scores(scores, bias).topk(cfg.n_activated_experts, dim=-1).indices
    weights = scores.gather(1, indices)
    if cfg.score_func != "softmax":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * cfg.route_scale, indices


def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """Clamped SwiGLU: g = min(x W1^T, limit), u = clamp(x W3^T, +-limit); ``w2(weight * silu(g) * u)``.

    The routing weight multiplies h before w2, as the reference does. x [n, dim], weight [n, 1].
    """
    g = x @ w1.to(x.dtype).T
    u = x @ w3.to(x.dtype).T
    if limit > 0:
        u = u.clamp(min=-limit, max=limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:
        h = weight * h
    return h @ w2.to(x.dtype).T


def moe(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
        expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor], limit: float) -> torch.Tensor:
    """Routed experts (ascending expert id) plus the shared expert. x [n, dim] -> [n, dim]."""
    y = torch.zeros_like(x)
    for e in torch.unique(indices).tolist():
        rows, slot = torch.where(indices == e)
        y[rows] += expert(x[rows], *expert_weights(e), limit, weights[rows, slot, None])
    return y + expert(x, *shared, limit)
