"""The oracle side of the three comparison modes behind one call (docs/design.md "Three comparison modes").

``Reference(model, mode).run(ids, feed, rows)`` evaluates one model call and returns the oracle's records of it;
``feed`` (the decoder's records of the same call) says which tensors replace the oracle's own:

- ``free``: none; the oracle runs its own model on the same tokens.
- ``layer``: each layer's input streams (``embed`` for layer 0, else ``L{i-1}.residual``) and a CSA layer's top-k
  (``L{i}.indexer.topk``, attended instead of the oracle's own selection where the decoder reports it); the layer
  keeps its own exact caches.
- ``op``: every op's inputs and the decoder's cache contents (``oracles.op_mode``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fidelity.model.sites import SITE, Recorder, site_name
from oracles.blocks import ALONE, BLOCK_TOKENS, StreamCall, blocks, cat_picks, split_block
from oracles.model import OracleModel
from oracles.op_mode import OpReplay

MODES = ("free", "layer", "op")


def layer_input(feed: Recorder, i: int, hc: int) -> torch.Tensor:
    """The decoder's input streams to layer i [n, hc, dim]: the embedding repeated for layer 0, else the streams
    leaving layer i - 1."""
    if i == 0:
        return feed.get(site_name("embed")).unsqueeze(1).repeat(1, hc, 1)
    return feed.get(SITE.residual.at(i - 1))


def reported_topk(feed: Recorder, i: int) -> torch.Tensor | None:
    """The decoder's top-k [n, index_topk] of CSA layer i in this call, None when it reports none."""
    site = SITE.indexer_topk.at(i)
    return feed.get(site) if site in feed.records else None


def feed_kind(n_layers: int, hc: int) -> Callable[[StreamCall], object]:
    """A layer-mode call's kind for ``blocks``: the layers whose top-k its decoder records report (calls of one
    block attend the decoder's picks at the same layers), or ``ALONE`` where the records lack one row per token at
    some layer input or top-k (a block's inputs are cut by rows; such a call runs as it would call by call)."""

    def kind(call: StreamCall) -> object:
        n = len(call.ids)
        try:
            inputs = [layer_input(call.feed, i, hc) for i in range(n_layers)]
        except KeyError:
            return ALONE
        picks = [reported_topk(call.feed, i) for i in range(n_layers)]
        if any(len(x) != n for x in inputs) or any(p is not None and len(p) != n for p in picks):
            return ALONE
        return tuple(p is not None for p in picks)

    return kind


def op_kind(call: StreamCall) -> object:
    """An op-mode call's kind for ``blocks``: the sites its decoder recorded (a block's calls stack their records
    site by site), ``ALONE`` without records."""
    return ALONE if call.feed is None else frozenset(call.feed.records)


class Reference:
    """The oracle in one comparison mode, with the state it carries from call to call (caches, positions)."""

    def __init__(self, model: OracleModel, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, found {mode!r}")
        self.model, self.mode = model, mode
        self.session = model.session() if mode in ("free", "layer") else None
        self.ops = OpReplay(model) if mode == "op" else None

    def run(self, ids: torch.Tensor, feed: Recorder | None = None, rows: torch.Tensor | None = None) -> Recorder:
        """The oracle's records of one call on tokens ``ids`` [n] at the next positions. ``feed``: the decoder's
        records of the same call (layer and op modes); ``rows``: sampled query rows of a prefill (layer and op
        modes; free mode runs every row)."""
        rec = Recorder(device=None)
        if self.mode == "free":
            self.session.rec = rec
            self.session.forward(ids)
        elif self.mode == "layer":
            hc = self.model.cfg.hc_mult
            self.session.rec = rec
            self.session.forward_layers(ids, lambda i: layer_input(feed, i, hc), rows,
                                        lambda i: reported_topk(feed, i))
        else:
            self.ops.run(ids, feed, rec, rows)
        return rec

    def run_calls(self, calls: Sequence[StreamCall], limit: int = BLOCK_TOKENS) -> list[Recorder]:
        """The oracle's records of consecutive calls, as ``run`` of each in turn would give them (up to the rounding
        of GEMMs over more rows): each block of ``blocks`` runs as one causal pass (free and layer modes) or one
        replay of the calls' stacked inputs (op mode), and its records are split by call (``oracles.blocks``)."""
        cfg = self.model.cfg
        kinds = {"layer": feed_kind(cfg.n_layers, cfg.hc_mult), "op": op_kind}
        out: list[Recorder] = []
        for group in blocks(calls, limit, kinds.get(self.mode, lambda c: None)):
            block = [calls[k] for k in group]
            if len(block) == 1:
                out.append(self.run(block[0].ids, block[0].feed, block[0].rows))
                continue
            start = self.ops.pos if self.mode == "op" else self.session.pos
            sizes = [len(c.ids) for c in block]
            ids = torch.cat([c.ids.long().flatten() for c in block])
            rec = self._block_records(ids, block)
            out += split_block(rec, [start + sum(sizes[:k]) for k in range(len(sizes))], sizes, cfg)
        return out

    def _block_records(self, ids: torch.Tensor, block: Sequence[StreamCall]) -> Recorder:
        """One causal pass of free or layer mode, or op mode's replay, over the calls of ``block`` (every row),
        recorded whole."""
        rec = Recorder(device=None)
        if self.mode == "op":
            self.ops.run_calls(block, rec)
            return rec
        self.session.rec = rec
        if self.mode == "free":
            self.session.forward(ids)
            return rec
        hc = self.model.cfg.hc_mult
        self.session.forward_layers(ids, lambda i: torch.cat([layer_input(c.feed, i, hc) for c in block]), None,
                                    lambda i: cat_picks([reported_topk(c.feed, i) for c in block]))
        return rec
