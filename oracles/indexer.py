"""Lightning indexer (CSA layers only, spec §4 "Indexer").

q = RoPE(qr W_q^T) per index head; keys = the indexer compressor's entries (ratio 4, index_head_dim);
w = (x W_w^T) * index_head_dim^-0.5 * index_n_heads^-0.5;
score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]), masked to -inf where j >= (t+1) // 4.
The reference's Hadamard rotation of q and k is orthonormal, so q . k is unchanged in exact arithmetic:
the oracle omits it (the production model applies it together with the FP4 rounding it exists for).
"""

from __future__ import annotations

import torch

from oracles.rope import apply_rope


def index_queries(qr: torch.Tensor, wq_b: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                  n_heads: int) -> torch.Tensor:
    """qr [n, q_lora_rank] (the attention's normed query latent) -> q [n, h, d] after RoPE."""
    return apply_rope((qr @ wq_b.T).unflatten(-1, (n_heads, -1)), positions, freqs)


def head_weights(x: torch.Tensor, weights_proj: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """x [n, dim] -> w [n, h] = (x W_w^T) * head_dim^-0.5 * n_heads^-0.5."""
    return (x @ weights_proj.T) * (head_dim**-0.5 * n_heads**-0.5)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                 ratio: int) -> torch.Tensor:
    """q [n, h, d], keys [e, d], w [n, h], positions [n] -> scores [n, e] (-inf on future entries)."""
    dots = torch.einsum("nhd,ed->nhe", q, keys).relu()
    scores = torch.einsum("nhe,nh->ne", dots, w)
    future = torch.arange(keys.shape[0], device=q.device)[None, :] >= ((positions + 1) // ratio)[:, None]
    return scores.masked_fill_(future, float("-inf"))


def select_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """scores [n, e] -> indices [n, topk]: the top min(topk, e) entries per query, highest score first;
    picks that are not visible (j >= (t+1) // ratio) and unused columns are -1.

    Ties are broken towards the lower entry index: the first k of a stable descending sort. They are
    common, not rare: the score is exactly 0 for every entry whose dot products are all negative under the
    ReLU. The reference's ``torch.topk`` leaves tie order implementation-defined (spec "Open"); the oracle
    fixes one order so that prefill and decode select the same set. NaN ranks above +inf, as in a sort.
    """
    k = min(topk, scores.shape[1])
    picks = stable_topk_indices(scores, k)
    picks = torch.where(picks >= ((positions + 1) // ratio)[:, None], -1, picks)
    return torch.nn.functional.pad(picks, (0, topk - k), value=-1)


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [n, e] -> [n, k]: ``scores.sort(-1, descending=True, stable=True).indices[:, :k]`` without
    sorting all e entries: the entries above the k-th largest score, then the lowest-index entries equal
    to it, those k sorted (stably) by score. Scores holding NaN take the full sort."""
    if k == 0:
        return scores.new_zeros((scores.shape[0], 0), dtype=torch.long)
    vals, top = scores.topk(k, dim=-1)  # the k largest (NaN first); which of several equal ones is unspecified
    if vals.isnan().any():
        return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    e = scores.shape[1]
    kth = vals[:, -1:]  # [n, 1]
    above = torch.where(vals > kth, top, e)  # [n, k] picks strictly above the k-th score, e = none
    ids = torch.arange(e, dtype=torch.int32, device=scores.device)
    tied = torch.where(scores == kth, ids, e).topk(k, dim=-1, largest=False).values.long()  # lowest ids
    tied = torch.where(ids[:k] < k - (vals > kth).sum(-1, keepdim=True), tied, e)
    chosen = torch.cat((above, tied), dim=1).sort(dim=-1).values[:, :k]  # [n, k] in index order
    return chosen.gather(1, scores.gather(1, chosen).sort(dim=-1, descending=True, stable=True).indices)
