"""OracleModel: the DSv4 forward pass in exact math (fp32 by default, fp64 on request), spec §4.

No quantization, no bf16 rounding, no Hadamard (orthonormal; exact-math identity for the index scores).
Weights are read from the checkpoint (dequantized exactly) at the moment of use.

One code path serves the full sequence and incremental decode: a session feeds new tokens at the next
positions; each layer keeps only what later tokens need (the last window_size - 1 KV rows, the
compressor's unconsumed token projections, and the compressed entries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import MHC_SITES, SITE, Recorder, record
from oracles import attention as attn
from oracles import mhc
from oracles import moe as moe_ops
from oracles.cache import gather_rows
from oracles.compressor import CompressorState, all_entries, compress, compressor_weights
from oracles.indexer import head_weights, index_queries, index_scores, select_topk
from oracles.norms import rms_norm
from oracles.rope import inv_freq

CHUNK_ELEMENTS = 1 << 25  # bound on [queries x visible rows x head_dim] gathered at once
KEEP_ALL_BYTES = 16 << 30  # models up to this size in fp32 keep every weight they read


@dataclass
class LayerState:
    """What one layer keeps between calls."""

    kv: torch.Tensor | None = None  # [p, hd] window KV rows for positions kv_start ..
    kv_start: int = 0
    comp: CompressorState = field(default_factory=CompressorState)
    index: CompressorState = field(default_factory=CompressorState)


class OracleModel:
    """Exact DSv4 reference over a checkpoint. ``ckpt[name]`` gives canonical (dequantized) weights."""

    def __init__(self, checkpoint, dtype: torch.dtype = torch.float32, cache_weights: bool = True,
                 device: str | torch.device = "cpu", stream_layers: bool | None = None):
        """``cache_weights``: keep the weights read (dequantized, in ``dtype``); ``stream_layers``: keep only the
        current layer's (a release-sized model never exists whole in fp32; default: when its fp32 weights exceed
        KEEP_ALL_BYTES). Routed experts of such a model are dequantized at each use either way."""
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"oracle dtype: expected torch.float32 or torch.float64, found {dtype}")
        self.ckpt = checkpoint
        self.cfg: ModelConfig = checkpoint.config
        self.dtype = dtype
        self.device = torch.device(device)
        self._cache: dict[str, torch.Tensor] | None = {} if cache_weights else None
        self.fp32_bytes = 4 * sum(math.prod(checkpoint.spec(n).shape) for n in checkpoint.names())
        self.keep_experts = self.fp32_bytes <= KEEP_ALL_BYTES
        self.stream_layers = not self.keep_experts if stream_layers is None else stream_layers
        self._layer_held: int | None = None  # the layer whose weights the cache holds when streaming
        self.freqs = {r: inv_freq(self.cfg, r, dtype).to(self.device) for r in {0, *self.cfg.compress_ratios}}

    def w(self, name: str) -> torch.Tensor:
        """Weight ``name`` in the oracle dtype on its device (int tensors keep their dtype)."""
        if self._cache is not None and name in self._cache:
            return self._cache[name]
        if self._cache is not None and self.stream_layers and name.startswith("layers."):
            layer = int(name.split(".")[1])
            if layer != self._layer_held:  # free the previous layer's weights before reading this one's
                for key in [k for k in self._cache if k.startswith("layers.")]:
                    del self._cache[key]
                self._layer_held = layer
        t = self.ckpt[name].to(self.device)
        t = t.to(self.dtype) if t.is_floating_point() else t
        if self._cache is not None and (self.keep_experts or ".ffn.experts." not in name):
            self._cache[name] = t
        return t

    @property
    def weight_policy(self) -> str:
        """What the oracle keeps of its weights, in words (the run manifest's ``oracle_weights``)."""
        if self._cache is None:
            return "none: every weight dequantized at each use"
        kept = "one layer at a time" if self.stream_layers else "all it reads"
        experts = "" if self.keep_experts else "; routed experts dequantized at each use"
        return f"{kept} ({self.fp32_bytes / 2**30:.1f} GiB in fp32 in all){experts}"

    def moe_layer(self, i: int, x: torch.Tensor, ids: torch.Tensor, emit) -> torch.Tensor:
        """Layer i's MoE on x [n, dim] (token ids [n] for hash routing) -> [n, dim]; ``emit(template, tensor or
        callable)`` receives the gate's selection scores (score-routed layers), experts and weights."""
        w, cfg = self.w, self.cfg
        p = f"layers.{i}.ffn."
        hashed = cfg.is_hash_layer(i)
        bias = None if hashed else w(p + "gate.bias")
        weights, experts = moe_ops.gate(x, w(p + "gate.weight"), bias, w(p + "gate.tid2eid") if hashed else None,
                                        ids, cfg)
        if not hashed:
            emit(SITE.moe_scores,
                 lambda: moe_ops.selection_scores(moe_ops.gate_scores(x, w(p + "gate.weight"), cfg), bias))
        emit(SITE.moe_experts, experts)
        emit(SITE.moe_weights, weights)

        def expert_weights(e: int):
            q = f"{p}experts.{e}."
            return w(q + "w1.weight"), w(q + "w2.weight"), w(q + "w3.weight")

        shared = tuple(w(f"{p}shared_experts.{k}.weight") for k in ("w1", "w2", "w3"))
        return moe_ops.moe(x, weights, experts, expert_weights, shared, cfg.swiglu_limit)

    def session(self, recorder: Recorder | None = None) -> OracleSession:
        return OracleSession(self, recorder)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, recorder: Recorder | None = None,
               last_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [T, vocab] at every position, or [len(last_rows), vocab] at those rows (one
        call, no cache carried over; see ``OracleSession.forward``)."""
        return self.session(recorder).forward(input_ids, last_rows)


class OracleSession:
    """Incremental forward: ``prefill(ids)``, then ``step(id)`` one token at a time (or any chunk size)."""

    def __init__(self, model: OracleModel, recorder: Recorder | None = None):
        self.m, self.cfg, self.rec = model, model.cfg, recorder
        self.pos = 0
        self.layers = [LayerState() for _ in range(self.cfg.n_layers)]
        self.calls = 0

    def emit(self, template: str, layer: int | None, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Record ``tensor`` at the site ``template`` of ``layer`` (None outside the layers) if the recorder wants
        it (a callable is evaluated only then)."""
        record(self.rec, template, layer, tensor)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, last_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward(input_ids, last_rows)

    @torch.no_grad()
    def step(self, token_id: int | torch.Tensor) -> torch.Tensor:
        """One decode token -> logits [vocab]."""
        return self.forward(torch.as_tensor([int(token_id)]))[0]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, last_rows: torch.Tensor | None = None) -> torch.Tensor:
        """New tokens [n] at positions pos .. pos+n-1 -> logits [n, vocab].

        ``last_rows`` (indices into the n rows): logits [len(last_rows), vocab] of those rows only; every layer
        but the last still runs every row (later tokens and layers read their KV and compressed entries), the
        last layer's attention and MoE run only these rows. The caches end as after a full call."""
        return self.differentiable_forward(input_ids, last_rows)

    def differentiable_forward(self, input_ids: torch.Tensor, last_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` under the caller's grad mode (training runs it with autograd on)."""
        ids = torch.as_tensor(input_ids).long().flatten()
        if ids.numel() == 0:
            raise ValueError("input_ids: expected at least one token, found 0")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"input_ids: expected ids in [0, {self.cfg.vocab_size}), found "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        if self.rec is not None:
            self.rec.step = self.calls
        ids = ids.to(self.m.device)
        positions = torch.arange(self.pos, self.pos + ids.numel(), device=self.m.device)
        x = self.m.w("embed.weight")[ids]  # [n, dim]
        self.emit("embed", None, x)
        x = x.unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)  # [n, hc, dim]
        last = self.cfg.n_layers - 1
        last_rows = last_rows.to(self.m.device) if last_rows is not None else None
        for i in range(self.cfg.n_layers):
            x = self.block(i, x, positions, ids, last_rows if i == last else None)
        logits = self.head(x)
        self.pos += ids.numel()
        self.calls += 1
        return logits

    @torch.no_grad()
    def forward_layers(self, input_ids: torch.Tensor, layer_input, rows: torch.Tensor | None = None,
                       layer_picks=None) -> None:
        """Layer mode: layer i runs on ``layer_input(i)`` [n, hc, dim] (another model's input to that layer)
        and keeps its own exact caches; ``rows`` restricts attention/MoE to sampled query rows.
        ``layer_picks(i)``: the other model's top-k [n, k] of CSA layer i (None: the oracle's own), which the
        attention then reads instead of the oracle's selection; the indexer still runs and reports its own."""
        ids = torch.as_tensor(input_ids).long().flatten().to(self.m.device)
        if self.rec is not None:
            self.rec.step = self.calls
        positions = torch.arange(self.pos, self.pos + ids.numel(), device=self.m.device)
        rows = rows.to(self.m.device) if rows is not None else None
        for i in range(self.cfg.n_layers):
            picks = layer_picks(i) if layer_picks is not None and self.cfg.ratio(i) == 4 else None
            if picks is not None:
                picks = picks.to(self.m.device).long()
                picks = picks[rows] if rows is not None and len(picks) != len(rows) else picks
            self.block(i, layer_input(i).to(self.m.device, self.m.dtype), positions, ids, rows, picks)
        self.pos += ids.numel()
        self.calls += 1

    # ---- one block ------------------------------------------------------------------------
    def block(self, i: int, x: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
              rows: torch.Tensor | None = None, picks: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i on streams x [n, hc, dim] -> [n, hc, dim], or [len(rows), hc, dim] for the query rows
        ``rows`` only: KV and compressed entries are still computed for every row (later queries need them),
        attention, MoE and the mixing only for the selected ones (sampled-query evaluation). ``picks``: a CSA
        layer's selection [n_queries, k] given from outside (layer mode), attended instead of the indexer's."""
        w, cfg = self.m.w, self.cfg
        y = self.hc_pre(i, "attn", x)
        h = rms_norm(y[0], w(f"layers.{i}.attn_norm.weight"), cfg.norm_eps)
        self.emit(SITE.attn_in, i, h)
        f = self.attention(i, h, positions, rows, picks)
        self.emit(SITE.attn_out, i, f)
        if rows is not None:
            x, y, ids = x[rows], tuple(t[rows] for t in y), ids[rows]
        x = mhc.hc_post(f, x, y[1], y[2])
        y = self.hc_pre(i, "ffn", x)
        h = rms_norm(y[0], w(f"layers.{i}.ffn_norm.weight"), cfg.norm_eps)
        self.emit(SITE.moe_in, i, h)
        f = self.moe(i, h, ids)
        self.emit(SITE.moe_out, i, f)
        x = mhc.hc_post(f, x, y[1], y[2])
        self.emit(SITE.residual, i, x)
        return x

    def hc_pre(self, i: int, which: str, x: torch.Tensor):
        """-> (collapsed [n, dim], post [n, hc], comb [n, hc, hc])."""
        w, cfg = self.m.w, self.cfg
        mixes = mhc.hc_mixes(x, w(f"layers.{i}.hc_{which}_fn"), cfg.norm_eps)
        pre, post, comb = mhc.hc_split(mixes, w(f"layers.{i}.hc_{which}_scale"), w(f"layers.{i}.hc_{which}_base"),
                                       cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        self.emit(MHC_SITES[which, "pre"], i, pre)
        self.emit(MHC_SITES[which, "post"], i, post)
        self.emit(MHC_SITES[which, "comb"], i, comb)
        return mhc.hc_collapse(x, pre), post, comb

    def head(self, x: torch.Tensor) -> torch.Tensor:
        w, cfg = self.m.w, self.cfg
        y = mhc.hc_head(x, w("hc_head_fn"), w("hc_head_scale"), w("hc_head_base"), cfg.norm_eps, cfg.hc_eps)
        y = rms_norm(y, w("norm.weight"), cfg.norm_eps)
        self.emit("final", None, y)
        logits = y @ w("head.weight").T
        self.emit("logits", None, logits)
        return logits

    # ---- attention ------------------------------------------------------------------------
    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor,
                  rows: torch.Tensor | None = None, given: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, dim] (normed) -> [n, dim], or [len(rows), dim] for the selected query rows; ``given`` [nq, k]:
        the compressed entries a CSA layer attends (picks that are not causally visible read nothing)."""
        w, cfg, st = self.m.w, self.cfg, self.layers[i]
        ratio, p = cfg.ratio(i), f"layers.{i}.attn."
        freqs = self.m.freqs[ratio]
        qx, qpos = (x, positions) if rows is None else (x[rows], positions[rows])
        q, qr = attn.query(qx, w(p + "wq_a.weight"), w(p + "q_norm.weight"), w(p + "wq_b.weight"), qpos, freqs,
                           cfg.n_heads, cfg.norm_eps)
        kv = attn.window_kv(x, w(p + "wkv.weight"), w(p + "kv_norm.weight"), positions, freqs, cfg.norm_eps)
        self.emit(SITE.attn_q, i, q)
        self.emit(SITE.attn_kv, i, kv)
        if st.kv is None:
            st.kv, st.kv_start = kv, int(positions[0])
        else:
            st.kv = torch.cat((st.kv, kv))
        entries = x.new_zeros((0, cfg.head_dim))
        if ratio:
            new = compress(x, positions, st.comp, compressor_weights(self.m.w, p + "compressor."), freqs, cfg.norm_eps)
            self.emit(SITE.attn_compressed_kv, i, new)
            entries = all_entries(st.comp, cfg.head_dim, x)
        picks = self.indexer(i, x, qr, positions, rows) if ratio == 4 else None
        if given is not None:
            limit = torch.clamp((qpos + 1) // ratio, max=entries.shape[0])[:, None]
            picks = torch.where((given >= 0) & (given < limit), given, -1)
        o = self.attend(i, q, qpos, st, entries, picks)
        self.emit(SITE.attn_core, i, o)
        keep = max(0, int(positions[-1]) + 1 - (cfg.window_size - 1))
        st.kv, st.kv_start = st.kv[keep - st.kv_start :], keep
        return attn.output_projection(o, qpos, freqs, w(p + "wo_a.weight"), w(p + "wo_b.weight"), cfg.o_groups)

    def attend(self, i: int, q: torch.Tensor, positions: torch.Tensor, st: LayerState, entries: torch.Tensor,
               picks: torch.Tensor | None) -> torch.Tensor:
        """Sparse attention of q [n, H, hd] over window rows and compressed entries, in query chunks.
        HCA layers see every complete entry, so their entries are shared by all queries, not gathered."""
        cfg = self.cfg
        ratio = cfg.ratio(i)
        win = attn.window_positions(positions, cfg.window_size)  # [n, W]
        if ratio == 0:
            comp = win.new_zeros((len(positions), 0))
        elif picks is None:
            comp = attn.hca_entries(positions, ratio, entries.shape[0])
        else:
            comp = picks
        self.emit(SITE.attn_visible, i, torch.cat((win, comp), dim=1))
        shared = ratio > 0 and picks is None  # HCA
        kv_rows = torch.where(win >= 0, win - st.kv_start, 0)  # [n, W] rows of st.kv (row 0 where none)
        # rows of the table [window rows; compressed entries] (row 0 where none), read without building it
        entry_rows = torch.where(comp >= 0, comp + st.kv.shape[0], 0)  # [n, K]
        valid = win >= 0 if shared else torch.cat((win >= 0, comp >= 0), dim=1)
        sink, scale = self.m.w(f"layers.{i}.attn.attn_sink"), cfg.head_dim**-0.5
        out = []
        step = max(1, CHUNK_ELEMENTS // max(1, (cfg.window_size + comp.shape[1]) * cfg.head_dim))
        for s in range(0, len(positions), step):
            sl = slice(s, s + step)
            rows = st.kv[kv_rows[sl]]  # [n, W, hd]
            if shared:
                out.append(attn.window_and_entries_attention(q[sl], rows, valid[sl], entries, comp[sl] >= 0, sink,
                                                             scale))
            else:
                rows = torch.cat((rows, gather_rows((st.kv, entries), entry_rows[sl])), dim=1)  # [n, W + K, hd]
                out.append(attn.sparse_attention(q[sl], rows, valid[sl], sink, scale))
        return torch.cat(out)

    def indexer(self, i: int, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k compressed entries per query [n_queries, index_topk] (-1 = none); qr holds the query rows."""
        w, cfg, st = self.m.w, self.cfg, self.layers[i]
        p = f"layers.{i}.attn.indexer."
        freqs = self.m.freqs[4]
        qx, qpos = (x, positions) if rows is None else (x[rows], positions[rows])
        q = index_queries(qr, w(p + "wq_b.weight"), qpos, freqs, cfg.index_n_heads)  # [nq, h, d]
        self.emit(SITE.indexer_q, i, q)
        new = compress(x, positions, st.index, compressor_weights(self.m.w, p + "compressor."), freqs, cfg.norm_eps)
        self.emit(SITE.indexer_keys, i, new)
        keys = all_entries(st.index, cfg.index_head_dim, x)
        weights = head_weights(qx, w(p + "weights_proj.weight"), cfg.index_n_heads, cfg.index_head_dim)
        self.emit(SITE.indexer_weights, i, weights)
        picks = []
        step = max(1, CHUNK_ELEMENTS // max(1, keys.shape[0] * cfg.index_n_heads))
        for s in range(0, len(qpos), step):
            sl = slice(s, s + step)
            scores = index_scores(q[sl], keys, weights[sl], qpos[sl], 4)
            self.emit(SITE.indexer_scores, i, scores)
            picks.append(select_topk(scores, qpos[sl], 4, cfg.index_topk))
        picks = torch.cat(picks)
        self.emit(SITE.indexer_topk, i, picks)
        return picks

    # ---- MoE -------------------------------------------------------------------------------
    def moe(self, i: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.m.moe_layer(i, x, ids, lambda template, t: self.emit(template, i, t))
