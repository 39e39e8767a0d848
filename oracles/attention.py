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
    return torch.einsum("nhm,nmd->nhd", sink_softmax(logits, valid, sink), rows)


def window_and_entries_attention(q: torch.Tensor, window_rows: torch.Tensor, window_valid: torch.Tensor,
                                 entries: torch.Tensor, entry_valid: torch.Tensor, sink: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """``sparse_attention`` over each query's window rows [n, W, d] followed by compressed entries that every
    query shares [e, d] (HCA: all entries, masked by ``entry_valid`` [n, e]); the same as gathering the
    entries per query, without the [n, e, d] copy. -> o [n, H, d]."""
    logits = torch.cat((torch.einsum("nhd,nmd->nhm", q, window_rows), torch.einsum("nhd,ed->nhe", q, entries)), -1)
    p = sink_softmax(logits * scale, torch.cat((window_valid, entry_valid), dim=1), sink)
    w = window_rows.shape[1]
    return torch.einsum("nhm,nmd->nhd", p[..., :w], window_rows) + torch.einsum("nhe,ed->nhd", p[..., w:], entries)


def sink_softmax(logits: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """logits [n, H, m], valid [n, m], sink [H] -> p [n, H, m]: softmax with exp(sink_h) added to the
    denominator only; invalid entries get 0."""
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    p = (logits - top).exp()
    return p / (p.sum(dim=-1, keepdim=True) + (sink - top).exp())


def output_projection(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, wo_a: torch.Tensor,
                      wo_b: torch.Tensor, n_groups: int) -> torch.Tensor:
    """o [n, H, hd] -> [n, dim]: inverse RoPE at the query position, per-group wo_a, then wo_b."""
    o = apply_rope(o, positions, freqs, inverse=True)
    o = o.flatten(1).unflatten(-1, (n_groups, -1))  # [n, G, H/G*hd]
    wo_a = wo_a.to(o.dtype).unflatten(0, (n_groups, -1))  # [G, o_lora_rank, H/G*hd]
    mid = torch.einsum("ngd,grd->ngr", o, wo_a)
    return mid.flatten(1) @ wo_b.to(o.dtype).T
