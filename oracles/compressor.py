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

from oracles.cache import Rows
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
    entries: Rows = field(default_factory=Rows)  # [emitted, d] after norm and RoPE


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


def pool_entries(kv: torch.Tensor, score: torch.Tensor, j0: int, m: int, r: int, d: int,
                 overlap: bool) -> torch.Tensor:
    """Entries j0 .. j0+m-1 -> [m, d] before norm and RoPE, from projections [p, coff*d] given as rows from
    position ``(j0-1)*r`` (overlap, j0 > 0) or ``j0*r``. Entry j is the softmax-weighted sum (per channel,
    over its slots) of its block's rows, and with overlap of the previous block's rows too: slots
    ``[prev block, channels :d] + [block j, channels d:]``; entry 0 has no previous slots."""
    first = r if overlap and j0 > 0 else 0  # row of block j0
    cur_kv = kv[first : first + m * r].unflatten(0, (m, r))  # [m, r, coff*d]
    cur_score = score[first : first + m * r].unflatten(0, (m, r))
    if not overlap:
        return (cur_score.softmax(dim=1) * cur_kv).sum(dim=1)
    prev_kv, prev_score = cur_kv[:-1, :, :d], cur_score[:-1, :, :d]  # block j-1 for entries j0+1 ..
    if j0 > 0:
        prev_kv = torch.cat((kv[:r, :d].unsqueeze(0), prev_kv))
        prev_score = torch.cat((score[:r, :d].unsqueeze(0), prev_score))
    else:  # entry 0: empty previous slots (weight exactly 0)
        prev_kv = torch.cat((prev_kv.new_zeros((1, r, d)), prev_kv))
        prev_score = torch.cat((prev_score.new_full((1, r, d), float("-inf")), prev_score))
    slots_kv = torch.cat((prev_kv, cur_kv[:, :, d:]), dim=1)  # [m, 2r, d]
    slots_score = torch.cat((prev_score, cur_score[:, :, d:]), dim=1)
    return (slots_score.softmax(dim=1) * slots_kv).sum(dim=1)


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
    j0, m = state.emitted, end // r - state.emitted  # entries completed by these tokens
    new = None
    if m > 0:
        lo = (j0 - 1) * r if (overlap and j0 > 0) else j0 * r
        new = pool_entries(state.kv[lo - state.start :], state.score[lo - state.start :], j0, m, r, d, overlap)
        state.emitted += m
    keep_from = (state.emitted - 1) * r if (overlap and state.emitted > 0) else state.emitted * r
    state.kv, state.score = state.kv[keep_from - state.start :], state.score[keep_from - state.start :]
    state.start = keep_from
    if new is None:
        return x.new_zeros((0, d))
    entries = rms_norm(new, w.norm, eps)
    js = torch.arange(j0, state.emitted, device=x.device)
    entries = apply_rope(entries, js * r, freqs)
    state.entries.append(entries)
    return entries


def all_entries(state: CompressorState, d: int, like: torch.Tensor) -> torch.Tensor:
    """[emitted, d] every entry so far (a view of the state's rows)."""
    return state.entries.all(d, like)
