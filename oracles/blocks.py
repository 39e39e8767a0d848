"""Consecutive calls of a known token stream as one causal pass, and its records split back into each call's.

The oracle is exact, so one pass over a block of calls attends to what each call would have seen: row t reads the
window and compressed entries up to t, and a later row of the block is never visible to an earlier one. Only the
rounding of the GEMMs over more rows differs (fp32: ~1e-7 relative). A block's records, split (``split_block``),
have the call-by-call shapes: a call's index scores and an HCA layer's visible entries are as wide as the entries
that exist after the call, its compressed entries and indexer keys are those its own tokens complete."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import SITE, Recorder, site_template

BLOCK_TOKENS = 64  # tokens of consecutive calls computed as one causal pass (bounds a block's index scores)
ALONE = object()  # the kind of a call that runs in a block of its own


@dataclass(frozen=True)
class StreamCall:
    """One call of the stream: its token ids [n], the decoder's records of it (layer mode's inputs) and the sampled
    query rows (None: every row)."""

    ids: torch.Tensor
    feed: Recorder | None = None
    rows: torch.Tensor | None = None


def blocks(calls: Sequence[StreamCall], limit: int = BLOCK_TOKENS,
           kind: Callable[[StreamCall], object] = lambda c: None) -> list[list[int]]:
    """The calls' indices grouped into blocks: consecutive calls of every row and of one ``kind``, ``limit`` tokens
    at most together; a call with sampled rows, more tokens than ``limit`` or of kind ``ALONE`` is a block of its
    own."""
    out: list[list[int]] = []
    tokens, open_kind = limit + 1, ALONE  # no block open yet
    for k, c in enumerate(calls):
        n, this = len(c.ids), kind(c)
        if c.rows is not None or n > limit or this is ALONE or this != open_kind or tokens + n > limit:
            out.append([k])
            tokens, open_kind = n, (ALONE if c.rows is not None or n > limit else this)
        else:
            out[-1].append(k)
            tokens += n
    return out


def split_block(block: Recorder, starts: Sequence[int], sizes: Sequence[int], cfg: ModelConfig,
                first_step: int = 0) -> list[Recorder]:
    """The records of one causal pass over calls of ``sizes`` tokens starting at positions ``starts`` -> each call's
    records, as the call alone would have made them: rows split by call; ``indexer.scores`` and an HCA layer's
    ``attn.visible`` cut to the entries that exist after the call ((last position + 1) // ratio); compressed entries
    and indexer keys given to the call whose token completes them (entry j at position (j + 1) * ratio - 1)."""
    recs = [Recorder(device=None, step=first_step + k) for k in range(len(sizes))]
    ends = [s + n for s, n in zip(starts, sizes, strict=True)]  # one past each call's last position
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    for site in block.records:
        whole, template = block.get(site), site_template(site)
        layer = int(site[1:site.index(".")]) if site.startswith("L") else None
        if template in (SITE.attn_compressed_kv, SITE.indexer_keys):
            ratio = 4 if template == SITE.indexer_keys else cfg.ratio(layer)
            before = starts[0] // ratio  # entries complete before the block
            parts = [whole[starts[k] // ratio - before : ends[k] // ratio - before] for k in range(len(sizes))]
        else:
            parts = [whole[offsets[k] : offsets[k + 1]] for k in range(len(sizes))]
            width = _call_width(template, layer, cfg)
            if width is not None:
                parts = [p[:, : width(ends[k])] for k, p in enumerate(parts)]
        for rec, part in zip(recs, parts, strict=True):
            rec.records[site] = [(rec.step, part)]
    return recs


def _call_width(template: str, layer: int | None, cfg: ModelConfig) -> Callable[[int], int] | None:
    """The width of a call's record of a ragged site, from one past its last position (None: not ragged)."""
    if template == SITE.indexer_scores:
        return lambda end: end // 4
    if template == SITE.attn_visible and cfg.ratio(layer) > 4:  # HCA: the window, then every entry so far
        return lambda end: cfg.window_size + end // cfg.ratio(layer)
    return None


def cat_picks(picks: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Calls' reported top-k [n_k, k_k] as one [sum n_k, max k_k] (-1 padded); None where no call reports one (a
    block's calls report one at the same layers: ``blocks`` by a feed's kind)."""
    if all(p is None for p in picks):
        return None
    width = max(p.shape[-1] for p in picks)
    return torch.cat([torch.nn.functional.pad(p.long(), (0, width - p.shape[-1]), value=-1) for p in picks])

