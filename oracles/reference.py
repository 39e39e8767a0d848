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

import torch

from fidelity.model.sites import SITE, Recorder, site_name
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
