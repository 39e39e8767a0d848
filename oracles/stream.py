"""The oracle over a token stream known in advance (a trace's or an engine dump's calls), layer by layer: layer i
runs every call before layer i + 1 starts, so each layer's weights are read once per mode and a model that streams
its weights (``OracleModel.stream_layers``) holds one layer's at a time, however many calls the stream has. What is
kept between layers is the activations (free mode: each call's streams [n, hc, dim]), not the weights.

The records equal the call-by-call ``Reference``'s bit for bit: every layer keeps its own state (``LayerState``)
and sees the calls in the same order, with the same inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fidelity.model.sites import Recorder
from oracles.model import OracleModel
from oracles.reference import layer_input, reported_topk


@dataclass(frozen=True)
class StreamCall:
    """One call of the stream: its token ids [n], the decoder's records of it (layer mode's inputs) and the sampled
    query rows (None: every row)."""

    ids: torch.Tensor
    feed: Recorder | None = None
    rows: torch.Tensor | None = None


def stream_records(model: OracleModel, mode: str, calls: Sequence[StreamCall]) -> list[Recorder]:
    """The oracle's records of every call of the stream in ``mode`` (``free`` or ``layer``), computed layer-major."""
    if mode not in ("free", "layer"):
        raise ValueError(f"stream oracle: mode free or layer, found {mode!r}")
    cfg, dev = model.cfg, model.device
    session = model.session()
    recs = [Recorder(device=None, step=k) for k in range(len(calls))]
    starts, pos = [], 0
    for c in calls:
        starts.append(pos)
        pos += len(c.ids)
    ids = [c.ids.long().flatten().to(dev) for c in calls]
    positions = [torch.arange(s, s + len(t), device=dev) for s, t in zip(starts, ids, strict=True)]
    with torch.no_grad():
        xs = []
        if mode == "free":
            for k, t in enumerate(ids):
                session.rec = recs[k]
                x = model.w("embed.weight")[t]  # [n, dim]
                session.emit("embed", None, x)
                xs.append(x.unsqueeze(1).repeat(1, cfg.hc_mult, 1))  # [n, hc, dim]
        for i in range(cfg.n_layers):
            for k, call in enumerate(calls):
                session.rec = recs[k]
                if mode == "free":
                    xs[k] = session.block(i, xs[k], positions[k], ids[k])
                    continue
                rows = call.rows.to(dev) if call.rows is not None else None
                picks = reported_topk(call.feed, i) if cfg.ratio(i) == 4 else None
                if picks is not None:
                    picks = picks.to(dev).long()
                    picks = picks[rows] if rows is not None and len(picks) != len(rows) else picks
                x = layer_input(call.feed, i, cfg.hc_mult).to(dev, model.dtype)
                session.block(i, x, positions[k], ids[k], rows, picks)
        for k, x in enumerate(xs):
            session.rec = recs[k]
            session.head(x)
    return recs


class StreamReference:
    """A ``Reference`` (same ``run``) whose records come from ``stream_records`` over ``calls()``, computed at the
    first ``run``: a runner driving a decoder whose calls are known in advance (a trace, a dump) asks for them one
    call at a time, as it asks a ``Reference``."""

    def __init__(self, model: OracleModel, mode: str, calls):
        self.model, self.mode, self.calls = model, mode, calls
        self.records: list[Recorder] | None = None
        self.k = 0

    def run(self, ids: torch.Tensor, feed: Recorder | None = None, rows: torch.Tensor | None = None) -> Recorder:
        if self.records is None:
            self.records = stream_records(self.model, self.mode, self.calls())
        if self.k >= len(self.records):
            raise ValueError(f"stream oracle: call {self.k + 1} asked for, the stream has {len(self.records)}")
        rec = self.records[self.k]
        self.records[self.k] = None  # handed over: the runner holds it while it compares
        self.k += 1
        return rec
