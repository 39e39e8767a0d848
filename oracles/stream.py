"""The oracle over a token stream known in advance (a trace's or an engine dump's calls), layer by layer: layer i
runs every block of calls (``oracles.blocks``) before layer i + 1 starts, so each layer's weights are read once per
mode and a model that streams its weights (``OracleModel.stream_layers``) holds one layer's at a time, however many
calls the stream has. What is kept between layers is the activations (free mode: each block's streams [n, hc,
dim]), not the weights. With blocks of one call (``limit`` 1) the records equal the call-by-call ``Reference``'s
bit for bit; with longer blocks, up to the rounding of GEMMs over more rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fidelity.model.sites import Recorder
from oracles.blocks import BLOCK_TOKENS, StreamCall, blocks, cat_picks, split_block
from oracles.model import OracleModel
from oracles.reference import feed_kind, layer_input, reported_topk

__all__ = ["BLOCK_TOKENS", "StreamCall", "StreamReference", "stream_records"]


def stream_records(model: OracleModel, mode: str, calls: Sequence[StreamCall],
                   limit: int = BLOCK_TOKENS) -> list[Recorder]:
    """The oracle's records of every call of the stream in ``mode`` (``free`` or ``layer``), computed layer-major
    over ``blocks(calls, limit)``."""
    if mode not in ("free", "layer"):
        raise ValueError(f"stream oracle: mode free or layer, found {mode!r}")
    cfg, dev = model.cfg, model.device
    session = model.session()
    groups = blocks(calls, limit, feed_kind(cfg.n_layers, cfg.hc_mult) if mode == "layer" else lambda c: None)
    starts, pos = [], 0
    for c in calls:
        starts.append(pos)
        pos += len(c.ids)
    ids = [torch.cat([calls[k].ids.long().flatten() for k in g]).to(dev) for g in groups]
    positions = [torch.arange(starts[g[0]], starts[g[0]] + len(t), device=dev) for g, t in zip(groups, ids,
                                                                                             strict=True)]
    block_recs = [Recorder(device=None, step=g[0]) for g in groups]
    with torch.no_grad():
        xs = []
        if mode == "free":
            for b, t in enumerate(ids):
                session.rec = block_recs[b]
                x = model.w("embed.weight")[t]  # [n, dim]
                session.emit("embed", None, x)
                xs.append(x.unsqueeze(1).repeat(1, cfg.hc_mult, 1))  # [n, hc, dim]
        for i in range(cfg.n_layers):
            for b, g in enumerate(groups):
                session.rec = block_recs[b]
                if mode == "free":
                    xs[b] = session.block(i, xs[b], positions[b], ids[b])
                    continue
                rows = calls[g[0]].rows.to(dev) if calls[g[0]].rows is not None else None
                picks = cat_picks([reported_topk(calls[k].feed, i) for k in g]) if cfg.ratio(i) == 4 else None
                if picks is not None:
                    picks = picks.to(dev).long()
                    picks = picks[rows] if rows is not None and len(picks) != len(rows) else picks
                x = torch.cat([layer_input(calls[k].feed, i, cfg.hc_mult) for k in g]).to(dev, model.dtype)
                session.block(i, x, positions[b], ids[b], rows, picks)
        for b, x in enumerate(xs):
            session.rec = block_recs[b]
            session.head(x)
    recs: list[Recorder] = []
    for g, rec in zip(groups, block_recs, strict=True):
        if len(g) == 1:
            rec.step = g[0]
            recs.append(rec)
        else:
            recs += split_block(rec, [starts[k] for k in g], [len(calls[k].ids) for k in g], cfg, g[0])
    return recs


class StreamReference:
    """A ``Reference`` (same ``run``) whose records come from ``stream_records`` over ``calls()``, computed at the
    first ``run``: a runner driving a decoder whose calls are known in advance (a trace, a dump) asks for them one
    call at a time, as it asks a ``Reference``."""

    def __init__(self, model: OracleModel, mode: str, calls, limit: int = BLOCK_TOKENS):
        self.model, self.mode, self.calls, self.limit = model, mode, calls, limit
        self.records: list[Recorder] | None = None
        self.k = 0

    def run(self, ids: torch.Tensor, feed: Recorder | None = None, rows: torch.Tensor | None = None) -> Recorder:
        if self.records is None:
            self.records = stream_records(self.model, self.mode, self.calls(), self.limit)
        if self.k >= len(self.records):
            raise ValueError(f"stream oracle: call {self.k + 1} asked for, the stream has {len(self.records)}")
        rec = self.records[self.k]
        self.records[self.k] = None  # handed over: the runner holds it while it compares
        self.k += 1
        return rec

    def run_calls(self, calls: Sequence[StreamCall], limit: int = BLOCK_TOKENS) -> list[Recorder]:
        """``run`` of each call in turn (the stream's blocks are its own)."""
        return [self.run(c.ids, c.feed, c.rows) for c in calls]
