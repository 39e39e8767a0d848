"""Side-by-side runner: the production decoder next to the oracle over a prompt and N decode steps.

One production pass per step feeds three comparisons (docs/design.md "Three comparison modes"):
``free`` (the oracle runs its own model on the same tokens: inherited + local error), ``layer`` (each
oracle layer gets production's input to that layer and keeps its own exact caches: what the layer adds),
``op`` (oracle ops on production's exact op inputs and cache contents: the kernel alone).
The token stream is teacher-forced: both models see the same tokens (oracle greedy, production greedy,
a seeded sampler on the oracle's logits, or a given continuation).
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from fidelity._version import __version__
from fidelity.decoders import default_decoder
from fidelity.decoders.base import ContextError, Decoder, DecoderError, mode_support, raised
from fidelity.decoders.profiles import Profile
from fidelity.decoders.trace_file import TraceError, TraceWriter
from fidelity.harness.oracle_run import dtype_name
from fidelity.harness.site_pairs import (
    SAMPLED_LOGITS,
    SAMPLED_ROWS_ONLY,
    Margins,
    PairBatches,
    compare_recordings,
    decoder_rows,
)
from fidelity.harness.thresholds import ROUTING_GAP, ROUTING_GAP_LAYER, SELECTION_MARGIN, kv_scale_floor, profile_class
from fidelity.model.config import ModelConfig
from fidelity.model.sampling import Sampler, SamplerConfig, StopSet
from fidelity.model.sites import Recorder
from fidelity.model.weights import expected_tensors
from oracles import MODES, OracleModel, Reference
from oracles.stream import BLOCK_TOKENS, StreamCall, StreamReference
from probes import PeakMemory, collect_columns, memory_stats
from probes.memory import (
    WARMUP_DECODE_CALLS,
    allocator_counts,
    allocator_delta,
    collector_paused,
    handed_bytes,
    held_bytes,
)
from probes.repetition import repetition
from probes.rows import AGGREGATE
from probes.sampler import sampler_agreement

AUTO_WHOLE, AUTO_CHUNK = 8192, 8192  # prompts longer than AUTO_WHOLE are prefilled AUTO_CHUNK tokens at a time
PICK_FLIP_MARGIN = 1.0  # log-space gap of the oracle's winning draw; below it a differing pick is a near tie
STREAMS = ("oracle", "production", "given")


@dataclass
class RunSpec:
    """What to run. ``prompt`` [T] token ids; ``continuation`` only for ``stream == "given"``."""

    prompt: torch.Tensor
    decode_steps: int = 64
    profile: str | Profile = "reference"  # a name, a spec string, a .toml/.json path, or a Profile
    modes: tuple[str, ...] = MODES
    stream: str = "oracle"
    continuation: torch.Tensor | None = None
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    stop_ids: tuple[int, ...] | None = None  # None: the config's EOS + stop ids
    oracle_dtype: torch.dtype = torch.float32
    max_context: int | None = None
    sample_queries: int | None = None
    device: str = "cpu"
    oracle_device: str | None = None  # None: the decoder's device
    prefill_chunk: int | Sequence[int] | None = None  # tokens per prefill call; None: AUTO_CHUNK past AUTO_WHOLE
    tokenizer: str | None = None  # a tokenizer.json: the manifest then holds both continuations as text
    # free and layer modes layer by layer over a decoder's calls known in advance (a trace, a dump: ``recorded_calls``)
    # instead of call by call; None: where the oracle streams its weights (a model too large to hold whole)
    oracle_stream: bool | None = None
    # the oracle keeps one layer's weights at a time; None: where its fp32 weights exceed 16 GiB (KEEP_ALL_BYTES)
    oracle_one_layer: bool | None = None
    # decode calls judged together: the oracle's modes that do not pick the tokens run them as one causal pass
    # (``oracles.blocks``), their probes in one batch; 1: each call judged as it is made; None: BLOCK_TOKENS
    oracle_block: int | None = None

    def chunk_sizes(self) -> list[int]:
        """The prompt's prefill calls: the whole prompt, chunks of ``prefill_chunk`` (the last one shorter), or the
        sizes given; None: the whole prompt up to AUTO_WHOLE tokens, else chunks of AUTO_CHUNK."""
        n, chunk = len(self.prompt), self.prefill_chunk
        if chunk is not None and not isinstance(chunk, int):
            return [int(c) for c in chunk]
        size = chunk or (n if n <= AUTO_WHOLE else AUTO_CHUNK)
        return [size] * (n // size) + ([n % size] if n % size else [])

    def context(self) -> int:
        """The tokens a decoder must hold: ``max_context``, else the prompt and every decode step."""
        return self.max_context or len(self.prompt) + self.decode_steps

    def problems(self, vocab: int) -> list[str]:
        p = []
        if any(m not in MODES for m in self.modes) or not self.modes:
            p.append(f"mode: expected some of {MODES}, found {list(self.modes)}")
        if self.stream not in STREAMS:
            p.append(f"stream: expected one of {STREAMS}, found {self.stream!r}")
        if self.stream == "given" and (self.continuation is None or len(self.continuation) < self.decode_steps):
            p.append(f"continuation: stream 'given' needs >= {self.decode_steps} token ids")
        if self.decode_steps < 0:
            p.append(f"decode steps: expected >= 0, found {self.decode_steps}")
        if len(self.prompt) == 0:
            p.append("prompt: expected at least one token, found 0")
        elif int(self.prompt.min()) < 0 or int(self.prompt.max()) >= vocab:
            p.append(f"prompt: expected token ids in [0, {vocab}), found [{int(self.prompt.min())}, "
                     f"{int(self.prompt.max())}]")
        if self.oracle_block is not None and self.oracle_block < 1:
            p.append(f"oracle_block: expected >= 1 call, found {self.oracle_block}")
        if self.sample_queries is not None and "free" in self.modes:
            p.append("sample_queries: applies to layer and op modes only (free mode needs every position)")
        chunk = self.prefill_chunk
        if isinstance(chunk, int) and chunk < 1:
            p.append(f"prefill_chunk: expected >= 1 token, found {chunk}")
        elif chunk is not None and not isinstance(chunk, int) and (sum(chunk) != len(self.prompt) or min(chunk) < 1):
            p.append(f"prefill_chunk: expected sizes >= 1 adding up to the prompt's {len(self.prompt)} tokens, "
                     f"found {list(chunk)[:8]} (sum {sum(chunk)})")
        need = len(self.prompt) + self.decode_steps
        if self.max_context is not None and need > self.max_context:
            p.append(f"max_context: prompt {len(self.prompt)} + {self.decode_steps} decode steps = {need} tokens "
                     f"exceeds max_context {self.max_context}")
        return p


class DecoderRaised(Exception):
    """The decoder under test raised while it ran model call ``step`` (``phase``), after recording ``after`` (its
    last site of that call, if any)."""

    def __init__(self, step: int, phase: str, after: list[str], err: Exception):
        super().__init__(raised(err))
        self.step, self.phase, self.after, self.error = step, phase, after[0] if after else None, raised(err)

    def facts(self) -> dict:
        return {"step": self.step, "phase": self.phase, "after_site": self.after, "error": self.error}


# what a decoder raises when a run asks what it cannot do (a capability, a prompt past its context) or its input
# cannot be read (a trace's files, the file system): the user's to fix, so these stop the run as they are instead
# of ending it as a failure of the decoder
ASKED_TOO_MUCH = (DecoderError, ContextError, TraceError, OSError)


class RunError(ValueError):
    """A run that cannot start; the message lists every problem."""


def check_spec(checkpoint, spec: RunSpec, decoder: Decoder | None = None) -> None:
    """Raise RunError listing every problem of ``spec`` on ``checkpoint`` (and of ``decoder``'s config)."""
    problems = spec.problems(checkpoint.config.vocab_size)
    if decoder is not None and (diff := config_difference(decoder.config, checkpoint.config)):
        problems.append(f"{decoder.label}: its config differs from the checkpoint's ({diff})")
    if problems:
        raise RunError("run: " + "; ".join(problems))


def sampled_rows(n: int, k: int | None, seed: int = 0) -> torch.Tensor | None:
    """A deterministic subset of k query rows of a prefill (always including the last), or None for all."""
    if k is None or k >= n:
        return None
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n - 1, generator=gen)[: k - 1]
    return torch.cat((rows, torch.tensor([n - 1]))).sort().values


