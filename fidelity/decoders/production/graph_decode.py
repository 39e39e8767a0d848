"""Graph decode: the production decode step with every shape fixed by ``max_context`` and the position held in
a device tensor, so that the step has no host sync and, on CUDA, is captured once in a CUDA graph and replayed.

Same numerics as the eager session (``policies.EagerDecode``; tested bit for bit on the CPU). The step is a decode
policy, :class:`GraphDecode`, over the same layer objects:

* the compressors run every step and the entry of the block ending at the token is written only where the
  block completes (``write_at_block_end``: a device-side condition), so the caches hold exactly the eager
  session's bytes;
* the indexer scores every key slot of the cache and masks ``j >= (t+1)//4`` to -inf before the same stable
  top-k, so it picks the same entries; where fewer than ``index_topk`` entries are visible the extra picks are
  -1 (masked), which adds fully masked 64-entry blocks at the end of the attention's online softmax: those
  leave its max, sum and accumulator unchanged (alpha = 1, P = 0);
* HCA layers attend over every compressed slot with ``j >= (t+1)//ratio`` masked;
* a paged cache (profile ``kv_cache`` paged:<block>) is addressed through its block table on the device: the
  stores translate every slot (``cache._RowStore.physical``), the packed FP8 attention gets storage rows, and the
  packed FP4 indexer keys are gathered into contiguous buffers each step;
* routed experts run in ascending expert id (the eager order) on weights picked on the device from a per-layer
  stack of all experts (``ProductionModel.expert_stack``).

The cost of fixed shapes: the indexer and HCA layers work on the whole ``max_context`` capacity rather than on
the entries visible so far, so size ``max_context`` to the run. Prefill stays eager.

Sites: a decode step emits every site the eager session's does, with the same names, shapes and values (tested
bit for bit on the CPU). A step that runs (``graphs=False``, and the eager warm-up before a capture) records at
once; a captured step clones each site its recorder wants inside the capture, so the clone is a graph output that
every replay refreshes, and after each replay the clones go to the recorder. Where the step's tensor has a fixed
capacity shape, a host-side finisher (:meth:`GraphDecode.finisher`, which knows the position) turns it into
the eager record: the index scores cut to the ``(t+1)//4`` visible keys, the visible set cut to the window and
the entries attended, the compressed entry and indexer key (computed every step) kept only where the block
completes, else an empty [0, d] record. No site needs an eager replay of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fidelity.decoders.production import faults, registry
from fidelity.decoders.production.call_counts import counting
from fidelity.decoders.production.compressor import compress_decode_on_device
from fidelity.decoders.production.decode_slots import decode_idx, decode_slots, mask_past
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.model import ProductionModel, ProductionSession
from fidelity.decoders.production.policies import EagerDecode
from fidelity.decoders.production.shapes import pad, topk_cap, unrotated, visible, window_idx_on_device
from fidelity.decoders.production.topk import stable_topk
from fidelity.model.sites import SITE, Recorder, record, site_name

if TYPE_CHECKING:
    from fidelity.decoders.production.attention import Attention
    from fidelity.decoders.production.compressor import Compressor
    from fidelity.decoders.production.indexer import Indexer
    from fidelity.decoders.production.moe import MoE

SLOT_FAULTS = ("window-127", "window-no-self", "causal-off-by-one")  # faults that move the rows a decode step reads
GRAPH_FAULTS = ("cache-concat-growth", "decode-buffer-kept")  # faults whose decode step a graph step cannot run
Finisher = Callable[[torch.Tensor], torch.Tensor]
Output = tuple[str, "int | None", torch.Tensor, "Finisher | None"]  # a captured site: template, layer, clone, finisher


def graph_blockers() -> list[str]:
    """The injected faults (of ``GRAPH_FAULTS``) that a graph decode step cannot run: each allocates per step
    what it keeps."""
    return [f for f in GRAPH_FAULTS if on(f)]


def _wants_key(rec) -> object:
    """What decides which sites a captured step clones: the recorder's patterns (None: no recorder)."""
    if rec is None:
        return None
    patterns = getattr(rec, "patterns", None)
    return tuple(patterns) if isinstance(patterns, (list, tuple)) else id(rec)


