"""The built-in production decoder (``fidelity.decoders.production``) as a decoder under test: every site, every
mode, and several sequences (``forward``, ``fork``, ``rollback``: docs/scenarios.md). On CUDA the runner's decode
steps are CUDA-graph replays by default (``graphs``; docs/running.md "Graph decode")."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Call, Decoder, DecoderError
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.batch import forward_batch
from fidelity.decoders.production.cache import LayerCache
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.graph_decode import GraphDecodeSession, graph_blockers
from fidelity.decoders.production.model import ProductionSession
from fidelity.decoders.production.profiles import Profile, profile_dict
from fidelity.decoders.production.registry import implementations_used
from fidelity.model.config import ModelConfig
from fidelity.model.sampling import Sampler, StopSet
from fidelity.model.sites import SITE, SITES

GRAPHS_OFF_CPU = ("off by default on the CPU: CUDA graphs need a CUDA device (graphs=True runs the same fixed-shape "
                  "decode step uncaptured)")
GRAPHS_OFF_FORWARD = "forward, fork and rollback run eager sessions (sequence 0 decodes eagerly from then on)"
MULTI = ("a forward with several sequences is one batched model call (varlen): the projections, norms, mHC, MoE "
         "and head over every sequence's rows at once, the attention core per sequence over its own caches; a "
         "sequence's logits equal its logits alone up to the rounding of GEMMs over other row counts")
SPLIT_ALIGN = 128  # on the CPU a prefill split into calls on multiples of this gives the whole prefill's bits


@dataclass
class Snapshot:
    """A sequence's state at the end of a ``forward`` call: ``pos``, ``calls`` and, per layer, copies of what a
    later call overwrites: the window ring (KV rows ``[:window]``) and the compressors' fp32 carries (main and
    indexer). The compressed entries and indexer keys are not copied: an entry is written once, when its block
    completes, and read only after that, so every entry below ``pos // ratio`` is still the one this state had
    (a rollback drops the snapshots past its position; what lies beyond is invisible and rewritten before it is
    read)."""

    pos: int
    calls: int
    layers: list[dict[str, torch.Tensor] | None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for saved in self.layers if saved for t in saved.values())


@dataclass
class Sequence:
    """One sequence: its session, every token it consumed (``tokens``) and its snapshots by position."""

    session: ProductionSession
    tokens: list[int] = field(default_factory=list)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)


def _ring(cache: LayerCache) -> list[torch.Tensor]:
    """The window ring (logical KV rows ``[:window]``) as stored: bf16 rows or packed FP8 rows (a view of a flat
    cache; a copy gathered through a paged cache's block table)."""
    (store,) = cache.kv.parts()
    return [store[cache.kv.physical(slice(0, cache.window))]]


def _carries(cache: LayerCache) -> dict[str, torch.Tensor]:
    out = {}
    for name, carry in (("carry", cache.carry), ("index_carry", cache.index_carry)):
        if carry is not None:
            out[f"{name}.kv"], out[f"{name}.score"] = carry.kv, carry.score
    return out


def _entries(cache: LayerCache, pos: int) -> list[tuple[torch.Tensor, slice | torch.Tensor]]:
    """The compressed entries and indexer keys a state at ``pos`` holds: (storage tensor, its storage rows: a slice
    when flat, an index tensor when paged; two sessions of one model have the same block tables, so the same
    rows)."""
    out = []
    if cache.ratio:
        (store,) = cache.kv.parts()
        out.append((store, cache.kv.physical(slice(cache.window, cache.window + pos // cache.ratio))))
    if cache.keys is not None:
        rows = cache.keys.physical(slice(0, pos // 4))
        out += [(t, rows) for t in cache.keys.parts()]
    return out


class ProductionDecoder(Decoder):
    """``ProductionModel(checkpoint, profile, max_context, device)`` and sessions over it, one per sequence.

    Sequence 0 is the one ``prefill`` / ``step`` / ``rec`` act on (``session``). ``forward(calls)`` continues each
    call's sequence (a sequence's first call, at start 0, creates its session); several calls are one batched model
    call (``batch.forward_batch``, ``info()['multi_sequence']``): a sequence's logits depend on the others' only
    through the rounding of GEMMs over all the rows. ``recorders`` ({seq: Recorder}, default None: only sequence
    0's ``rec``) gives each sequence of a ``forward`` its recorder; the replays of forks and rollbacks record nothing.

    ``fork`` and ``rollback`` restore a :class:`Snapshot`, taken at the end of every ``forward`` call (not by
    ``prefill`` / ``step``, the single-sequence runner's path, which keeps only the token history): at a snapshot's
    position the state returns exactly; elsewhere the last snapshot before it (or the empty state) is restored and
    the sequence's recorded tokens up to the position are replayed as one call. A snapshot holds per layer the
    window ring (window x KV row bytes) and the carries: 0.5 MB on the default checkpoint (``snapshot_bytes``; the
    two HCA layers' 128-token carries are half of it), one per forward call, freed by ``reset`` and by a rollback
    past them (a fork shares its parent's).
    ``snapshots=False`` keeps none (every fork and rollback then replays from position 0).

    ``graphs`` (None: on for a CUDA model, off on the CPU): sequence 0's session, the runner's ``prefill`` /
    ``step`` path, is a :class:`GraphDecodeSession`: its decode steps are fixed-shape and sync-free, captured in a
    CUDA graph and replayed on CUDA (uncaptured on the CPU), and record the same sites. The prefill stays eager, and
    so do ``forward``, ``fork`` and ``rollback``: the first of them switches sequence 0 to an eager session over the
    same caches, as does an injected fault that a graph step cannot run (``graph_decode.GRAPH_FAULTS``); ``info()``
    says whether graphs ran, why not, and how many steps' sites came from the graph's outputs.
    """

    def __init__(self, checkpoint, profile: str | Profile = "reference", max_context: int = 4096,
                 device: str | torch.device = "cpu", snapshots: bool = True, graphs: bool | None = None):
        self.model = ProductionModel(checkpoint, profile, max_context, device)
        self.graphs = self.model.device.type == "cuda" if graphs is None else graphs
        self.graphs_off: str | None = None  # why sequence 0 decodes eagerly (None: it runs graph decode)
        if not self.graphs:
            self.graphs_off = GRAPHS_OFF_CPU if graphs is None else "off (graphs=False, --no-graphs)"
        self.decode_sites = {"graph outputs": 0, "eager": 0}  # sequence 0's decode steps by where their sites came from
        self.seqs: dict[int, Sequence] = {0: Sequence(self._session0())}
        self.config = checkpoint.config
        self.profile = profile_dict(self.model.profile)
        self.label = f"production ({self.model.profile.name})"
        self.keep_snapshots = snapshots
        self.prompt_len = 0  # tokens prefilled on sequence 0 (the prompt, however many chunks)
        self.recorders: dict | None = None  # {seq: Recorder} for forward's calls (None: sequence 0's rec only)
        self.records_sequences = True
        self.used = False  # a call reached a session since the sequences were made

    def reset(self) -> None:
        """Every sequence dropped, sequence 0 a fresh session (new caches at position 0) once a call was made; the
        old sessions and snapshots are dropped first, so that the caches are never held twice."""
        if self.used:
            recorder = self.session.rec
            self.seqs = {}
            self.seqs[0] = Sequence(self._session0(recorder))
            self.prompt_len, self.used = 0, False
            self.decode_sites = dict.fromkeys(self.decode_sites, 0)

    def _session0(self, recorder=None) -> ProductionSession:
        """Sequence 0's new session: a :class:`GraphDecodeSession` (captured on CUDA) while graphs are on and no
        injected fault rules them out, else eager."""
        if self.graphs and (blocked := graph_blockers()):
            self.graphs_off = _fault_reason(blocked)
        elif self.graphs:
            self.graphs_off = None
            return GraphDecodeSession(self.model, self.model.device.type == "cuda", recorder)
        return self.model.session(recorder)

    def _eager0(self, reason: str) -> None:
        """Sequence 0 decodes eagerly from now on (``reason``): its graph session, if any, becomes a
        ``ProductionSession`` over the same caches and state."""
        session = self.session
        if isinstance(session, GraphDecodeSession):
            self.seqs[0].session = session.eager_session()
            self.graphs_off = reason

    @property
    def session(self) -> ProductionSession:
        return self.seqs[0].session

    @property
    def rec(self):
        return self.session.rec

    @rec.setter
    def rec(self, recorder) -> None:
        self.session.rec = recorder

    @property
    def pos(self) -> int:
        return self.session.pos

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.used = True
        logits = self.session.prefill(ids, last_only=self.last_logits_only)
        self.seqs[0].tokens += torch.as_tensor(ids).flatten().tolist()  # one host read (int() per id: 0.13 s per 16K)
        self.prompt_len += len(ids)
        return logits

    def step(self, token: int) -> torch.Tensor:
        self.used = True
        if blocked := graph_blockers():
            self._eager0(_fault_reason(blocked))
        session = self.session
        replays = getattr(session, "replays", 0)
        logits = session.step(token)
        self.decode_sites["graph outputs" if getattr(session, "replays", 0) > replays else "eager"] += 1
        self.seqs[0].tokens.append(int(token))
        return logits

    # ---- several sequences -------------------------------------------------------------------
    def capabilities(self) -> dict[str, str | None]:
        return {BATCH: None, FORK: None, ROLLBACK: None}

    def same_bits(self, split: tuple[int, ...] = ()) -> str:
        """On the CPU: the same calls give the same bits (forks, rollbacks and other sequences' calls between them
        included), and so do calls split on multiples of ``SPLIT_ALIGN``; no promise on another device."""
        if self.model.device.type != "cpu" or any(p % SPLIT_ALIGN for p in split):
            return ""
        return "production on the CPU" + (f", call boundaries on multiples of {SPLIT_ALIGN}" if split else "")

    def forward(self, calls: list[Call]) -> list[torch.Tensor]:
        """Each call continues its sequence at ``start`` (its position; a new sequence's first call at 0): one
        token after the sequence's first call is a decode step, more a prefill chunk. Checked before any runs."""
        seen = set()
        for call in calls:
            if call.seq in seen:
                raise DecoderError(f"{self.label}: sequence {call.seq} appears twice in one forward")
            seen.add(call.seq)
            have = self.seqs.get(call.seq)
            expected = have.session.pos if have is not None else 0
            if call.start != expected:
                where = "where it stands" if have is not None else "a new sequence starts at 0"
                raise DecoderError(f"{self.label}: sequence {call.seq}: call starts at {call.start}, expected "
                                   f"{expected} ({where})")
            if len(call.ids) == 0:
                raise DecoderError(f"{self.label}: sequence {call.seq}: a call with no tokens")
        if 0 in seen:
            self._eager0(GRAPHS_OFF_FORWARD)
        seqs = [self.seqs.setdefault(call.seq, Sequence(self.model.session())) for call in calls]
        if self.recorders is not None:
            for call, seq in zip(calls, seqs, strict=True):
                seq.session.rec = self.recorders.get(call.seq)
        ids = [torch.as_tensor(call.ids).long().flatten() for call in calls]
        if len(calls) == 1:
            out = [self._feed(calls[0].seq, seqs[0], ids[0])]
        else:
            self.used = True
            out = forward_batch([s.session for s in seqs], ids)
            for call, seq, t in zip(calls, seqs, ids, strict=True):
                self._consumed(call.seq, seq, t)
        if self.keep_snapshots:
            for seq in seqs:
                seq.snapshots[seq.session.pos] = self.snapshot(seq.session)
        return out

    def _feed(self, n: int, seq: Sequence, ids: torch.Tensor) -> torch.Tensor:
        """One call of sequence ``n``: a decode step for one token after the first call, else a prefill chunk."""
        self.used = True
        logits = seq.session.forward(ids)
        self._consumed(n, seq, ids)
        return logits

    def _consumed(self, n: int, seq: Sequence, ids: torch.Tensor) -> None:
        """Sequence ``n`` took ``ids`` in its last call: its token history (and sequence 0's prompt length)."""
        seq.tokens += ids.tolist()
        if n == 0 and (len(ids) > 1 or seq.session.pos == len(ids)):
            self.prompt_len += len(ids)

    def fork(self, seq: int, parent: int, pos: int) -> None:
        """Sequence ``seq`` (new) from ``parent``'s state after its first ``pos`` tokens."""
        src = self._sequence(parent, "fork from")
        if seq in self.seqs:
            raise DecoderError(f"{self.label}: cannot fork into sequence {seq}: it exists (reset drops it)")
        self._check_pos(parent, src, pos)
        child = Sequence(self.model.session())
        self.seqs[seq] = child
        self._restore(child, src, pos)

    def rollback(self, seq: int, pos: int) -> None:
        """Sequence ``seq`` back to position ``pos``; its snapshots past ``pos`` are dropped."""
        s = self._sequence(seq, "roll back")
        self._check_pos(seq, s, pos)
        if seq == 0:
            self._eager0(GRAPHS_OFF_FORWARD)
        if pos == s.session.pos:
            return
        s.snapshots = {p: snap for p, snap in s.snapshots.items() if p <= pos}
        self._restore(s, s, pos)

    def _sequence(self, n: int, what: str) -> Sequence:
        if n not in self.seqs:
            raise DecoderError(f"{self.label}: cannot {what} sequence {n}: no such sequence "
                               f"(have {', '.join(map(str, sorted(self.seqs)))})")
        return self.seqs[n]

    def _check_pos(self, n: int, s: Sequence, pos: int) -> None:
        if not 0 <= pos <= s.session.pos:
            raise DecoderError(f"{self.label}: sequence {n}: position {pos} is not in 0..{s.session.pos} (where it "
                               "stands)")

    def _restore(self, dst: Sequence, src: Sequence, pos: int) -> None:
        """``dst`` set to ``src``'s state at ``pos``: the last snapshot at or before ``pos`` (or the empty state),
        then ``src``'s tokens from there to ``pos`` replayed as one call (a decode step when it is one token after
        the first call)."""
        at = max((p for p in src.snapshots if p <= pos), default=0)
        snap = src.snapshots.get(at)
        session, tokens = dst.session, src.tokens[:pos]
        for i, cache in enumerate(session.layers):
            if cache is None:
                continue
            source = src.session.layers[i]
            if dst is not src:  # a new session: the entries and keys the state at ``at`` holds
                for (to, rows), (frm, _) in zip(_entries(cache, at), _entries(source, at), strict=True):
                    to[rows] = frm[rows]
            saved = snap.layers[i] if snap else None
            if dst is not src and on("fork-stale-ring"):  # the child attends the ring its new session has
                self.restore_carries(cache, saved)
            elif dst is not src and on("fork-drops-carry"):  # the child's compressors start empty
                self.restore_ring(cache, saved)
                self.restore_carries(cache, None)
            elif dst is src and on("rollback-partial-carry"):
                self.restore_ring(cache, saved)
                self.restore_carries(cache, saved, keep_current=True)
            else:
                self.restore_layer(cache, saved)
        session.pos, session.calls = at, snap.calls if snap else 0
        dst.tokens = tokens[:at]
        dst.snapshots = {p: s for p, s in src.snapshots.items() if p <= at}
        if pos > at:
            recorder, session.rec = session.rec, None  # a replay is not a call of the sequence: nothing recorded
            try:
                self._feed(-1, dst, torch.tensor(tokens[at:pos]))
            finally:
                session.rec = recorder
            if self.keep_snapshots:
                dst.snapshots[pos] = self.snapshot(session)

    def restore_layer(self, cache: LayerCache, saved: dict[str, torch.Tensor] | None) -> None:
        """One layer's window ring and carries from ``saved`` (None: the empty state)."""
        self.restore_ring(cache, saved)
        self.restore_carries(cache, saved)

    def restore_ring(self, cache: LayerCache, saved: dict[str, torch.Tensor] | None) -> None:
        (store,) = cache.kv.parts()
        store[cache.kv.physical(slice(0, cache.window))] = 0 if saved is None else saved["ring"]

    def restore_carries(self, cache: LayerCache, saved: dict[str, torch.Tensor] | None,
                        keep_current: bool = False) -> None:
        """The compressors' carries from ``saved`` (None: empty). ``keep_current`` (fault
        ``rollback-partial-carry``): an overlap carry gets back only its previous-block rows ``[:ratio]``; its
        current block stays as the calls since the snapshot left it."""
        for name, t in _carries(cache).items():
            if saved is None:
                t.fill_(float("-inf") if name.endswith(".score") else 0.0)
            elif keep_current and t.shape[0] == 2 * (ratio := 4 if name.startswith("index") else cache.ratio):
                t[:ratio].copy_(saved[name][:ratio])  # an overlap carry (CSA): [previous block | current block]
            else:
                t.copy_(saved[name])

    def snapshot(self, session: ProductionSession) -> Snapshot:
        """Copies of ``session``'s window rings and carries, its ``pos`` and ``calls``."""
        layers = [None if c is None else {"ring": _ring(c)[0].clone(), **{k: t.clone() for k, t in
                                                                         _carries(c).items()}}
                  for c in session.layers]
        return Snapshot(session.pos, session.calls, layers)

    def snapshot_bytes(self) -> int:
        """Bytes every sequence's snapshots hold."""
        kept = {id(s): s for seq in self.seqs.values() for s in seq.snapshots.values()}  # a fork shares them
        return sum(s.nbytes() for s in kept.values())

    # ---- one sequence ------------------------------------------------------------------------
    def sites(self) -> frozenset[str]:
        """The site templates this decoder records: :func:`recorded_sites` of its profile and config."""
        return recorded_sites(self.model.profile, self.config)

    def stop_set(self, reference: StopSet) -> StopSet:
        """The run's stop set (fault ``stop-missing-eot``: without the config's end-of-turn ids)."""
        if on("stop-missing-eot"):
            return StopSet.of(set(reference) - set(self.config.stop_token_ids))
        return reference

    def pick(self, sampler: Sampler, logits: torch.Tensor, history: torch.Tensor, step: int) -> int:
        """The run's sampler (fault ``rep-penalty-no-prompt``: the repetition penalty sees the generated ids only;
        ``rep-window-no-prompt``: so does a windowed penalty, whose window then never reaches back into the prompt)."""
        if on("rep-penalty-no-prompt") or (on("rep-window-no-prompt") and sampler.config.repetition_window):
            history = history[self.prompt_len :]
        return sampler.pick(logits, history, step)

    def cache_bytes(self) -> int:
        return self.session.cache_bytes()

    def info(self) -> dict:
        """Which implementation each op took, where a kernel fell back, the routes taken: this decoder's calls
        (sequence 0's session); whether its decode steps ran graph decode (:meth:`graph_info`); how several
        sequences run."""
        counts, taken = self.session.counts, self.session.counts.get("routes", {})
        return {
            "max_context": self.model.max_context,
            **self.graph_info(),
            "implementations": implementations_used(counts.get("implementations", {})),
            "kernel_fallbacks": counts.get("kernel_fallbacks", {}),
            "topk_routes": taken.get("topk", {}),
            "index_routes": taken.get("index_scores_fp4", {}),
            "attention_routes": {**taken.get("sparse_attention", {}),  # the packed FP8 rows' op as "fp8 KV <route>"
                                 **{f"fp8 KV {r}": n for r, n in taken.get("sparse_attention_fp8kv", {}).items()}},
            "multi_sequence": MULTI,
        }

    def graph_info(self) -> dict:
        """The manifest's graph decode fields: ``decode_graphs`` (sequence 0 runs graph decode), ``decode_graphs_off``
        (why not, else None), ``decode_graph_captured`` (its steps are CUDA-graph replays, not the same step run
        uncaptured), ``decode_graph_replays``, and ``decode_sites``: sequence 0's decode steps by where their
        sites came from ("graph outputs": a replay's; "eager": a step that ran, whether the first step before a
        capture, the fixed-shape step uncaptured, or the eager session's)."""
        session = self.session
        graph = isinstance(session, GraphDecodeSession)
        return {"decode_graphs": graph, "decode_graphs_off": self.graphs_off,
                "decode_graph_captured": graph and session.graphs,
                "decode_graph_replays": self.decode_sites["graph outputs"], "decode_sites": dict(self.decode_sites)}


INDEXER_SITES = frozenset(t for t in SITES if t.startswith("L{i}.indexer."))  # CSA layers only


def recorded_sites(profile: Profile, cfg: ModelConfig) -> frozenset[str]:
    """The site templates a production session records under ``profile`` on ``cfg``: every site, less the stored
    KV rows (``attn.kv_cache``) unless the profile stores them packed FP8 (``Attention.emit_kv_cache``), the
    indexer's without a CSA layer, the compressed entries without a compressed layer, and the gate's selection
    scores where every layer is hash-routed."""
    ratios = set(cfg.compress_ratios[: cfg.n_layers])
    left_out = set() if profile.kv_storage == "fp8" else {SITE.attn_kv_cache}
    if 4 not in ratios:
        left_out |= INDEXER_SITES
    if not ratios - {0}:
        left_out.add(SITE.attn_compressed_kv)
    if all(cfg.is_hash_layer(i) for i in range(cfg.n_layers)):
        left_out.add(SITE.moe_scores)
    return frozenset(SITES) - left_out


def _fault_reason(blocked: list[str]) -> str:
    return (f"fault {', '.join(blocked)} injected: a decode step that allocates what it keeps cannot run in a graph "
            "decode step")