class Runner:
    """Holds the decoder under test and the oracle sessions of one run; ``run()`` returns the metric table and
    the manifest."""

    def __init__(self, checkpoint, spec: RunSpec, progress: Callable[..., None] | None = None,
                 decoder: Decoder | None = None, trace: TraceWriter | None = None, dump=None):
        """``decoder``: the decoder under test (default: ``fidelity.decoders.default_decoder`` with ``spec``'s
        profile, device and max_context). ``progress(phase, done, total, note)`` is told of each prefill pass and
        decode step (``fidelity.progress.Progress`` draws it); ``trace`` records every decoder call
        (``fidelity.decoders.trace_file``); ``dump`` (a ``DumpWriter``) writes the decoder's and the free-mode
        oracle's sites of every call in SGLang's dumper layout."""
        check_spec(checkpoint, spec, decoder)
        cfg = checkpoint.config
        self.ckpt, self.cfg, self.spec, self.progress, self.trace = checkpoint, cfg, spec, progress, trace
        self.dump = dump
        self.dec = decoder or default_decoder(checkpoint, spec.profile, spec.context(), spec.device)
        self.modes, self.skipped = mode_support(self.dec, spec.modes)
        if not self.modes:
            raise RunError("run: no requested mode can run: " + "; ".join(f"{m}: {why}" for m, why in
                                                                          self.skipped.items()))
        # selections the decoder does not report (a CSA layer's top-k, the experts): the margins at which the
        # oracle's own counts as the decoder's, per mode (none for a quantized indexer: judged against a floor)
        klass = profile_class(self.dec.profile)
        self.margins = {"layer": Margins(SELECTION_MARGIN.get(klass), ROUTING_GAP_LAYER[klass]),
                        "op": Margins(routing=ROUTING_GAP[klass]), "free": Margins()}
        self.kv_scale_floor = kv_scale_floor(self.dec.profile)  # the FP8 scale rule its stored KV rows are held to
        self.oracle_numerics = exact_float32()
        self.oracle = OracleModel(checkpoint, spec.oracle_dtype, device=spec.oracle_device or spec.device,
                                  stream_layers=spec.oracle_one_layer)
        self.references = {m: Reference(self.oracle, m) for m in MODES if m in self.modes}  # free, layer, op
        known = getattr(self.dec, "recorded_calls", None)
        self.oracle_stream = known is not None and (spec.oracle_stream if spec.oracle_stream is not None
                                                    else self.oracle.stream_layers)
        if self.oracle_stream:  # each layer's weights read once per mode, whatever the number of calls
            for m in ("free", "layer"):
                if m in self.references:
                    self.references[m] = StreamReference(self.oracle, m, lambda m=m: self.stream_calls(m),
                                                         spec.oracle_block or BLOCK_TOKENS)
        self.sampler = Sampler(spec.sampler)  # the oracle side's sampler
        self.prod_sampler = Sampler(spec.sampler)  # the state of the decoder's picks (``Decoder.pick`` uses it)
        self.stops = StopSet.of(spec.stop_ids) if spec.stop_ids is not None else StopSet.from_config(cfg)
        self.prod_stops = self.dec.stop_set(self.stops)  # an engine's own stop ids, else the run's
        self.run_mode = "free" if "free" in self.modes else self.modes[0]  # label of whole-run rows
        self.frames: list[pd.DataFrame] = []  # one small table per call: compact, unlike a list of row dicts
        self.run_rows: list[dict] = []  # pending rows of the run's own (``_run_rows``): a few per call
        self.n_prefill = 1  # prefill calls (chunks), set by run()
        self.tokens: list[int] = []
        self.picks: dict[str, list[int]] = {"oracle": [], "decoder": []}  # each model's pick at each step
        self.cache_bytes0: int | None = None
        self.decoder_memory: dict[str, int] = {}  # allocator activity during the last decoder call
        self.growth = {"reserved": 0, "retained": 0, "host_retained": 0}  # decode calls since the warm-up
        self.held0: int | None = None  # bytes the decoder held after its last warm-up call
        self.seconds: dict[str, float] = {}
        self.devices = run_devices(spec.device, self.oracle.device)  # synchronized around each timed part
        # decode calls wait in ``queue`` and are judged ``block`` at a time (``flush``), but for the modes in ``now``:
        # free mode when the oracle's picks are the stream. A dump writes the oracle's calls in turn with the
        # decoder's, so it judges each call as it is made.
        self.now = {"free"} & set(self.references) if spec.stream == "oracle" else set()
        self.block = 1 if dump is not None else spec.oracle_block or BLOCK_TOKENS
        self.queue: list[QueuedCall] = []
        self.deferred_picks: dict[int, tuple[int, torch.Tensor, torch.Tensor, int]] = {}

    def run(self) -> tuple[pd.DataFrame, dict]:
        """Every model call in every mode -> (metric rows, manifest). A decoder that raises while it runs a call
        ends the run there: the calls before it keep their rows, the call adds the failing ``decoder`` /
        ``raised`` row, and the manifest's ``decoder_raised`` says what it raised, at which call and after which
        site (``stop_reason`` "decoder raised")."""
        t0 = time.perf_counter()
        prompt = self.spec.prompt.long()
        history, chunks = prompt.tolist(), prompt.split(self.spec.chunk_sizes())
        self.n_prefill = len(chunks)
        peaks = PeakMemory(self.spec.device)
        memory, stop_reason, ended = {}, "length", None
        try:
            logits = {}
            for call, chunk in enumerate(chunks):
                logits = self.step(call, chunk)
            memory["prefill"] = peaks.read()
            for k in range(self.spec.decode_steps):
                call = self.n_prefill - 1 + k  # the call whose logits pick decode token k
                nxt = self.next_token(call, k, logits, history)
                self.tokens.append(nxt)
                history.append(nxt)
                self._tell("decode", k + 1, self.spec.decode_steps)
                self.record_stop(call, nxt)
                if nxt in self.prod_stops:
                    stop_reason = "stop"
                    break
                logits = self.step(call + 1, torch.tensor([nxt]))
        except DecoderRaised as err:
            stop_reason, ended = "decoder raised", err
            self.flush()
            self._run_rows("decoder", {"raised": torch.tensor(1.0)}, err.step)
        self.flush()
        memory["decode"] = peaks.read()
        self.record_repetition()
        self.frames.append(pd.DataFrame(collect_columns(self.run_rows)))
        df = pd.concat(self.frames, ignore_index=True)
        manifest = self.manifest(time.perf_counter() - t0, stop_reason)
        if ended is not None:
            manifest["decoder_raised"] = ended.facts()
        manifest["memory_peaks"] = memory
        manifest["picks"] = self.picks
        if self.spec.tokenizer is not None and self.picks["oracle"]:
            from fidelity.model import text

            manifest["texts"] = text.continuations(text.load(self.spec.tokenizer), prompt.tolist(),
                                                   self.picks["oracle"], self.picks["decoder"])
        if self.trace is not None:
            self.trace.finish(manifest["checkpoint"])
        if self.dump is not None:
            self.dump.finish()
        return df, manifest

    @contextmanager
    def _timed(self, phase: str, part: str) -> Iterator[None]:
        """Adds the wall time of the block to ``seconds["<phase> <part>"]`` (reported in the manifest). The run's
        CUDA devices are synchronized at both ends, so the GPU work a part queued is timed in that part, not in the
        next one's first host read."""
        sync_devices(self.devices)
        t0 = time.perf_counter()
        yield
        sync_devices(self.devices)
        key = f"{phase} {part}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def _tell(self, phase: str, done: int, total: int, note: str = "") -> None:
        if self.progress is not None:
            self.progress(phase, done, total, note)

    def step(self, step: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """One model call (a prefill chunk or a decode token) in every mode; appends its metric rows. Returns the
        last position's logits per model."""
        prefill = step < self.n_prefill
        passes = 1 + len(self.references)

        def tell(done: int, note: str) -> None:
            if not prefill:
                return
            if self.n_prefill == 1:
                self._tell(f"prefill ({len(ids)} tokens)", done, passes, note)
            elif done == passes:
                self._tell(f"prefill ({len(self.spec.prompt)} tokens in {self.n_prefill} chunks)", step + 1,
                           self.n_prefill)

        phase = "prefill" if prefill else "decode"
        positions = torch.arange(self.dec.pos, self.dec.pos + len(ids))
        rows = self.rows_of(positions) if prefill else None
        # records stay where the decoder made them (a GPU's memory); with sampled query rows and no trace written,
        # the sites only compared keep just those rows (a long prompt's index scores: GiBs a chunk)
        writes = self.trace is not None or self.dump is not None  # every row of every site is written
        thin = rows is not None and not writes
        # without free mode (which compares every row) the logits too are compared at the sampled rows alone; with no
        # trace written only the last row of what the call returns is read: the decoder may compute just those rows
        only = SAMPLED_ROWS_ONLY | (SAMPLED_LOGITS if "free" not in self.references else frozenset())
        prod_rec = Recorder(device=None, rows=rows if thin else None, rows_only=only)
        self.dec.rec = prod_rec
        tell(0, "decoder under test")
        with self._timed(phase, "decoder"), collector_paused():
            before = allocator_counts(self.spec.device)
            self.dec.last_logits_only = not writes  # for this call only: a user's later prefill gets every row
            try:
                test_logits = self.dec.prefill(ids) if prefill else self.dec.step(int(ids[0]))[None]
            except ASKED_TOO_MUCH:
                raise
            except Exception as err:  # the decoder's own failure: the run ends here, judged up to this call
                raise DecoderRaised(step, phase, list(prod_rec.records)[-1:], err) from err
            finally:
                self.dec.last_logits_only = False
            after = allocator_counts(self.spec.device)
        with self._timed(phase, "probes"):
            handed = handed_bytes([test_logits, *(t for r in prod_rec.records.values() for _, t in r)])
            self.decoder_memory = allocator_delta(before, after, handed)
            self.decoder_memory["held_bytes"] = held_bytes(self.dec, exclude=(prod_rec,))  # not what it handed
        if self.trace is not None:
            self.trace.add_step(ids, positions, test_logits, prod_rec)
        if self.dump is not None:
            self.dump.add_call("decoder", step, ids, positions, test_logits, prod_rec)
        out = {"production": test_logits[-1]}
        if not prefill or (rows is None and len(ids) <= self.block):  # a decode call, or a short prefill chunk
            out = self.queue_call(QueuedCall(step, ids, positions, prod_rec, phase), out)
            tell(passes, "compared")
            return out
        self.flush()  # the queued chunks first: each oracle session takes its calls in order
        pending: dict[str, list[dict]] = {}
        for mode, reference in self.references.items():
            tell(len(pending) + 1, f"oracle, {mode} mode")
            sampled = None if mode == "free" else rows  # free mode runs every row
            with self._timed(phase, f"oracle {mode}"):
                rec = reference.run(ids, prod_rec, sampled)
            if mode == "free":
                out["oracle"] = rec.get("logits")[-1]
                self._dump_oracle(step, ids, positions, rec)
            with self._timed(phase, "probes"):
                pending[mode] = compare_recordings(rec, prod_rec, positions, self.cfg, sampled, prefill,
                                                   self.margins[mode], self.kv_scale_floor)
        tell(passes, "compared")
        with self._timed(phase, "probes"):
            for mode, rows_ in pending.items():
                self.frames.append(pd.DataFrame(collect_columns(rows_, step=step, phase=phase, mode=mode)))
        self.record_memory(step, phase)
        return out

    def queue_call(self, call: QueuedCall, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A decode call or a prefill chunk of every row and at most ``block`` tokens made: its decoder memory
        recorded, for a decode call the modes in ``now`` run (free mode's logits pick the next token), the rest
        queued. The queue is judged once it holds ``block`` tokens, and after the last prefill chunk (whose logits
        pick the first decode token)."""
        self.record_memory(call.step, call.phase)
        for mode in self.now if call.phase == "decode" else ():
            with self._timed("decode", f"oracle {mode}"):
                call.recs[mode] = self.references[mode].run(call.ids, call.feed)
            self._dump_oracle(call.step, call.ids, call.positions, call.recs[mode])
        self.queue.append(call)
        if sum(len(c.ids) for c in self.queue) >= self.block or call.step == self.n_prefill - 1:
            self.flush()
        if "free" in call.recs:  # judged already: the oracle's logits join the decoder's for the next pick
            out["oracle"] = call.recs["free"].get("logits")[-1]
        return out

    def flush(self) -> None:
        """Judges the queued calls (of one phase): each mode not run yet runs them in blocks
        (``Reference.run_calls``), then every call's pairs of every mode are compared in one set of batches (a
        prefill chunk's also per position, as ``step`` compares a long chunk) and moved to the host at once."""
        queue, self.queue = self.queue, []
        if not queue:
            return
        phase = queue[0].phase
        for mode, reference in self.references.items():
            if all(mode in c.recs for c in queue):
                continue
            with self._timed(phase, f"oracle {mode}"):
                recs = reference.run_calls([StreamCall(c.ids, c.feed) for c in queue], self.block)
            for c, rec in zip(queue, recs, strict=True):
                c.recs[mode] = rec
                if mode == "free":
                    self._dump_oracle(c.step, c.ids, c.positions, rec)
        with self._timed(phase, "probes"):
            batches, pending = PairBatches(), []
            for c in queue:
                own = decoder_rows(c.feed, self.cfg, self.kv_scale_floor)  # the same in every mode
                for mode, rec in c.recs.items():
                    tags = {"step": c.step, "phase": c.phase, "mode": mode}
                    pending += compare_recordings(rec, c.feed, c.positions, self.cfg, None, c.phase == "prefill",
                                                  self.margins[mode], self.kv_scale_floor, batches, tags, own)
                if c.step in self.deferred_picks:
                    self._oracle_pick(c.step, c.recs["free"].get("logits")[-1], *self.deferred_picks.pop(c.step))
            self.frames.append(pd.DataFrame(collect_columns(pending + batches.rows())))

    def _dump_oracle(self, step: int, ids: torch.Tensor, positions: torch.Tensor, rec: Recorder) -> None:
        if self.dump is not None:
            self.dump.add_call("oracle", step, ids, positions, rec.get("logits"), rec)

    def _run_rows(self, site: str, metrics: dict, step: int) -> None:
        """The run's own rows of call ``step`` (sampler, stops, memory, ...): collected once, when the run ends."""
        tags = {"step": step, "phase": self._phase(step), "mode": self.run_mode}
        self.run_rows += [{"site": site, "layer": -1, "position": None, "metric": k, "value": v, "extra": tags}
                          for k, v in metrics.items()]

    def _phase(self, step: int) -> str:
        return "prefill" if step < self.n_prefill else "decode"

    def record_memory(self, step: int, phase: str) -> None:
        """Allocator / RSS bytes, what the decoder's own call did to the allocator and what it holds
        (``probes.memory``), and the decoder's cache bytes (when it reports them). Decode calls after the first
        ``WARMUP_DECODE_CALLS`` add the gated ``held_growth`` (tensor bytes the decoder holds beyond those after
        the warm-up), on CUDA the sums ``retained_growth`` / ``reserved_growth`` and each call's
        ``new_device_mallocs``; on the CPU the informational ``host_retained_growth``. cache_growth > 0 = the
        caches grew."""
        metrics = dict(memory_stats(self.spec.device))
        metrics.update({k: torch.tensor(float(v)) for k, v in self.decoder_memory.items()})
        decode_call = step - self.n_prefill
        if decode_call == WARMUP_DECODE_CALLS - 1:
            self.held0 = self.decoder_memory["held_bytes"]
        if decode_call >= WARMUP_DECODE_CALLS:
            metrics["held_growth"] = torch.tensor(float(self.decoder_memory["held_bytes"] - self.held0))
            for kind in self.growth:
                if f"{kind}_delta" in self.decoder_memory:
                    self.growth[kind] += self.decoder_memory[f"{kind}_delta"]
                    metrics[f"{kind}_growth"] = torch.tensor(float(self.growth[kind]))
            if "device_mallocs" in self.decoder_memory:
                metrics["new_device_mallocs"] = torch.tensor(float(self.decoder_memory["device_mallocs"]))
        cache = self.dec.cache_bytes()
        if cache is not None:
            if self.cache_bytes0 is None:
                self.cache_bytes0 = cache
            metrics.update(cache_bytes=torch.tensor(float(cache)), cache_growth=torch.tensor(float(cache -
                                                                                              self.cache_bytes0)))
        self._run_rows("memory", metrics, step)

    def record_repetition(self) -> None:
        """The stream's decode tokens: ``ngram_seen`` at each decode step's call, and the run's repeat rate, loop
        onset (decode step, -1 none), loop period and longest repeated span at the last call."""
        if not self.tokens:
            return
        rep = repetition(self.tokens)
        steps = [self.n_prefill - 1 + k for k in range(len(self.tokens))]  # the call that picked decode token k
        self.frames.append(pd.DataFrame({
            "site": "repetition", "layer": -1, "metric": "ngram_seen", "step": steps,
            "phase": [self._phase(s) for s in steps], "mode": self.run_mode, "position": AGGREGATE,
            "value": rep.pop("ngram_seen").astype(float)}))
        self._run_rows("repetition", {k: torch.tensor(float(v)) for k, v in rep.items()},
                       self.n_prefill - 1 + len(self.tokens) - 1)

    def record_stop(self, step: int, token: int) -> None:
        """stop_mismatch = 1 when the reference stop set and the decoder's disagree on this token."""
        mismatch = (token in self.stops) != (token in self.prod_stops)
        self._run_rows("stops", {"stop_mismatch": torch.tensor(float(mismatch))}, step)

    def stream_calls(self, mode: str) -> list[StreamCall]:
        """The decoder's calls known in advance, as the stream oracle reads them: tokens, the decoder's records
        (layer mode's inputs) and a prefill call's sampled rows (layer mode)."""
        calls, start, n_prefill = [], 0, len(self.spec.chunk_sizes())
        for k, (ids, feed) in enumerate(self.dec.recorded_calls()):
            positions = torch.arange(start, start + len(ids))
            rows = self.rows_of(positions) if mode == "layer" and k < n_prefill else None
            calls.append(StreamCall(ids, feed if mode == "layer" else None, rows))
            start += len(ids)
        return calls

    def rows_of(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The sampled query rows of a prefill chunk at ``positions`` (None: every row): the prompt's sampled
        positions (``sample_queries``, always including the last) that fall in the chunk."""
        picked = sampled_rows(len(self.spec.prompt), self.spec.sample_queries)
        if picked is None:
            return None
        start = int(positions[0])
        inside = picked[(picked >= start) & (picked < start + len(positions))] - start
        last = torch.tensor([len(positions) - 1])  # every chunk keeps a query: its last
        return torch.cat((inside, last)).unique()

    def next_token(self, step: int, k: int, logits: dict[str, torch.Tensor], history: list[int]) -> int:
        """Decode token k, picked from the logits of call ``step``; records whether the oracle's and the decoder's
        samplers agree."""
        hist = torch.tensor(history)
        prod_pick = self.dec.pick(self.prod_sampler, logits["production"].float(), hist, k)
        ref_pick = self.sampler.pick(logits["oracle"].float(), hist, k) if "oracle" in logits else None
        if self.spec.stream == "given":
            nxt = int(self.spec.continuation[k])
        else:
            nxt = ref_pick if self.spec.stream == "oracle" and ref_pick is not None else prod_pick
        # the reference sampler on the decoder's own logits: any difference is the decoder's sampler
        impl = torch.tensor(float(self.sampler.pick(logits["production"].float(), hist, k) != prod_pick))
        self._run_rows("sampler", {"sampler_impl_mismatch": impl}, step)
        self.picks["decoder"].append(int(prod_pick))
        if ref_pick is not None:
            self._oracle_pick(step, logits["oracle"], k, hist, logits["production"], prod_pick, ref_pick)
        elif "free" in self.references:  # free mode's logits of this call come when the queue is judged
            self.deferred_picks[step] = (k, hist, logits["production"], prod_pick)
        return nxt

    def _oracle_pick(self, step: int, oracle: torch.Tensor, k: int, hist: torch.Tensor, production: torch.Tensor,
                     prod_pick: int, ref_pick: int | None = None) -> None:
        """The oracle's pick of decode token k (``ref_pick``, else drawn here) from its logits of call ``step``, and
        how it agrees with the decoder's."""
        ref_pick = self.sampler.pick(oracle.float(), hist, k) if ref_pick is None else ref_pick
        margin = sampler_agreement(oracle.float(), production.float(), hist, self.spec.sampler, k)["pick_margin"]
        differ = torch.tensor(float(ref_pick != prod_pick))
        self._run_rows("sampler", {"same_pick": 1 - differ, "pick_margin": margin,
                                   "pick_flip_with_margin": differ * (margin > PICK_FLIP_MARGIN)}, step)
        self.picks["oracle"].append(int(ref_pick))

    def manifest(self, seconds: float, stop_reason: str) -> dict:
        s = self.spec
        return {
            "package": f"dsv4-fidelity {__version__}",
            "config": self.cfg.to_official_dict(),
            "checkpoint": checkpoint_info(self.ckpt),
            "decoder": self.dec.label,
            "profile": self.dec.profile,
            "modes": list(self.modes),
            "modes_skipped": self.skipped,
            "stream": s.stream,
            "sampler": vars(s.sampler),
            "prompt_len": len(s.prompt),
            "decode_steps": len(self.tokens),
            "stop_reason": stop_reason,
            "generated": self.tokens,
            "oracle_dtype": dtype_name(s.oracle_dtype),
            "oracle_device": str(self.oracle.device),
            "oracle_weights": self.oracle.weight_policy,
            "oracle_order": "layer by layer over the decoder's known calls" if self.oracle_stream else "call by call",
            "oracle_block": self.block,
            "oracle_numerics": self.oracle_numerics,
            "sample_queries": s.sample_queries,
            "cache_bytes": self.dec.cache_bytes(),
            **self.dec.info(),
            "command": " ".join(sys.argv),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "device": _device_name(s.device),
            "git_revision": _git_revision(),
            "seconds": round(seconds, 3),
            "seconds_by_part": {k: round(v, 3) for k, v in self.seconds.items()},
            "threads": torch.get_num_threads(),
        }


@dataclass
class QueuedCall:
    """A call made and not judged yet: its tokens, positions, the decoder's records, its phase ("decode", or
    "prefill" for a short chunk of every row) and the oracle's records of each mode run so far."""

    step: int
    ids: torch.Tensor
    positions: torch.Tensor
    feed: Recorder
    phase: str = "decode"
    recs: dict[str, Recorder] = field(default_factory=dict)


def run_devices(*devices: str | torch.device) -> tuple[torch.device, ...]:
    """The distinct CUDA devices among ``devices`` (the decoder's and the oracle's); none on the CPU."""
    found = {torch.device(d) for d in devices}
    cuda = {torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
            for d in found if d.type == "cuda"}
    return tuple(sorted(cuda, key=lambda d: d.index))


def sync_devices(devices: Sequence[torch.device]) -> None:
    """Waits for the work queued on each of ``devices``."""
    for d in devices:
        torch.cuda.synchronize(d)


def exact_float32() -> dict[str, bool]:
    """Switch off TF32 and the reduced-precision reductions of fp16/bf16 GEMMs (process-wide, for the oracle's
    fp32 on a GPU); returns the settings as checked afterwards, for the manifest."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


# config fields that do not change what a decoder computes (storage formats, generation limits, token ids)
NOT_ARCHITECTURE = frozenset({"max_seq_len", "max_batch_size", "dtype", "scale_fmt", "scale_dtype", "expert_dtype",
                              "n_mtp_layers", "stop_token_ids", "bos_token_id", "eos_token_id"})


def config_difference(a: ModelConfig, b: ModelConfig) -> str:
    """The architecture fields where two configs differ, 'name: a vs b' ('' when none)."""
    da, db = a.to_official_dict(), b.to_official_dict()
    return ", ".join(f"{k}: {da[k]!r} vs {db.get(k)!r}" for k in da if k not in NOT_ARCHITECTURE and da[k] != db.get(k))


FULL_HASH_BYTES = 2 << 30  # checkpoints up to this size are hashed over every stored byte
_FMT_BYTES = {"fp4": 0.5, "fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int64": 8, "fp64": 8}


def checkpoint_info(ckpt) -> dict:
    """What the manifest says of the checkpoint: layout, path or synthetic origin (seed, preset), and a content
    hash: sha256 over the config and every stored tensor's name, format, shape and bytes (codes and scales), or,
    above FULL_HASH_BYTES, over the bytes of the tensors up to 65536 elements only (``hash_scope`` says which)."""
    info = {"layout": ckpt.layout, "path": str(ckpt.path or ""), **ckpt.origin}
    specs = expected_tensors(ckpt.config)
    size = sum(_FMT_BYTES.get(specs[n].fmt, 4) * torch.Size(specs[n].shape).numel() for n in ckpt.names() if n in specs)
    full = size <= FULL_HASH_BYTES
    h = hashlib.sha256(json.dumps(ckpt.config.to_official_dict(), sort_keys=True).encode())
    for name in ckpt.names():
        st = ckpt.stored(name)
        h.update(f"{name}{st.fmt}{tuple(st.data.shape)}".encode())
        for t in (st.data, st.scale):
            if t is not None and (full or t.numel() <= 65536):
                h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    scope = "every tensor's bytes" if full else "names, shapes, bytes of tensors <= 65536 elements"
    return {**info, "hash": h.hexdigest()[:16], "hash_scope": scope}


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def _git_revision() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
