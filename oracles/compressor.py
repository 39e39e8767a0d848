"""KV compressor: gated pooling of ``ratio`` consecutive tokens into one entry (spec §4 "Compressor").

Entry j covers tokens [j*r, (j+1)*r - 1]. Per token: kv = x W_kv^T, score = x W_gate^T + ape[pos % r]
(fp32 in the reference; exact here), width coff*d with coff = 2 when r == 4 (overlap) else 1.
Non-overlap: entry j = sum over the block of softmax_p(score) * kv, per channel.
Overlap (r == 4): 2r slots, the previous block's tokens with channels [:d] then block j's tokens with
channels [d:]; block 0 has no previous slots. Then RMSNorm (weighted) and RoPE at position j*r.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oracles.norms import rms_norm
from oracles.rope import apply_rope


@dataclass
class CompressorWeights:
    wkv: torch.Tensor  # [coff*d, dim]
    wgate: torch.Tensor  # [coff*d, dim]
    ape: torch.Tensor  # [r, coff*d]
    norm: torch.Tensor  # [d]


@dataclass
class CompressorState:
    """Per-token projections not yet consumed: rows for positions ``start ..``; ``emitted`` entries so far."""

    kv: torch.Tensor | None = None  # [p, coff*d]
    score: torch.Tensor | None = None  # [p, coff*d], ape included
    start: int = 0
    emitted: int = 0
    entries: list[torch.Tensor] = field(default_factory=list)


def compressor_weights(w, prefix: str) -> CompressorWeights:
    """The four tensors under ``prefix`` (``layers.{i}.attn.compressor.`` or ``...indexer.compressor.``)."""
    return CompressorWeights(w(prefix + "wkv.weight"), w(prefix + "wgate.weight"), w(prefix + "ape"),
                             w(prefix + "norm.weight"))


def project(x: torch.Tensor, positions: torch.Tensor, w: CompressorWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, dim] -> (kv [n, coff*d], score [n, coff*d]) with ape[pos % r] added to the score."""
    r = w.ape.shape[0]
    kv = x @ w.wkv.to(x.dtype).T
    score = x @ w.wgate.to(x.dtype).T + w.ape.to(x.dtype)[positions % r]
    return kv, score


def pool_entry(kv: torch.Tensor, score: torch.Tensor, j: int, r: int, d: int, overlap: bool) -> torch.Tensor:
    """Entry j from projections of tokens [max(0, (j-1)*r) .. (j+1)*r) given as rows from position
    ``(j-1)*r`` (overlap, j > 0) or ``j*r``. Returns [d] before norm and RoPE."""
    if overlap:
        cur_kv, cur_score = kv[-r:, d:], score[-r:, d:]
        if j > 0:
            cur_kv = torch.cat((kv[:r, :d], cur_kv))
            cur_score = torch.cat((score[:r, :d], cur_score))
    else:
        cur_kv, cur_score = kv[-r:], score[-r:]
    return (cur_score.softmax(dim=0) * cur_kv).sum(dim=0)


def compress(x: torch.Tensor, positions: torch.Tensor, state: CompressorState, w: CompressorWeights,
             freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """Feed new tokens x [n, dim] at consecutive ``positions``; return the entries completed by them
    [m, d] (after norm and RoPE at j*r), also appended to ``state.entries``."""
    r, d = w.ape.shape[0], w.norm.shape[0]
    overlap = w.ape.shape[1] == 2 * d
    kv, score = project(x, positions, w)
    if state.kv is None:
        state.kv, state.score, state.start = kv, score, int(positions[0])
    else:
        state.kv, state.score = torch.cat((state.kv, kv)), torch.cat((state.score, score))
    end = int(positions[-1]) + 1  # tokens [0, end) have been seen
    new = []
    while (state.emitted + 1) * r <= end:
        j = state.emitted
        lo = (j - 1) * r if (overlap and j > 0) else j * r
        rows = slice(lo - state.start, (j + 1) * r - state.start)
        new.append(pool_entry(state.kv[rows], state.score[rows], j, r, d, overlap))
        state.emitted += 1
    keep_from = (state.emitted - 1) * r if (overlap and state.emitted > 0) else state.emitted * r
    state.kv, state.score = state.kv[keep_from - state.start :], state.score[keep_from - state.start :]
    state.start = keep_from
    if not new:
        return x.new_zeros((0, d))
    entries = rms_norm(torch.stack(new), w.norm, eps)
    js = torch.arange(state.emitted - len(new), state.emitted, device=x.device)
    entries = apply_rope(entries, js * r, freqs)
    state.entries.append(entries)
    return entries


def all_entries(state: CompressorState, d: int, like: torch.Tensor) -> torch.Tensor:
    """[emitted, d] every entry so far."""
    if not state.entries:
        return like.new_zeros((0, d))
    if len(state.entries) > 1:
        state.entries = [torch.cat(state.entries)]
    return state.entries[0]
