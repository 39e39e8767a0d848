"""Attention pieces (spec §4 "Attention"): query and KV paths, visible sets, sparse attention with a
per-head sink, grouped output projection. Shared-KV MQA: one 512-d (head_dim) row is both key and value.
"""

from __future__ import annotations

import torch

from oracles.norms import rms_norm, rms_norm_weightless
from oracles.rope import apply_rope


def query(x: torch.Tensor, wq_a: torch.Tensor, q_norm: torch.Tensor, wq_b: torch.Tensor, positions: torch.Tensor,
          freqs: torch.Tensor, n_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, dim] -> (q [n, H, hd] after weightless norm and RoPE, qr [n, q_lora_rank])."""
    qr = rms_norm(x @ wq_a.to(x.dtype).T, q_norm, eps)
    q = (qr @ wq_b.to(x.dtype).T).unflatten(-1, (n_heads, -1))
    q = rms_norm_weightless(q, eps)
    return apply_rope(q, positions, freqs), qr


def window_kv(x: torch.Tensor, wkv: torch.Tensor, kv_norm: torch.Tensor, positions: torch.Tensor,
              freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, dim] -> kv [n, hd]: RMSNorm then RoPE on the last rope dims."""
    return apply_rope(rms_norm(x @ wkv.to(x.dtype).T, kv_norm, eps), positions, freqs)


def window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[n] -> [n, window]: token positions t-window+1 .. t (self included), -1 before position 0."""
    pos = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)[None, :]
    return torch.where(pos >= 0, pos, -1)


def hca_entries(positions: torch.Tensor, ratio: int, n_entries: int) -> torch.Tensor:
    """[n] -> [n, n_entries]: every compressed entry j < (t+1) // ratio, -1 otherwise."""
    j = torch.arange(n_entries, device=positions.device)[None, :]
    return torch.where(j < ((positions + 1) // ratio)[:, None], j, -1)


def sparse_attention(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, H, d], rows [n, m, d] (K = V), valid [n, m] bool, sink [H] -> o [n, H, d].

    p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink_h)) with s_j = scale * q . k_j; the sink adds to the
    denominator only (it has no value row); invalid rows contribute nothing.
    """
    logits = torch.einsum("nhd,nmd->nhm", q, rows) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.to(q.dtype)[None, :, None].expand(q.shape[0], -1, 1)
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    p = (logits - top).exp()
    denom = p.sum(dim=-1, keepdim=True) + (sink - top).exp()
    return torch.einsum("nhm,nmd->nhd", p / denom, rows)


def output_projection(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, wo_a: torch.Tensor,
                      wo_b: torch.Tensor, n_groups: int) -> torch.Tensor:
    """o [n, H, hd] -> [n, dim]: inverse RoPE at the query position, per-group wo_a, then wo_b."""
    o = apply_rope(o, positions, freqs, inverse=True)
    o = o.flatten(1).unflatten(-1, (n_groups, -1))  # [n, G, H/G*hd]
    wo_a = wo_a.to(o.dtype).unflatten(0, (n_groups, -1))  # [G, o_lora_rank, H/G*hd]
    mid = torch.einsum("ngd,grd->ngr", o, wo_a)
    return mid.flatten(1) @ wo_b.to(o.dtype).T
