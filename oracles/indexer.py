"""Lightning indexer (CSA layers only, spec §4 "Indexer").

q = RoPE(qr W_q^T) per index head; keys = the indexer compressor's entries (ratio 4, index_head_dim);
w = (x W_w^T) * index_head_dim^-0.5 * index_n_heads^-0.5;
score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]), masked to -inf where j >= (t+1) // 4.
The reference's Hadamard rotation of q and k is orthonormal, so q . k is unchanged in exact arithmetic:
the oracle omits it (the production model applies it together with the FP4 rounding it exists for).
"""

from __future__ import annotations

import torch


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                 ratio: int) -> torch.Tensor:
    """q [n, h, d], keys [e, d], w [n, h], positions [n] -> scores [n, e] (-inf on future entries)."""
    dots = torch.einsum("nhd,ed->nhe", q, keys).relu()
    scores = (dots * w.unsqueeze(-1)).sum(dim=1)
    future = torch.arange(keys.shape[0], device=q.device)[None, :] >= ((positions + 1) // ratio)[:, None]
    return scores.masked_fill(future, float("-inf"))


def select_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """scores [n, e] -> indices [n, topk]: the top min(topk, e) entries per query; picks that are not
    visible (j >= (t+1) // ratio) and unused columns are -1.

    Ties are broken towards the lower entry index (a stable sort). They are common, not rare: the score
    is exactly 0 for every entry whose dot products are all negative under the ReLU. The reference's
    ``torch.topk`` leaves tie order implementation-defined (spec "Open"); the oracle fixes one order so
    that prefill and decode select the same set.
    """
    k = min(topk, scores.shape[1])
    picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    picks = torch.where(picks >= ((positions + 1) // ratio)[:, None], -1, picks)
    return torch.nn.functional.pad(picks, (0, topk - k), value=-1)