class GraphDecodeSession(ProductionSession):
    """A session whose decode steps are sync-free and, with ``graphs`` (default: on CUDA), CUDA-graph replays:
    a ``ProductionSession`` under the :class:`GraphDecode` policy.

    The first step (and the first after the injected faults or an op's selected implementation change) runs
    eagerly, which compiles the kernels and loads the weights, then the step is captured; later steps copy the
    token and position into the graph's input buffers and replay it. ``replays`` counts replayed steps,
    ``captures`` captured graphs (a change of the faults, the ops' selections or the recorder's patterns captures
    anew; a wider top-k, fault ``index-topk-hardcoded``, re-sizes the gather buffer in that eager step, before the
    capture). ``recorder``: the sites of every call, as ``ProductionSession`` records them (module docstring)."""

    def __init__(self, model: ProductionModel, graphs: bool | None = None, recorder: Recorder | None = None):
        super().__init__(model, recorder, decode=GraphDecode(model, graphs))

    @property
    def graphs(self) -> bool:
        return self.decode.graphs

    @property
    def replays(self) -> int:
        return self.decode.replays

    @property
    def captures(self) -> int:
        return self.decode.captures

    def eager_session(self) -> ProductionSession:
        """A ``ProductionSession`` that continues this sequence eagerly: the same caches (not copied), position,
        call count, recorder and counts; this session's graph is dropped."""
        twin = ProductionSession(self.model, self.rec, own=range(0))  # allocates no cache: it takes these
        twin.own, twin.layers, twin.pos, twin.calls = self.own, self.layers, self.pos, self.calls
        twin.counts, twin.kept = self.counts, self.kept
        self.decode.drop_graph()
        return twin


