"""Op mode: each oracle op gets the production op's exact inputs and production's cache contents
(dequantized), so the error it reports is the kernel's alone, at this step (docs/design.md "Three comparison modes").

Per layer it keeps what later steps need: production's window KV rows of the last window positions, its
compressed entries and indexer keys (as the production caches hold them), and oracle compressor states fed with
production's attention inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder
from oracles import OracleModel, attention, indexer, mhc
from oracles import moe as moe_ops
from oracles.compressor import CompressorState, compress, compressor_weights


@dataclass
class _LayerHistory:
    kv: torch.Tensor | None = None  # production window KV rows of positions kv_start.., the window's worth kept
    kv_start: int = 0
    entries: list[torch.Tensor] = field(default_factory=list)  # production compressed entries
    keys: list[torch.Tensor] = field(default_factory=list)  # production indexer keys
    comp: CompressorState = field(default_factory=CompressorState)  # oracle, fed production inputs
    index: CompressorState = field(default_factory=CompressorState)


def _cat(parts: list[torch.Tensor], width: int, like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros((0, width))


class OpMode:
    """Re-runs oracle ops on production's recorded inputs; results go to ``recorder`` under the same sites."""

    def __init__(self, oracle: OracleModel):
        self.o, self.cfg = oracle, oracle.cfg
        self.hist = [_LayerHistory() for _ in range(self.cfg.n_layers)]

    def step(self, prod: Recorder, positions: torch.Tensor, ids: torch.Tensor, recorder: Recorder,
             rows: torch.Tensor | None = None) -> None:
        """Evaluate every layer's ops for the tokens at ``positions`` from one production call's records;
        ``rows`` restricts the per-query ops (queries, index scores, attention, MoE) to sampled rows."""
        dt, dev = self.o.dtype, self.o.device
        positions, ids = positions.to(dev), ids.to(dev)
        sel = slice(None) if rows is None else rows.to(dev)

        def get(site: str) -> torch.Tensor:
            t = prod.get(site).to(dev)
            return t.to(dt) if t.is_floating_point() else t

        def get_q(site: str) -> torch.Tensor:
            return get(site)[sel]

        streams = get("embed").unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        for i in range(self.cfg.n_layers):
            self._mhc(i, "attn", streams[sel], recorder)
            self._attention(i, get, get_q, positions, positions[sel], recorder)
            self._moe(i, get_q, ids[sel], recorder)
            streams = get(f"L{i}.residual")

    def _mhc(self, i: int, which: str, streams: torch.Tensor, rec: Recorder) -> None:
        w, cfg = self.o.w, self.cfg
        mixes = mhc.hc_mixes(streams, w(f"layers.{i}.hc_{which}_fn"), cfg.norm_eps)
        pre, post, comb = mhc.hc_split(mixes, w(f"layers.{i}.hc_{which}_scale"), w(f"layers.{i}.hc_{which}_base"),
                                       cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        rec(f"L{i}.mhc_{which}.pre", pre)
        rec(f"L{i}.mhc_{which}.post", post)
        rec(f"L{i}.mhc_{which}.comb", comb)

    def _attention(self, i: int, get, get_q, positions: torch.Tensor, qpos: torch.Tensor, rec: Recorder) -> None:
        w, cfg, h = self.o.w, self.cfg, self.hist[i]
        ratio, p = cfg.ratio(i), f"layers.{i}.attn."
        freqs = self.o.freqs[ratio]
        x = get(f"L{i}.attn.in")
        q, _ = attention.query(get_q(f"L{i}.attn.in"), w(p + "wq_a.weight"), w(p + "q_norm.weight"),
                               w(p + "wq_b.weight"), qpos, freqs, cfg.n_heads, cfg.norm_eps)
        rec(f"L{i}.attn.q", q)
        rec(f"L{i}.attn.kv", attention.window_kv(x, w(p + "wkv.weight"), w(p + "kv_norm.weight"), positions, freqs,
                                                 cfg.norm_eps))
        new = get(f"L{i}.attn.kv")
        h.kv = new if h.kv is None else torch.cat((h.kv, new))
        if ratio:
            weights = compressor_weights(w, p + "compressor.")
            rec(f"L{i}.attn.compressed_kv", compress(x, positions, h.comp, weights, freqs, cfg.norm_eps))
            h.entries.append(get(f"L{i}.attn.compressed_kv"))
        if ratio == 4:
            self._indexer(i, get, get_q, x, positions, qpos, rec)
        self._core(i, get, get_q, rec)
        keep = max(h.kv_start, int(positions[-1]) + 1 - (cfg.window_size - 1))  # what later queries can see
        h.kv, h.kv_start = h.kv[keep - h.kv_start :], keep

    def _indexer(self, i: int, get, get_q, x: torch.Tensor, positions: torch.Tensor, qpos: torch.Tensor,
                 rec: Recorder) -> None:
        cfg, h = self.cfg, self.hist[i]
        weights = compressor_weights(self.o.w, f"layers.{i}.attn.indexer.compressor.")
        rec(f"L{i}.indexer.keys", compress(x, positions, h.index, weights, self.o.freqs[4], cfg.norm_eps))
        h.keys.append(get(f"L{i}.indexer.keys"))
        keys = _cat(h.keys, cfg.index_head_dim, x)
        scores = indexer.index_scores(get_q(f"L{i}.indexer.q"), keys, get_q(f"L{i}.indexer.weights"), qpos, 4)
        rec(f"L{i}.indexer.scores", scores)
        rec(f"L{i}.indexer.topk", indexer.select_topk(scores, qpos, 4, cfg.index_topk))

    def _core(self, i: int, get, get_q, rec: Recorder) -> None:
        """Oracle sparse attention over production's q, KV rows and visible set."""
        cfg, h = self.cfg, self.hist[i]
        win = cfg.window_size
        entries = _cat(h.entries, cfg.head_dim, h.kv)
        visible = get_q(f"L{i}.attn.visible")
        # an entry production saw but never emitted (a causality bug) reads what its cache held: zeros
        table = torch.cat((h.kv, entries, h.kv.new_zeros((1, cfg.head_dim))))
        window = visible[:, :win] - h.kv_start  # token positions -> rows of the kept window
        rows = torch.cat((window, visible[:, win:] + len(h.kv)), dim=1).clamp(max=len(table) - 1)
        valid = (visible >= 0) & torch.cat((window >= 0, visible[:, win:] >= 0), dim=1)
        gathered = table[torch.where(valid, rows, 0)]
        sink = self.o.w(f"layers.{i}.attn.attn_sink")
        rec(f"L{i}.attn.core", attention.sparse_attention(get_q(f"L{i}.attn.q"), gathered, valid, sink,
                                                          cfg.head_dim**-0.5))

    def _moe(self, i: int, get_q, ids: torch.Tensor, rec: Recorder) -> None:
        w, cfg = self.o.w, self.cfg
        x = get_q(f"L{i}.moe.in")
        p = f"layers.{i}.ffn."
        hashed = cfg.is_hash_layer(i)
        bias = None if hashed else w(p + "gate.bias")
        weights, experts = moe_ops.gate(x, w(p + "gate.weight"), bias, w(p + "gate.tid2eid") if hashed else None,
                                        ids, cfg)
        if not hashed:
            rec(f"L{i}.moe.scores", moe_ops.selection_scores(moe_ops.gate_scores(x, w(p + "gate.weight"), cfg), bias))
        rec(f"L{i}.moe.experts", experts)
        rec(f"L{i}.moe.weights", weights)

        def expert_weights(e: int):
            q = f"{p}experts.{e}."
            return w(q + "w1.weight"), w(q + "w2.weight"), w(q + "w3.weight")

        shared = tuple(w(f"{p}shared_experts.{k}.weight") for k in ("w1", "w2", "w3"))
        rec(f"L{i}.moe.out", moe_ops.moe(x, weights, experts, expert_weights, shared, cfg.swiglu_limit))


def op_mode_sites(cfg: ModelConfig) -> list[str]:
    """Sites op mode produces, per layer."""
    out = []
    for i in range(cfg.n_layers):
        out += [f"L{i}.mhc_attn.{k}" for k in ("pre", "post", "comb")]
        out += [f"L{i}.attn.q", f"L{i}.attn.kv", f"L{i}.attn.core", f"L{i}.moe.out"]
        if cfg.ratio(i):
            out.append(f"L{i}.attn.compressed_kv")
        if cfg.ratio(i) == 4:
            out += [f"L{i}.indexer.keys", f"L{i}.indexer.scores", f"L{i}.indexer.topk"]
    return out
