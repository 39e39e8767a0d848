"""Op mode: each oracle op gets the decoder's exact inputs and cache contents (dequantized), so the error it
reports is the kernel's alone, at this step (docs/design.md "Three comparison modes").

Per layer it keeps what later calls need: the decoder's window KV rows of the last window positions, its
compressed entries and indexer keys (as the decoder's caches hold them), and oracle compressor states fed with the
decoder's attention inputs.

Consecutive calls can be replayed as one pass (``run_calls``): each op's inputs are the calls' records stacked, and
each query reads the tables as its own call alone would have them (the window rows from that call's first kept
position to its last, the entries emitted up to it), so the records equal the call-by-call ones up to the rounding
of GEMMs over more rows, for a decoder whose visible sets reach past its own rows too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fidelity.model.sites import MHC_SITES, SITE, Recorder, site_name
from oracles import attention, indexer, mhc
from oracles.blocks import StreamCall
from oracles.cache import Rows, gather_rows
from oracles.compressor import CompressorState, compress, compressor_weights
from oracles.model import OracleModel

Take = Callable[..., torch.Tensor]  # a site template of layer i -> the decoder's record of it, in the oracle dtype


@dataclass
class _LayerHistory:
    kv: torch.Tensor | None = None  # decoder window KV rows of positions kv_start.., the window's worth kept
    kv_start: int = 0
    entries: Rows = field(default_factory=Rows)  # decoder compressed entries
    keys: Rows = field(default_factory=Rows)  # decoder indexer keys
    comp: CompressorState = field(default_factory=CompressorState)  # oracle, fed the decoder's inputs
    index: CompressorState = field(default_factory=CompressorState)


class OpReplay:
    """Re-runs oracle ops on a decoder's recorded inputs; results go to a ``Recorder`` under the same sites."""

    def __init__(self, model: OracleModel):
        self.model, self.cfg = model, model.cfg
        self.hist = [_LayerHistory() for _ in range(self.cfg.n_layers)]
        self.pos = 0
        self.feeds: list[Recorder] = []  # the decoder's records of each call of the pass being replayed

    def run(self, ids: torch.Tensor, decoder: Recorder, out: Recorder, rows: torch.Tensor | None = None) -> None:
        """Every layer's ops for tokens ``ids`` [n] at the next positions, from the decoder's records of the same
        call; ``rows`` restricts the per-query ops (queries, index scores, attention, MoE) to sampled rows."""
        self.feeds = [decoder]
        self._replay(ids, decoder, out, rows, [len(torch.as_tensor(ids).flatten())])

    def run_calls(self, calls: Sequence[StreamCall], out: Recorder) -> None:
        """``run`` of consecutive calls (every row of each) as one pass: their records stacked, each query bounded
        by its own call's tables; ``out`` gets the pass's records (``oracles.blocks.split_block`` cuts them by
        call)."""
        self.feeds = [c.feed for c in calls]
        stacked = Recorder(device=None)
        for c in calls:
            for site, parts in c.feed.records.items():
                stacked.records.setdefault(site, []).extend(parts)
        ids = torch.cat([torch.as_tensor(c.ids).long().flatten() for c in calls])
        self._replay(ids, stacked, out, None, [len(torch.as_tensor(c.ids).flatten()) for c in calls])

    def _replay(self, ids: torch.Tensor, decoder: Recorder, out: Recorder, rows: torch.Tensor | None,
                sizes: list[int]) -> None:
        """The ops of calls of ``sizes`` tokens (ids [sum sizes]) from their records ``decoder``."""
        dt, dev = self.model.dtype, self.model.device
        ids = torch.as_tensor(ids).long().flatten().to(dev)
        positions = torch.arange(self.pos, self.pos + len(ids), device=dev)
        rows = None if rows is None else rows.to(dev)
        sel = slice(None) if rows is None else rows
        self.sizes = torch.tensor(sizes, device=dev)
        self.call_of = torch.repeat_interleave(torch.arange(len(sizes), device=dev), self.sizes)[sel]  # [nq]

        def layer_of(i: int) -> tuple[Take, Take]:
            def take(template: str, at: torch.Tensor | None = None) -> torch.Tensor:
                t = decoder.get(site_name(template, i), at).to(dev)
                return t.to(dt) if t.is_floating_point() else t

            return take, lambda template: take(template, rows)

        streams = decoder.get("embed", rows).to(dev, dt).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)  # [nq, hc, dim]
        for i in range(self.cfg.n_layers):
            take, take_q = layer_of(i)
            self._mhc(i, "attn", streams, out)
            self._attention(i, take, take_q, positions, positions[sel], out)
            self._moe(i, take_q, ids[sel], out)
            streams = take_q(SITE.residual)
        self.pos += len(ids)

    def _mhc(self, i: int, which: str, streams: torch.Tensor, out: Recorder) -> None:
        """hc_pre's mixing weights of streams [n, hc, dim]: pre [n, hc], post [n, hc], comb [n, hc, hc]."""
        w, cfg = self.model.w, self.cfg
        mixes = mhc.hc_mixes(streams, w(f"layers.{i}.hc_{which}_fn"), cfg.norm_eps)
        parts = mhc.hc_split(mixes, w(f"layers.{i}.hc_{which}_scale"), w(f"layers.{i}.hc_{which}_base"),
                             cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        for part, t in zip(("pre", "post", "comb"), parts, strict=True):
            out(site_name(MHC_SITES[which, part], i), t)

    def _attention(self, i: int, take: Take, take_q: Take, positions: torch.Tensor, qpos: torch.Tensor,
                   out: Recorder) -> None:
        w, cfg, h = self.model.w, self.cfg, self.hist[i]
        ratio, p = cfg.ratio(i), f"layers.{i}.attn."
        freqs = self.model.freqs[ratio]
        x = take(SITE.attn_in)  # [n, dim]
        q, _ = attention.query(take_q(SITE.attn_in), w(p + "wq_a.weight"), w(p + "q_norm.weight"),
                               w(p + "wq_b.weight"), qpos, freqs, cfg.n_heads, cfg.norm_eps)
        out(SITE.attn_q.at(i), q)
        out(SITE.attn_kv.at(i), attention.window_kv(x, w(p + "wkv.weight"), w(p + "kv_norm.weight"),
                                                              positions, freqs, cfg.norm_eps))
        new = take(SITE.attn_kv)
        h.kv = new if h.kv is None else torch.cat((h.kv, new))
        if ratio:
            weights = compressor_weights(w, p + "compressor.")
            out(SITE.attn_compressed_kv.at(i), compress(x, positions, h.comp, weights, freqs, cfg.norm_eps))
            h.entries.append(take(SITE.attn_compressed_kv))
        if ratio == 4:
            self._indexer(i, take, take_q, x, positions, qpos, out)
        self._core(i, take_q, out)
        keep = max(h.kv_start, int(positions[-1]) + 1 - (cfg.window_size - 1))  # what later queries can see
        h.kv, h.kv_start = h.kv[keep - h.kv_start :], keep

    def _indexer(self, i: int, take: Take, take_q: Take, x: torch.Tensor, positions: torch.Tensor,
                 qpos: torch.Tensor, out: Recorder) -> None:
        cfg, h = self.cfg, self.hist[i]
        weights = compressor_weights(self.model.w, f"layers.{i}.attn.indexer.compressor.")
        out(SITE.indexer_keys.at(i), compress(x, positions, h.index, weights, self.model.freqs[4],
                                                        cfg.norm_eps))
        h.keys.append(take(SITE.indexer_keys))
        keys = h.keys.all(cfg.index_head_dim, x)  # [entries, index_head_dim]
        scores = indexer.index_scores(take_q(SITE.indexer_q), keys, take_q(SITE.indexer_weights), qpos, 4)
        out(SITE.indexer_scores.at(i), scores)
        out(SITE.indexer_topk.at(i), indexer.select_topk(scores, qpos, 4, cfg.index_topk))

    def _bounds(self, i: int, n_entries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per query [nq]: the first window position its call alone keeps, one past its call's last position, and
        the compressed entries layer i holds after its call (of the ``n_entries`` held after the pass)."""
        h = self.hist[i]
        ends = self.pos + torch.cumsum(self.sizes, 0)  # [calls]
        starts = ends - self.sizes
        # the window a call alone reads: what the calls before it kept (its first position - (window - 1) on)
        firsts = (starts - (self.cfg.window_size - 1)).clamp(min=h.kv_start)
        firsts[0] = h.kv_start
        site = SITE.attn_compressed_kv.at(i)
        counts = [len(f.get(site)) if self.cfg.ratio(i) else 0 for f in self.feeds]
        held = n_entries - sum(counts) + torch.cumsum(torch.tensor(counts, device=self.sizes.device), 0)
        return firsts[self.call_of], ends[self.call_of], held[self.call_of]

    def _core(self, i: int, take_q: Take, out: Recorder) -> None:
        """Oracle sparse attention over the decoder's q, KV rows and visible set."""
        cfg, h = self.cfg, self.hist[i]
        win = cfg.window_size
        entries = h.entries.all(cfg.head_dim, h.kv)
        visible = take_q(SITE.attn_visible)  # [nq, W + K]
        first, end, held = (t[:, None] for t in self._bounds(i, len(entries)))  # [nq, 1] each
        # the table [window rows; entries; a zero row], read as each query's call alone reads it: its window rows
        # (positions first .. end - 1), then the entries held after it, then zeros; so a window position past the
        # call's last reads the entries, and an entry the decoder saw but never emitted (a causality bug) reads
        # zeros, what its cache held
        n_kv, zero = len(h.kv), len(h.kv) + len(entries)
        table = (h.kv, entries, h.kv.new_zeros((1, cfg.head_dim)))
        window, picked = visible[:, :win], visible[:, win:]
        past = window - end  # a window position past the call's last -> the entry it reads
        window_rows = torch.where(window < end, window - h.kv_start, torch.where(past < held, n_kv + past, zero))
        entry_rows = torch.where(picked < held, n_kv + picked, zero)
        rows = torch.cat((window_rows, entry_rows), dim=1)
        valid = (visible >= 0) & torch.cat((window >= first, picked >= 0), dim=1)
        gathered = gather_rows(table, torch.where(valid, rows, 0))
        sink = self.model.w(f"layers.{i}.attn.attn_sink")
        out(SITE.attn_core.at(i), attention.sparse_attention(take_q(SITE.attn_q), gathered, valid, sink,
                                                                        cfg.head_dim**-0.5))

    def _moe(self, i: int, take_q: Take, ids: torch.Tensor, out: Recorder) -> None:
        def emit(template: str, t) -> None:
            out(site_name(template, i), t() if callable(t) else t)

        emit(SITE.moe_out, self.model.moe_layer(i, take_q(SITE.moe_in), ids, emit))  # moe.in: [nq, dim]