class GraphDecode(EagerDecode):
    """The decode policy of graph decode: the position in a device tensor (``pos_dev``), every shape fixed by
    ``max_context``, the step run, captured or replayed (``graphs``: CUDA graphs, default on CUDA). A prefill
    stays eager (the policy's pieces are asked only for a decode token, except :meth:`moe` and :meth:`emit`, which
    run a prefill's rows as the eager session does)."""

    def __init__(self, model: ProductionModel, graphs: bool | None = None):
        dev = model.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        if self.graphs and dev.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need a CUDA model, found device {dev}")
        self.pos_dev = torch.zeros(1, dtype=torch.long, device=dev)
        self.ids_dev = torch.zeros(1, dtype=torch.long, device=dev)
        self.replays = 0
        self.captures = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None
        self._graph_logits: torch.Tensor | None = None
        self._graph_outputs: list[Output] = []  # the captured step's site clones (graph outputs)
        self._capturing: list[Output] | None = None  # set while a step is being captured

    # ---- the step ------------------------------------------------------------------------------------------------
    def step(self, s: ProductionSession, ids: torch.Tensor) -> torch.Tensor:
        if blocked := graph_blockers():
            raise ValueError(f"fault {blocked[0]}: a step that allocates what it keeps cannot run in a graph decode "
                             "step; use ProductionSession")
        self.ids_dev.copy_(ids)
        self.pos_dev.fill_(s.pos)
        if s.rec is not None:
            s.rec.step = s.calls
        with counting(s.counts):
            logits = self._graph_step(s) if self.graphs else s._forward(self.ids_dev, self.pos_dev)
        s.pos += 1
        s.calls += 1
        return logits.clone()

    def _graph_step(self, s: ProductionSession) -> torch.Tensor:
        key = (faults.active(), tuple(sorted(registry.selections().items())), _wants_key(s.rec))
        if self._graph is not None and key == self._graph_key:
            self._graph.replay()
            self.replays += 1
            for template, layer, t, finish in self._graph_outputs:  # the replay's sites, from the graph's outputs
                record(s.rec, template, layer, finish(t) if finish else t)
            return self._graph_logits
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager step: compiles, loads weights, warms cuBLAS on a side stream
            logits = s._forward(self.ids_dev, self.pos_dev)
        torch.cuda.current_stream().wait_stream(side)
        self._graph, self._graph_outputs = None, []  # the old graph's memory goes before the new one is captured
        graph, self._capturing = torch.cuda.CUDAGraph(), []
        try:
            with torch.cuda.graph(graph):  # records the next steps; runs nothing now
                self._graph_logits = s._forward(self.ids_dev, self.pos_dev)
        finally:
            self._graph_outputs, self._capturing = self._capturing, None
        self._graph, self._graph_key = graph, key
        self.captures += 1
        return logits

    def drop_graph(self) -> None:
        """Let the captured graph and its outputs go (the sequence continues eagerly)."""
        self._graph, self._graph_outputs, self._graph_logits = None, [], None

    # ---- sites -------------------------------------------------------------------------------------------------
    def emit(self, s: ProductionSession, template: str, layer: int | None, tensor) -> None:
        """A decode step's site: a callable evaluated now (inside the step, so inside a capture), finished on the
        host (:meth:`finisher`) and recorded now, or under capture cloned as a graph output, recorded after each
        replay. A prefill records as the eager session does."""
        if s.in_prefill or s.rec is None:
            return super().emit(s, template, layer, tensor)
        site = site_name(template, layer)
        if not s.rec.wants(site):
            return
        t = tensor() if callable(tensor) else tensor
        finish = self.finisher(s, template, layer)
        if self._capturing is not None:
            self._capturing.append((template, layer, t.clone(), finish))
        else:
            s.rec(site, finish(t) if finish else t)

    def finisher(self, s: ProductionSession, template: str, layer: int | None) -> Finisher | None:
        """How the decode step's fixed-shape record of ``template`` becomes the eager step's at ``s.pos`` (the
        step's position, on the host, read when the finisher runs; None: recorded as it is)."""
        ratio = s.cfg.ratio(layer) if layer is not None else 0
        if template == SITE.attn_compressed_kv:  # [1, hd] bf16 -> itself at block end, else [0, hd]
            return lambda t: t if self._completes(s, ratio) else t[:0]
        if template == SITE.indexer_keys:  # [1, d] -> itself at block end, else fp32 [0, d] (emit_keys' empty)
            return lambda t: t if self._completes(s, 4) else t.new_zeros((0, t.shape[-1]), dtype=torch.float32)
        if template == SITE.indexer_scores:  # [1, key capacity] -> [1, (t+1)//4], the keys the eager step scores
            return lambda t: t[:, : (s.pos + 1) // 4]
        if template == SITE.attn_visible and ratio:  # [1, W + capacity] -> [1, W + entries attended]
            window = s.layers[layer].window
            return lambda t: t[:, : window + self._entries_attended(s, ratio)]
        return None

    @staticmethod
    def _completes(s: ProductionSession, ratio: int) -> bool:
        return (s.pos + 1) % ratio == 0

    @staticmethod
    def _entries_attended(s: ProductionSession, ratio: int) -> int:
        """The compressed entries the eager decode step at ``s.pos`` attends (the width of its picks)."""
        if ratio == 4:
            return min(topk_cap(s.cfg.index_topk), (s.pos + 1) // 4)
        return (s.pos + 1) // ratio + (1 if on("causal-off-by-one") and (s.pos + 1) % ratio else 0)

    # ---- the decode pieces that the eager step sizes or branches on the host position --------------------------
    def window_slot(self, s: ProductionSession, win: int) -> torch.Tensor:
        return self.pos_dev % win

    def window_idx(self, s: ProductionSession, win: int, device: torch.device) -> torch.Tensor:
        return window_idx_on_device(self.pos_dev, win)

    def compressed(self, attn: Attention, s: ProductionSession, x: torch.Tensor, qr,
                   positions: torch.Tensor) -> torch.Tensor:
        attn.compressor(s, x, positions)
        if attn.ratio == 4:
            return self.below_limit(self.index_picks(attn.indexer, s, x, qr, positions))
        return self.hca_entries(s, attn)

    def hca_entries(self, s: ProductionSession, attn) -> torch.Tensor:
        """An HCA layer's compressed entries the token sees: every id ``j < (t+1)//ratio``, -1 past it
        [1, capacity]."""
        limit = (self.pos_dev + 1) // attn.ratio
        if on("causal-off-by-one"):
            limit = limit + ((self.pos_dev + 1) % attn.ratio != 0).long()
        j = torch.arange(s.layers[attn.i].n_compressed, device=self.pos_dev.device)
        return torch.where(j < limit, j, -1)[None]

    def compress(self, compressor: Compressor, s: ProductionSession, x: torch.Tensor, positions: torch.Tensor) -> None:
        """The token through the compressor every step; its entry written only where the block completes
        (``write_at_block_end``), recorded through :meth:`finisher`."""
        cache, i = s.layers[compressor.i], compressor.i
        entry = compress_decode_on_device(x, self.pos_dev, compressor.weights(s, x), compressor.carry(s),
                                          compressor.ratio, compressor.freqs, s.cfg.norm_eps)
        entry = compressor.round(entry)
        if compressor.index:
            cache.keys.write_at_block_end(self.pos_dev, compressor.ratio, 0, entry)
            s.emit(SITE.indexer_keys, i, lambda: unrotated(entry, s.profile))
        else:
            cache.kv.write_at_block_end(self.pos_dev, compressor.ratio, cache.window, entry)
            s.emit(SITE.attn_compressed_kv, i, entry)
        return None

    def below_limit(self, picks: torch.Tensor) -> torch.Tensor:
        """The indexer's picks [1, k] with those at or past the causal limit ``(t+1)//4`` set to -1."""
        return torch.where(picks >= (self.pos_dev + 1) // 4, -1, picks)

    def index_picks(self, indexer: Indexer, s: ProductionSession, x: torch.Tensor, qr,
                    positions: torch.Tensor) -> torch.Tensor:
        """The indexer's top-k over every key slot with ``j >= (t+1)//4`` scored -inf [1, k]; picks of masked slots
        (fewer visible entries than k) are still in it, at or past the limit."""
        cache, i = s.layers[indexer.i], indexer.i
        q, weights = indexer.query(s, x, qr, positions)
        indexer.compressor(s, x, positions)
        n = cache.keys.capacity
        scores = mask_past(indexer.scorer(cache.keys, n)(q, weights), self.pos_dev, 4)
        s.emit(SITE.indexer_scores, i, scores.float)
        picks = stable_topk(scores, min(topk_cap(s.cfg.index_topk), n))
        s.emit(SITE.indexer_topk, i, lambda: pad(self.below_limit(picks), s.cfg.index_topk))
        return picks

    def attend(self, attn: Attention, s: ProductionSession, x, qr, q, kv, positions) -> torch.Tensor:
        """``Attention.decode`` with the attended rows from :func:`decode_idx` (a flat bf16 store: the attention
        reads the store's rows where they are, nothing gathered) or :func:`decode_slots` (one launch on a GPU
        each); ``Attention.decode`` under this policy while a fault that moves those rows is injected."""
        if any(on(f) for f in SLOT_FAULTS):
            return attn.decode(s, x, qr, q, kv, positions)
        cache, ratio, i = s.layers[attn.i], attn.ratio, attn.i
        cache.kv.write_at_block_end(self.pos_dev, 1, 0, kv, ring=cache.window)  # slot pos % window, on the device
        if cache.kv.fmt == "fp8":
            attn.emit_kv_cache(s, kv, self.window_slot(s, cache.window))
        picks = None
        if ratio:
            attn.compressor(s, x, positions)
            picks = self.index_picks(attn.indexer, s, x, qr, positions) if ratio == 4 else None
        s.emit(SITE.attn_visible, i, lambda: self.visible(s, attn, picks, positions))
        if cache.kv.fmt != "fp8" and not cache.kv.block:  # the attention reads the store's rows where they are
            idx = decode_idx(self.pos_dev, picks, cache.window, ratio, cache.n_compressed)
            return attn.op("sparse_attention")(q, cache.kv.rows, idx, attn.sink, attn.scale, s.profile.fmha)
        rows, local = decode_slots(self.pos_dev, picks, cache.window, ratio, cache.n_compressed)
        if cache.kv.fmt == "fp8" and s.profile.fmha == "bf16":
            return attn.packed(s, q, torch.where(local >= 0, rows, -1))
        _, buf = cache.decode_buffers(rows.shape[0])
        cache.kv.read_into(rows, buf)
        return attn.op("sparse_attention")(q, buf, local, attn.sink, attn.scale, s.profile.fmha)

    def visible(self, s: ProductionSession, attn, picks: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """Site ``L{i}.attn.visible`` of the step, fixed width [1, W + capacity]: the window's token positions, then
        the entries below the causal limit (the picks on CSA layers, every id on HCA), -1 elsewhere."""
        ratio, win = attn.ratio, s.layers[attn.i].window
        comp = None if not ratio else self.below_limit(picks) if ratio == 4 else self.hca_entries(s, attn)
        return visible(self.window_idx(s, win, positions.device), comp, positions, win, prefill=False)

    def moe(self, moe: MoE, s: ProductionSession, h, ids: torch.Tensor) -> torch.Tensor:
        """One token's MoE with its expert ids kept on the device (``MoE.picked_on_device``); more rows, or experts
        read as stored (sync-free already), as the eager session runs them."""
        if h.shape[0] != 1 or s.model.stored_experts(moe.i) is not None:
            return moe.forward(s, h, ids)
        return moe.picked_on_device(s, h, ids)
