"""Scenarios: named sets of runs aimed at one port-bug mechanism each (``fidelity scenarios``, docs/scenarios.md).

A scenario is data, like a profile: a name, the mechanism it targets, its runs (prompt length, prefill chunk
sizes, decode steps, the parameter it varies) and the self-consistency pairs it checks. Each scenario is judged
twice:

- against the oracle: every run through ``fidelity.run`` (the usual verdict and first divergence);
- against the decoder itself (no oracle): every run again on a fresh decoder, fed one fixed token sequence (the
  default prompt's ids: prompt ``ids[:n]``, decode tokens ``ids[n:]``), so that two runs give logits for the same
  positions after the same tokens. A pair compares them: ``chunked==whole`` (a chunked prefill vs the whole
  prefill of the same prompt), ``prefix`` (a prompt's first-call rows vs a longer prompt's prefill rows),
  ``decode==prefill`` (the decode steps after prompt n vs the longer prompt's prefill rows at those positions).
  Where the decoder promises equal bits (the production decoder on the CPU, chunk boundaries on multiples of 128)
  the pair must be bitwise equal; elsewhere it is gated by bounds on the logits' difference (``COS_MIN``,
  ``REL_L2_MAX``; the clean decoder's values are in docs/scenarios.md).

Scenarios over several sequences (``batch``, ``prefix``, ``verify``) need decoder capabilities (``Decoder.
capabilities``: batch, fork, rollback); a decoder without one has the scenario skipped with its reason (listed as
skipped, not passed). Their self-consistency plays :class:`Script` s (forward calls, forks, proposals rolled back)
and compares one script's sequence with another's at the positions both have (:class:`Check`).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fidelity.api import CheckpointPlan, InputError, open_decoder, run, warn
from fidelity.atomic_write import write_dir_atomic
from fidelity.decoders.base import Call, ContextError, Decoder, DecoderError, raised
from fidelity.decoders.faults import active, inject
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import TraceWriter, read_trace
from fidelity.harness.runner import RunError
from fidelity.harness.thresholds import Divergence, site_order_key
from fidelity.model.checkpoint import CheckpointError
from fidelity.model.sites import Recorder
from fidelity.outputs.plots import DPI, FLOOR
from fidelity.outputs.report import Section, raised_in_call, render_html, render_markdown
from fidelity.outputs.rundir import RunDirError, check_output, new_run_id

# the gate of a pair whose bits may differ: the smallest cosine of two logits rows at one position and the mean
# over positions of |a - b| / |a| (L2 per row). The clean production decoder (reference profile, trained default,
# CPU) stays at cos >= 0.969 and rel_l2 <= 0.032 (docs/scenarios.md); a chunk's positions restarted at 0 gives
# cos 0.55-0.90, rel_l2 0.04-0.28.
COS_MIN = 0.95
REL_L2_MAX = 0.04
ALIGN = 128  # the production decoder's chunked prefill gives the whole prefill's bits on these boundaries (CPU)


@dataclass(frozen=True)
class Run:
    """One run: ``prompt_len`` tokens of the default prompt, prefilled whole or in ``chunks``, then
    ``decode_steps``; ``param`` is what the scenario varies (name, value), a column of the matrix."""

    label: str
    prompt_len: int
    decode_steps: int = 4
    chunks: tuple[int, ...] | None = None
    param: tuple[str, int] = ("prompt_len", 0)
    stream: tuple[tuple[int, int], ...] = ()  # its tokens: (offset, length) segments of the default prompt's ids

    def prompt(self, ids: torch.Tensor) -> torch.Tensor:
        return tokens(ids, self.stream)[: self.prompt_len] if self.stream else ids[: self.prompt_len]

    @property
    def positions(self) -> int:
        return self.prompt_len + self.decode_steps

    def boundaries(self) -> list[int]:
        """Positions where a prefill chunk starts (after the first)."""
        sizes = self.chunks or (self.prompt_len,)
        return [sum(sizes[:k]) for k in range(1, len(sizes))]


@dataclass(frozen=True)
class Pair:
    """A self-consistency check: run ``b``'s logits at ``kind``'s positions equal run ``a``'s."""

    kind: str  # chunked==whole | prefix | decode==prefill
    a: str
    b: str


def tokens(ids: torch.Tensor, stream: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """A token stream: its (offset, length) segments of ``ids`` one after another."""
    return torch.cat([ids[o : o + n] for o, n in stream])


@dataclass(frozen=True)
class Feed:
    """One ``forward``: each (seq, n) feeds sequence seq its next n stream tokens (one token after the first call:
    a decode step)."""

    calls: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Fork:
    """``fork(seq, parent, pos)``: seq's stream starts with the parent's first pos tokens."""

    seq: int
    parent: int
    pos: int


@dataclass(frozen=True)
class Propose:
    """MTP verification on ``seq``: ``n`` tokens in one call, the first ``accept`` its own next stream tokens, the
    others drafts that differ (stream token + 1); their logits are dropped and the sequence rolled back to
    ``pos + accept``. A script that never proposed feeds the accepted tokens as one call instead."""

    seq: int
    n: int
    accept: int


@dataclass(frozen=True)
class Script:
    """Sequences' token streams (seq, segments) and what is done with them, on a fresh decoder."""

    label: str
    streams: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    ops: tuple[Feed | Fork | Propose, ...]

    @property
    def positions(self) -> int:
        return max(sum(n for _, n in segs) for _, segs in self.streams)

    def never_proposed(self, label: str) -> Script:
        """This script with every proposal replaced by a call of its accepted tokens (none if it accepts none)."""
        ops = tuple(Feed(((op.seq, op.accept),)) if isinstance(op, Propose) else op
                    for op in self.ops if not (isinstance(op, Propose) and op.accept == 0))
        return Script(label, self.streams, ops)


@dataclass(frozen=True)
class Check:
    """A multi-sequence self-consistency pair: sequence ``b[1]`` of script ``b[0]`` against sequence ``a[1]`` of
    script ``a[0]`` at the positions both computed; ``bitwise``: why equal bits are promised (production decoder
    on the CPU), '' for the bounds."""

    kind: str
    a: tuple[str, int]
    b: tuple[str, int]
    bitwise: str = ""


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str  # the port-bug mechanism it targets
    runs: tuple[Run, ...]
    pairs: tuple[Pair, ...] = ()
    needs: tuple[str, ...] = ()  # decoder capabilities (fidelity.decoders.base.CAPABILITIES)
    scripts: tuple[Script, ...] = ()
    checks: tuple[Check, ...] = ()

    @property
    def judged(self) -> tuple[str, ...]:
        """The scripts judged against the oracle as played (each sequence on its own timeline): those the checks
        exercise (their ``b`` side)."""
        return tuple(dict.fromkeys(c.b[0] for c in self.checks))

    def checks_of(self, label: str) -> list[tuple[str, int]]:
        """The (script, sequence) sides ``b`` of the checks on script ``label``."""
        return [c.b for c in self.checks if c.b[0] == label]

    def script(self, label: str) -> Script:
        return next(s for s in self.scripts if s.label == label)

    def run(self, label: str) -> Run:
        return next(r for r in self.runs if r.label == label)


def _lengths() -> Scenario:
    lengths = (125, 126, 127, 128, 129, 130, 255, 256, 257)  # every residue mod 4, the window and HCA edges
    runs = tuple(Run(f"prompt {n}", n, 4, param=("prompt_len", n)) for n in lengths)
    ref = Run("prompt 264", 264, 4, param=("prompt_len", 264))  # holds every other run's positions in its prefill
    pairs = tuple(Pair(kind, ref.label, r.label) for r in runs for kind in ("prefix", "decode==prefill"))
    return Scenario("lengths", "prompt lengths at every residue mod 4 (CSA block) and at the window (127/128/129) and "
                    "HCA (255/256/257) edges: off-by-one windows, partial compressor blocks, the carry a prefill "
                    "leaves for decode", (*runs, ref), pairs)


def _chunks() -> Scenario:
    n = 300
    whole = Run("whole", n, 4, param=("chunk", n))
    runs = [Run(f"chunk {c}", n, 4, tuple([c] * (n // c) + ([n % c] if n % c else [])), ("chunk", c))
            for c in (5, 6, 7, 63, 130, 128)]
    runs.append(Run("chunks 5,6,7,63,130,89", n, 4, (5, 6, 7, 63, 130, 89), ("chunk", 0)))
    return Scenario("chunks", "chunked prefill with boundaries at every residue mod 4 and 128 and chunks shorter than "
                    "the window: the compressors' carry across calls, the window ring read across chunks, each "
                    "chunk's positions", (whole, *runs), tuple(Pair("chunked==whole", whole.label, r.label)
                                                               for r in runs))


def _decode_boundaries() -> Scenario:
    runs = (Run("prompt 250, 10 steps", 250, 10, param=("prompt_len", 250)),  # closes a CSA block at 251, HCA at 255
            Run("prompt 125, 6 steps", 125, 6, param=("prompt_len", 125)))  # the window edge 127/128 in decode
    ref = Run("prompt 261", 261, 2, param=("prompt_len", 261))
    pairs = tuple(Pair("decode==prefill", ref.label, r.label) for r in runs)
    return Scenario("decode-boundaries", "decode steps that close CSA (4) and HCA (128) blocks and cross the window "
                    "edge: the entry a decode step completes, its RoPE position, the ring slot", (*runs, ref), pairs)


def _long_decode() -> Scenario:
    long = Run("prompt 128, 512 steps", 128, 512, param=("decode_steps", 512))
    ref = Run("prompt 641", 641, 1, param=("prompt_len", 641))
    return Scenario("long-decode", "512 decode steps: four HCA blocks and 128 CSA blocks completed in decode, the "
                    "window ring wrapping four times, error accumulating over steps", (long, ref),
                    (Pair("decode==prefill", ref.label, long.label),))


def _batch() -> Scenario:
    """Continuous batching of five sequences (prompts 37, 130, 255, 64 and 201 at different offsets of the default
    prompt): three prefilled in one call, then decoded together one token each per call; a fourth arrives at the
    third call (its prefill in the same call as the others' decode steps), a fifth at the fourth call in two
    prefill chunks (100 + 101); some finish early. Each is compared with the same calls made alone. No equal bits
    are promised: a batched call's GEMMs run over every sequence's rows (the production decoder:
    ``batch.forward_batch``)."""
    seqs = [(0, (37,), 8, 0), (40, (130,), 3, 0), (80, (255,), 8, 0), (120, (64,), 1, 2),
            (160, (100, 101), 5, 3)]  # (offset, prefill chunks, decode steps, the call it arrives at)
    pieces = [[*chunks, *[1] * d] for _, chunks, d, _ in seqs]  # each sequence's calls, in order
    streams = tuple((k, ((o, sum(chunks) + d),)) for k, (o, chunks, d, _) in enumerate(seqs))
    ops, done = [], [0] * len(seqs)
    for call in range(max(a + len(p) for (*_, a), p in zip(seqs, pieces, strict=True))):
        feed = []
        for k, ((*_, arrive), mine) in enumerate(zip(seqs, pieces, strict=True)):
            if call >= arrive and done[k] < len(mine):
                feed.append((k, mine[done[k]]))
                done[k] += 1
        ops.append(Feed(tuple(feed)))
    scripts = [Script("batched", streams, tuple(ops))]
    scripts += [Script(f"alone {k}", ((0, segs),), tuple(Feed(((0, n),)) for n in mine))
                for (k, segs), mine in zip(streams, pieces, strict=True)]
    checks = tuple(Check("batched==alone", (f"alone {k}", 0), ("batched", k)) for k in range(len(seqs)))
    runs = tuple(Run(f"seq {k}: prompt {sum(c)}", sum(c), d, c if len(c) > 1 else None, ("prompt_len", sum(c)),
                     ((o, sum(c) + d),)) for k, (o, c, d, _) in enumerate(seqs))
    return Scenario("batch", "continuous batching: sequences of different, non-aligned prompt lengths prefilled "
                    "together, decoded together, arriving while others decode (a prefill, and prefill chunks, in "
                    "the same call as decode steps), some finishing early: state shared or mixed between "
                    "sequences, a sequence's rows placed at another's positions or offsets", runs,
                    needs=("batch",), scripts=tuple(scripts), checks=checks)


def _prefix() -> Scenario:
    """A 300-token request, second requests forked from it at 130 (inside its one prefill call), 201 (a call
    boundary) and 256 (a multiple of 128), each continuing with 70 tokens of its own and 4 decode steps."""
    parent = ((0, 304),)

    def child(at: int) -> tuple[tuple[int, int], ...]:
        return ((0, at), (400, 74))

    def steps(*seqs: int) -> tuple[Feed, ...]:
        return tuple(Feed(((s, 1),)) for _ in range(4) for s in seqs)

    def cold(at: int, whole: bool) -> Script:
        calls = (Feed(((0, at + 70),)),) if whole else (Feed(((0, at),)), Feed(((0, 70),)))
        return Script(f"cold {at}{' whole' if whole else ''}", ((0, child(at)),), (*calls, *steps(0)))

    scripts = (
        Script("fork 130, 256", ((0, parent), (1, child(130)), (2, child(256))),
               (Feed(((0, 300),)), Fork(1, 0, 130), Fork(2, 0, 256), Feed(((1, 70),)), Feed(((2, 70),)),
                *steps(0, 1, 2))),
        Script("fork 201", ((0, parent), (1, child(201))),
               (Feed(((0, 201),)), Feed(((0, 99),)), Fork(1, 0, 201), Feed(((1, 70),)), *steps(0, 1))),
        Script("parent alone", ((0, parent),), (Feed(((0, 300),)), *steps(0))),
        cold(130, False), cold(201, False), cold(130, True), cold(256, True))
    checks = (
        Check("forked==cold", ("cold 130", 0), ("fork 130, 256", 1),
              "130 is inside the parent's call: the fork replays its first 130 tokens as one call, as the cold run "
              "feeds them"),
        Check("forked==cold", ("cold 201", 0), ("fork 201", 1), "201 ends a parent call: the fork restores its "
              "snapshot; the cold run feeds the same calls"),
        Check("forked==cold whole", ("cold 256 whole", 0), ("fork 130, 256", 2),
              f"the fork's boundary 256 is a multiple of {ALIGN} (chunked==whole's promise)"),
        Check("forked==cold whole", ("cold 130 whole", 0), ("fork 130, 256", 1)),
        Check("parent==alone", ("parent alone", 0), ("fork 130, 256", 0), "independent sequences"))
    runs = (Run("parent: prompt 300", 300, 4, param=("prompt_len", 300), stream=parent),
            Run("fork 130 + 70", 200, 4, param=("prompt_len", 200), stream=child(130)),
            Run("fork 201 + 70", 271, 4, param=("prompt_len", 271), stream=child(201)))
    return Scenario("prefix", "a request forked from another at a shared prefix of non-aligned length (inside a "
                    "prefill call and at a call boundary), continuing with its own tokens: the fork's window ring, "
                    "compressor carries and compressed entries, the parent left as it was", runs, needs=("fork",),
                    scripts=scripts, checks=checks)


def _verify() -> Scenario:
    """Prompt 250, then decode with MTP-style proposals rolled back: 3 proposed / 1 accepted across the CSA block
    end at 251, 4 / 1 across the HCA block end at 255 (and CSA), 2 / 0 at 255, 4 / 2 across 263; 272 positions."""
    stream = ((0, 272),)
    one = Feed(((0, 1),))
    ops = (Feed(((0, 250),)), Propose(0, 3, 1), one, one, one, Propose(0, 4, 1), Propose(0, 2, 0), *[one] * 8,
           Propose(0, 4, 2), *[one] * 7)
    verified = Script("verified", ((0, stream),), ops)
    never = verified.never_proposed("never proposed")
    checks = (Check("rolled back==never proposed", (never.label, 0), (verified.label, 0),
                    "the rollback restores the snapshot and replays the accepted tokens as the other run feeds "
                    "them"),)
    runs = (Run("prompt 250, 22 steps", 250, 22, param=("prompt_len", 250), stream=stream),)
    return Scenario("verify", "speculative (MTP) verification: multi-token calls of proposed tokens, rejected ones "
                    "rolled back, across CSA (4) and HCA (128) block ends: compressor carries, window ring and "
                    "indexer keys that do not return with the rollback", runs, needs=("rollback",),
                    scripts=(verified, never), checks=checks)


CATALOGUE: dict[str, Scenario] = {s.name: s for s in (_lengths(), _chunks(), _decode_boundaries(), _long_decode(),
                                                      _batch(), _prefix(), _verify())}


def check_names(names: Sequence[str | Scenario] | None) -> list[Scenario]:
    """The named scenarios (default: the catalogue; a Scenario given stands for itself); an unknown name raises
    ValueError listing the known ones."""
    names = list(names or CATALOGUE)
    if unknown := [n for n in names if not isinstance(n, Scenario) and n not in CATALOGUE]:
        raise ValueError(f"--scenario: expected one of {', '.join(CATALOGUE)}, found {', '.join(unknown)}")
    found = [n if isinstance(n, Scenario) else CATALOGUE[n] for n in names]
    return list({s.name: s for s in found}.values())


# ---- self-consistency ----------------------------------------------------------------------------------------

def decoder_logits(decoder: Decoder, ids: torch.Tensor, r: Run) -> torch.Tensor:
    """fp32 logits [positions, vocab] of ``r`` on ``decoder`` from position 0: the prefill (in ``r.chunks``), then
    ``r.decode_steps`` steps fed ``ids[prompt_len:]``; nothing recorded."""
    decoder.reset()
    decoder.rec = None
    seq = tokens(ids, r.stream) if r.stream else ids
    prompt = seq[: r.prompt_len]
    rows = [decoder.prefill(c).float() for c in prompt.split(list(r.chunks or (r.prompt_len,)))]
    rows += [decoder.step(int(t)).float()[None] for t in seq[r.prompt_len : r.positions]]
    return torch.cat(rows)


def promise(decoder: Decoder, pair: Pair, b: Run) -> str:
    """Why the pair must be bitwise equal, or '' where no equality of bits is promised."""
    cpu = isinstance(decoder, ProductionDecoder) and decoder.model.device.type == "cpu"
    if cpu and pair.kind == "chunked==whole" and all(p % ALIGN == 0 for p in b.boundaries()):
        return f"production on the CPU, chunk boundaries on multiples of {ALIGN}"
    if cpu and pair.kind == "prefix" and b.prompt_len % ALIGN == 0 and not b.chunks:
        return f"production on the CPU, a prefix of a multiple of {ALIGN} tokens"
    return ""


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Two logits tables [n, vocab] of the same positions: equal bits, largest difference, per-row cos and
    relative L2."""
    d = (a - b).abs()
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
    return {"bitwise": bool(torch.equal(a, b)), "max_abs": float(d.max()),
            "rel_max": float(d.max() / a.abs().max().clamp_min(1e-30)), "rel_l2": float(rel.mean()),
            "cos_min": float(cos.min()), "worst_position": int(rel.argmax())}


def check_pair(scenario: Scenario, pair: Pair, logits: dict[str, torch.Tensor], decoder: Decoder) -> dict:
    a, b = scenario.run(pair.a), scenario.run(pair.b)
    if pair.kind == "prefix":
        span = range(0, b.prompt_len)
    elif pair.kind == "decode==prefill":
        span = range(b.prompt_len, min(b.positions, a.prompt_len))
    else:
        span = range(0, min(a.positions, b.positions))
    got = compare(logits[a.label][span.start : span.stop], logits[b.label][span.start : span.stop])
    why = promise(decoder, pair, b)
    passed = got["bitwise"] if why else got["cos_min"] >= COS_MIN and got["rel_l2"] <= REL_L2_MAX
    bound = "bitwise" if why else f"cos_min >= {COS_MIN}, rel_l2 <= {REL_L2_MAX}"
    return {"scenario": scenario.name, "pair": pair.kind, "a": a.label, "b": b.label,
            "positions": f"{span.start}-{span.stop - 1}", "bitwise promised": why or "no", **got,
            "worst_position": span.start + got["worst_position"], "bound": bound, "passed": passed}


def play(decoder: Decoder, ids: torch.Tensor, script: Script,
         writer: TraceWriter | None = None) -> dict[int, dict[int, torch.Tensor]]:
    """``script`` on ``decoder`` from a reset: {seq: {position: fp32 logits [vocab]}} of every call but the
    proposals. With ``writer``, every call, fork and rollback is also written to it as a trace (version 2): each
    sequence's sites where the decoder records every sequence of a call (``Decoder.records_sequences``), else the
    logits only."""
    decoder.reset()
    decoder.rec = None
    streams = {seq: tokens(ids, segs) for seq, segs in script.streams}
    pos: dict[int, int] = {}
    rows: dict[int, dict[int, torch.Tensor]] = {seq: {} for seq in streams}
    sites = writer is not None and decoder.records_sequences
    try:
        for op in script.ops:
            if isinstance(op, Fork):
                decoder.fork(op.seq, op.parent, op.pos)
                pos[op.seq] = op.pos
                if writer is not None:
                    writer.fork(op.seq, op.parent, op.pos)
                continue
            if isinstance(op, Propose):
                p = pos.get(op.seq, 0)
                draft = streams[op.seq][p : p + op.n].clone()
                draft[op.accept :] = (draft[op.accept :] + 1) % decoder.config.vocab_size
                calls = [Call(op.seq, draft, p)]
            else:
                calls = [Call(seq, streams[seq][pos.get(seq, 0) : pos.get(seq, 0) + n], pos.get(seq, 0))
                         for seq, n in op.calls]
            if sites:
                decoder.recorders = {c.seq: Recorder() for c in calls}
            outs = decoder.forward(calls)
            if writer is not None:
                _write_call(writer, calls, outs, decoder.recorders if sites else None)
            if isinstance(op, Propose):
                decoder.rollback(op.seq, calls[0].start + op.accept)
                pos[op.seq] = calls[0].start + op.accept
                if writer is not None:
                    writer.rollback(op.seq, pos[op.seq])
                continue
            for call, out in zip(calls, outs, strict=True):
                for j, row in enumerate(out.float()):
                    rows[call.seq][call.start + j] = row
                pos[call.seq] = call.start + len(call.ids)
    finally:
        if sites:
            decoder.recorders = None
    return rows


def _write_call(writer: TraceWriter, calls: list[Call], outs: list[torch.Tensor], recorders: dict | None) -> None:
    """One played call into the trace: each sequence's recorded sites (``@seq``), the ids and logits."""
    for call in calls:
        rec = (recorders or {}).get(call.seq)
        for name in rec.records if rec is not None else ():
            writer(name, rec.get(name), seq=call.seq)
    writer.end_call([(c.seq, c.ids) for c in calls], [o.float() for o in outs])


def check_script_pair(scenario: Scenario, check: Check, rows: dict[str, dict[int, dict[int, torch.Tensor]]],
                      decoder: Decoder) -> dict:
    a, b = rows[check.a[0]][check.a[1]], rows[check.b[0]][check.b[1]]
    span = sorted(set(a) & set(b))
    got = compare(torch.stack([a[p] for p in span]), torch.stack([b[p] for p in span]))
    cpu = isinstance(decoder, ProductionDecoder) and decoder.model.device.type == "cpu"
    why = f"production on the CPU: {check.bitwise}" if cpu and check.bitwise else ""
    passed = got["bitwise"] if why else got["cos_min"] >= COS_MIN and got["rel_l2"] <= REL_L2_MAX
    bound = "bitwise" if why else f"cos_min >= {COS_MIN}, rel_l2 <= {REL_L2_MAX}"
    return {"scenario": scenario.name, "pair": check.kind, "a": f"{check.a[0]} / seq {check.a[1]}",
            "b": f"{check.b[0]} / seq {check.b[1]}", "positions": f"{span[0]}-{span[-1]} ({len(span)})",
            "bitwise promised": why or "no", **got, "worst_position": span[got["worst_position"]], "bound": bound,
            "passed": passed}


def missing(scenario: Scenario, decoder: Decoder) -> str:
    """Why ``decoder`` cannot run ``scenario`` (the capabilities it lacks and their reasons), '' when it can."""
    have = decoder.capabilities()
    return "; ".join(f"{need}: {have[need]}" for need in scenario.needs if have.get(need) is not None)


def self_consistency(scenario: Scenario, ids: torch.Tensor, fresh: Callable[[int], Decoder],
                     writers: Callable[[Script, Decoder], TraceWriter | None] | None = None) -> list[dict]:
    """Every pair of ``scenario`` on decoders from ``fresh(max_context)`` (one per run or script); a script for
    which ``writers(script, decoder)`` gives a writer is recorded into it as it plays (finished by the caller)."""
    needed = {label for p in scenario.pairs for label in (p.a, p.b)}
    context = max([r.positions for r in scenario.runs] + [s.positions for s in scenario.scripts])
    logits, decoder = {}, None
    for r in scenario.runs:
        if r.label in needed:
            decoder = fresh(context)
            logits[r.label] = decoder_logits(decoder, ids, r)
    out = [check_pair(scenario, p, logits, decoder) for p in scenario.pairs]
    rows = {}
    for s in scenario.scripts:
        decoder = fresh(context)
        rows[s.label] = play(decoder, ids, s, writers(s, decoder) if writers else None)
    return out + [check_script_pair(scenario, c, rows, decoder) for c in scenario.checks]


# ---- the oracle side and the combined report --------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def worst_local_cos(run_dir: Path) -> float:
    """The smallest cos of any site in layer or op mode (the error a layer or an op adds), NaN without them."""
    df = pd.read_parquet(run_dir / "metrics.parquet", columns=["mode", "metric", "value"])
    rows = df[(df["metric"] == "cos") & df["mode"].isin(("layer", "op"))]["value"]
    return float(rows.min()) if len(rows) else float("nan")


def _where(div: Divergence | None) -> dict:
    """The matrix's first-divergence columns: its step, site and layer (-1 for a site outside the layers); step -1,
    site 'none' for a run without one."""
    if div is None:
        return {"first_step": -1, "first_site": "none", "first_layer": -1}
    m = re.match(r"L(\d+)\.", div.site)
    return {"first_step": div.step, "first_site": div.site, "first_layer": int(m.group(1)) if m else -1}


@dataclass
class ScenarioResult:
    """``matrix`` (a row per run), ``pairs`` (a row per self-consistency pair), the report directory; ``skipped``:
    {scenario: why} for the scenarios the decoder lacks a capability for (not judged, so not passed)."""

    out_dir: Path
    matrix: pd.DataFrame
    pairs: pd.DataFrame
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No judged run or pair fails (skipped scenarios are listed apart)."""
        runs = self.matrix["verdict"] if len(self.matrix) else pd.Series([], dtype=str)
        pairs = self.pairs["passed"] if len(self.pairs) else pd.Series([], dtype=bool)
        return bool((runs == "PASS").all() and pairs.all())

    def failures(self) -> list[str]:
        bad = [f"{r.scenario}/{r.run}: {r.first_divergence}" for r in self.matrix.itertuples()
               if r.verdict != "PASS"]
        return bad + [f"{r.scenario}/{r.pair} {r.b}" + (f" vs {r.a}" if r.a else "") for r in self.pairs.itertuples()
                      if not r.passed]

    def verdict(self) -> str:
        """PASS / FAIL: the failures, then the skipped scenarios (SKIPPED when nothing was judged)."""
        skipped = "; ".join(f"{name} skipped ({why})" for name, why in self.skipped.items())
        if not len(self.matrix) and not len(self.pairs) and skipped:
            return f"SKIPPED: {skipped}"
        head = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures())
        return f"{head}; not judged: {skipped}" if skipped else head


def run_scenarios(plan: CheckpointPlan, names: Sequence[str | Scenario] | None = None,
                  decoder: Decoder | str = "production", out: str | Path = "runs", run_id: str | None = None, *,
                  modes: Sequence[str] = ("free", "layer", "op"),
                  profile: str = "reference", decoder_dtype: str = "bf16", device: str = "cpu",
                  overwrite: bool = False, progress: Callable[[str], None] | None = None,
                  notify: Callable[[str, str], None] = warn, faults: Sequence[str] = ()) -> ScenarioResult:
    """Run ``names`` (default: the whole catalogue) on ``decoder`` against the oracle and against itself, and
    write one report directory ``out/<run_id>/`` (default id ``scenarios-<UTC time>-<random>``) atomically:
    report.md/.html, matrix.csv, pairs.csv, plots/, runs/<scenario>-<run>/ (each run's own directory)."""
    scenarios = check_names(names)
    target = check_output(out, run_id or f"scenarios-{new_run_id()}", overwrite)
    ckpt = plan.open()
    longest = max([r.positions + sum(o for o, _ in r.stream) for s in scenarios for r in s.runs] +
                  [o + n for s in scenarios for sc in s.scripts for _, segs in sc.streams for o, n in segs])
    ids = plan.prompt(longest)
    tell = progress or (lambda line: None)
    t0 = time.perf_counter()

    def fresh(context: int) -> Decoder:
        return open_decoder(decoder, ckpt, profile, context, device, decoder_dtype)

    def fill(tmp: Path) -> ScenarioResult:
        rows, pairs, skipped = [], [], {}
        for s in scenarios:
            if s.needs and (why := missing(s, fresh(_context(s)))):
                skipped[s.name] = why
                tell(f"{s.name}: skipped: {why}")
                continue
            for r in s.runs:
                t = time.perf_counter()
                res = run(decoder, plan, r.prompt(ids), r.decode_steps, modes, tmp / "runs",
                          run_id=_slug(f"{s.name}-{r.label}"), profile=profile, decoder_dtype=decoder_dtype,
                          device=device, notify=notify, prefill_chunk=list(r.chunks) if r.chunks else None)
                rows.append(_row(s, r.label, r.param, (r.prompt_len, len(r.chunks or (1,)), r.decode_steps), res,
                                 time.perf_counter() - t, tmp))
                tell(f"{s.name} / {r.label}: {res.verdict} ({rows[-1]['seconds']:.1f} s)")
            writers: dict[str, TraceWriter] = {}
            try:
                got = self_consistency(s, ids, fresh, partial(_writer, writers, tmp, s))
            except DecoderError as err:  # a capability the decoder has only in part (e.g. forks at call ends)
                for w in writers.values():
                    w.abort()
                skipped[f"{s.name} self-consistency"] = str(err)
                tell(f"{s.name}: self-consistency skipped: {err}")
                continue
            except USER_ERRORS:
                raise
            except Exception as err:  # the decoder raised while the scenario played against itself (a run's
                # own raise ends that run, judged up to the call: ``Runner.run``)
                for w in writers.values():
                    w.abort()
                pairs.append(_crash_pair(s, err))
                for row in (r for r in rows if r["scenario"] == s.name):
                    row["self_consistency"] = "FAIL"
                tell(f"{s.name}: self-consistency: the decoder raised {raised(err)}")
                continue
            for label, w in writers.items():  # the scripts as played, each sequence against the oracle
                rows += judge_trace(s, label, w.finish(), plan, modes, tmp, device, notify, tell)
            shutil.rmtree(tmp / "traces", ignore_errors=True)  # judged: the run directories hold the metrics
            pairs += got
            played = {f"{label} / seq {seq}" for label in writers for _, seq in s.checks_of(label)}
            for row in (r for r in rows if r["scenario"] == s.name):  # a run's own pairs; a played sequence's checks
                mine = [p["passed"] for p in got if p["b"] == row["run"] or (s.checks and row["run"] not in played)]
                if mine:
                    row["self_consistency"] = "PASS" if all(mine) else "FAIL"
            tell(f"{s.name}: self-consistency {sum(p['passed'] for p in got)}/{len(got)} pairs pass")
        result = ScenarioResult(target, pd.DataFrame(rows, columns=list(ROW_COLUMNS)),
                                pd.DataFrame(pairs, columns=list(PAIR_COLUMNS)),
                                time.perf_counter() - t0, skipped)
        write_report(tmp, result, plan.what, decoder)
        return result

    box: list[ScenarioResult] = []
    with inject(*faults):  # planted in the decoder for every run and play (the oracle never reads them)
        write_dir_atomic(target, lambda tmp: box.append(fill(tmp)), overwrite)
    return box[0]


def _context(s: Scenario) -> int:
    return max([r.positions for r in s.runs] + [sc.positions for sc in s.scripts])


def _row(s: Scenario, label: str, param: tuple[str, int], shape: tuple[int, int, int], res, seconds: float,
         tmp: Path) -> dict:
    """One matrix row: a run of ``s`` (``shape``: prompt length, prefill calls, decode steps) and its result."""
    first = str(res.first_divergence or "none")
    ended = res.manifest.get("decoder_raised")
    if ended and res.first_divergence is not None and res.first_divergence.site == "decoder":
        first = f"the decoder raised {raised_in_call(ended)}"
    return {**_run_columns(s, label, param, shape, seconds), "verdict": res.verdict, "first_divergence": first,
            "worst_local_cos": worst_local_cos(res.run_dir), "run_dir": str(res.run_dir.relative_to(tmp)),
            **_where(res.first_divergence)}


def _run_columns(s: Scenario, label: str, param: tuple[str, int], shape: tuple[int, int, int],
                 seconds: float) -> dict:
    prompt_len, chunks, decode_steps = shape
    return {"scenario": s.name, "run": label, "parameter": f"{param[0]}={param[1] or 'mixed'}",
            "prompt_len": prompt_len, "chunks": chunks, "decode_steps": decode_steps, "self_consistency": "-",
            "seconds": seconds, "param_name": param[0], "param_value": param[1]}


def _crash_pair(s: Scenario, err: Exception) -> dict:
    """The self-consistency row of a scenario whose decoder raised while playing it against itself: failed."""
    return {**dict.fromkeys(PAIR_COLUMNS, "-"), "scenario": s.name, "pair": "the decoder raised", "b": raised(err),
            "a": "", "passed": False}


def _writer(writers: dict[str, TraceWriter], tmp: Path, s: Scenario, script: Script,
            decoder: Decoder) -> TraceWriter | None:
    """A trace writer for ``script`` played on ``decoder`` when ``s`` judges it against the oracle (a script its
    checks exercise)."""
    if script.label not in s.judged:
        return None
    writers[script.label] = TraceWriter(tmp / "traces" / _slug(f"{s.name}-{script.label}"), decoder.config,
                                        decoder=decoder.label, profile=decoder.profile)
    return writers[script.label]


def judge_trace(s: Scenario, label: str, trace: Path, plan: CheckpointPlan, modes: Sequence[str], tmp: Path,
                device: str, notify: Callable[[str, str], None], tell: Callable[[str], None]) -> list[dict]:
    """Each sequence of the trace of script ``label`` as played against the oracle: a matrix row per sequence
    (``<label> / seq <k>``), its run directory under ``runs/``."""
    rows = []
    for seq in read_trace(trace).sequences:
        t = time.perf_counter()
        view = TraceDecoder(trace, seq)
        res = run(view, plan, modes=modes, out=tmp / "runs", run_id=_slug(f"{s.name}-{label}-seq{seq}"),
                  device=device, notify=notify)
        rows.append(_row(s, f"{label} / seq {seq}", ("prompt_len", len(view.prompt)),
                         (len(view.prompt), len(view.chunks), len(view.generated)), res, time.perf_counter() - t,
                         tmp))
        tell(f"{s.name} / {label} / seq {seq}: {res.verdict} ({rows[-1]['seconds']:.1f} s)")
    return rows


# raised as they are: what is asked cannot be done with this model, decoder or folder (the user's to fix); anything
# else a decoder raises while a script plays fails that scenario's self-consistency (or that mutant's run), and the
# others go on
USER_ERRORS = (RunError, DecoderError, ContextError, InputError, CheckpointError, RunDirError, OSError)
ROW_COLUMNS = ("scenario", "run", "parameter", "prompt_len", "chunks", "decode_steps", "verdict", "first_divergence",
               "worst_local_cos", "self_consistency", "run_dir", "seconds", "param_name", "param_value", "first_step",
               "first_site", "first_layer")
MATRIX_COLUMNS = ("scenario", "run", "parameter", "verdict", "first_divergence", "worst_local_cos",
                  "self_consistency", "seconds")
PAIR_COLUMNS = ("scenario", "pair", "b", "a", "positions", "bitwise promised", "bitwise", "max_abs", "rel_max",
                "rel_l2", "cos_min", "worst_position", "bound", "passed")


MARKERS = "osD^v<>ph*"


def _panels(matrix: pd.DataFrame) -> list[tuple[pd.DataFrame, str, str]]:
    """(rows, x column, x label) of the two panels: every run over prompt length, the chunks scenario's runs of
    one chunk size over that size."""
    chunked = matrix[(matrix["param_name"] == "chunk") & (matrix["param_value"] > 0)]
    return [(matrix, "prompt_len", "prompt length (tokens)"),
            (chunked, "param_value", "prefill chunk size (tokens; the whole prompt is the largest)")]


NO_CHUNKS = "no run of the chunks scenario in this report"


def _no_data(ax, empty: bool, why: str) -> bool:
    """Write on an empty panel why it is empty; returns ``empty``."""
    if empty:
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#555")
    return empty


def plot(matrix: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    local_cos_figure(matrix).savefig(path, dpi=DPI)
    return path


def local_cos_figure(matrix: pd.DataFrame) -> Figure:
    """1 - worst local cos over prompt length (every run) and over chunk size (the chunks scenario); a failing run
    is drawn as a red cross; an empty panel says why."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, (panel, x, xlabel) in zip(axes, _panels(matrix), strict=True):
        rows = panel.dropna(subset=["worst_local_cos"])  # free mode only, or nothing judged: no point
        for name, group in rows.groupby("scenario", sort=False):
            y = (1 - group["worst_local_cos"]).clip(lower=FLOOR)
            ax.scatter(group[x], y, label=name, s=18)
            bad = group[group["verdict"] != "PASS"]
            ax.scatter(bad[x], (1 - bad["worst_local_cos"]).clip(lower=FLOOR), marker="x", color="red", s=50)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("1 - worst local cos (layer/op)")
        if _no_data(ax, not len(rows), NO_CHUNKS if x == "param_value" and not len(panel) else
                    "no run judged in layer or op mode (free mode has no local cos)"):
            continue
        ax.set_yscale("log")
        if x == "param_value":
            ax.set_xscale("log")
    if len(matrix.dropna(subset=["worst_local_cos"])):
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle("worst local cos per run (red x: the run fails against the oracle)")
    return fig


def divergence_rows(matrix: pd.DataFrame) -> tuple[pd.Series, dict[float, str]]:
    """The first-divergence plot's y per run and its tick labels {y: label}: a layer site at its layer index, a
    site before the layers (embed) below layer 0, one after them (logits, tokens, ...) above the last layer, in
    data-flow order; runs without a divergence on a baseline row ('none') under all of them."""
    sites, layers = matrix["first_site"].astype(str), matrix["first_layer"].astype(int)
    failing = sites != "none"
    inside = failing & (layers >= 0)
    top = int(layers[inside].max()) if inside.any() else -1
    outside = sorted(set(sites[failing & ~inside]), key=site_order_key)
    before = [s for s in outside if site_order_key(s)[0] == 0]
    after = [s for s in outside if site_order_key(s)[0] != 0]
    at = {s: k - len(before) for k, s in enumerate(before)} | {s: top + 1 + k for k, s in enumerate(after)}
    y = pd.Series([layer if layer >= 0 else at.get(site, 0) for site, layer in zip(sites, layers, strict=True)],
                  index=matrix.index, dtype=float)
    none = (float(y[failing].min()) if failing.any() else 0.0) - 1.5
    ticks = {float(v): f"L{int(v)}" for v in sorted(set(y[inside]))} | {float(v): s for s, v in at.items()}
    return y.where(failing, none), {none: "none (passes)", **ticks}


def divergence_figure(matrix: pd.DataFrame) -> Figure:
    """The layer (or site outside the layers) of each run's first divergence over prompt length and over chunk
    size, a marker per scenario; passing runs on the 'none' row below a dashed line."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    y, ticks = divergence_rows(matrix)
    markers = {name: MARKERS[k % len(MARKERS)] for k, name in enumerate(matrix["scenario"].unique())}
    for ax, (rows, x, xlabel) in zip(axes, _panels(matrix), strict=True):
        _no_data(ax, not len(rows), NO_CHUNKS if x == "param_value" else "no run in this report")
        for name, group in rows.groupby("scenario", sort=False):
            ax.scatter(group[x], y[group.index], marker=markers[name], s=24, label=name)
        if x == "param_value" and len(rows):
            ax.set_xscale("log")
        ax.set_yticks(list(ticks), list(ticks.values()), fontsize=8)
        ax.axhline(min(ticks) + 0.75, color="grey", ls="--", lw=0.8)
        ax.set(xlabel=xlabel, ylabel="first divergence: layer (or site)", ylim=(min(ticks) - 0.75,
                                                                                 max(ticks) + 0.75))
    if len(matrix):
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle("where each run first diverges from the oracle (a boundary bug: a column of failures)")
    return fig


def plot_divergence(matrix: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    divergence_figure(matrix).savefig(path, dpi=DPI)
    return path


def write_report(folder: Path, result: ScenarioResult, checkpoint: str, decoder: Decoder | str) -> None:
    """report.md and report.html (styled as a run's report: the verdict first, '-' where nothing ran, each run's
    report linked), matrix.csv, pairs.csv and plots/."""
    matrix, pairs = result.matrix, result.pairs
    matrix.to_csv(folder / "matrix.csv", index=False)
    pairs.to_csv(folder / "pairs.csv", index=False)
    pngs = [plot(matrix, folder / "plots" / "worst_local_cos.png"),
            plot_divergence(matrix, folder / "plots" / "first_divergence.png")]
    label = decoder.label if isinstance(decoder, Decoder) else decoder
    if planted := sorted(active()):
        label += f" with {', '.join(planted)} planted"
    sections = [_verdict_section(result),
                Section("Run", [f"Decoder {label} on {checkpoint}; {len(matrix)} runs, {len(pairs)} self-consistency "
                                f"pairs, {len(result.skipped)} scenarios skipped, {result.seconds:.0f} s.",
                                "Each run's own report: the report column links to it."]),
                Section("Plots", images=pngs),
                Section("Scenario matrix", table=_matrix_table(matrix), na="-", links=("report",)),
                Section("Self-consistency (the decoder against itself)",
                        [f"Bound where bits may differ: cos_min >= {COS_MIN}, rel_l2 <= {REL_L2_MAX}."],
                        pairs[list(PAIR_COLUMNS)] if len(pairs) else None, na="-", nowrap=("bound",))]
    if result.skipped:
        sections.append(Section("Skipped (the decoder lacks a capability; not judged)", table=pd.DataFrame(
            {"scenario": list(result.skipped), "why": list(result.skipped.values())})))
    title = f"dsv4-fidelity scenarios: {result.out_dir.name}"
    (folder / "report.md").write_text(render_markdown(title, sections, folder), encoding="utf-8")
    (folder / "report.html").write_text(render_html(title, sections), encoding="utf-8")


def _verdict_section(result: ScenarioResult) -> Section:
    """PASS / FAIL (or SKIPPED) first, in the run report's banner, then each failure on its own line."""
    verdict = result.verdict()
    passed = result.passed and not verdict.startswith("SKIPPED")
    runs = int((result.matrix["verdict"] == "PASS").sum()) if len(result.matrix) else 0
    pairs = int(result.pairs["passed"].sum()) if len(result.pairs) else 0
    head = f"{'PASS' if passed else verdict.split(':')[0]}: {runs} of {len(result.matrix)} runs pass against the " \
           f"oracle, {pairs} of {len(result.pairs)} self-consistency pairs pass."
    lines = [f"FAIL {f}" for f in result.failures()] + [f"SKIPPED {k}: {why}" for k, why in result.skipped.items()]
    return Section("Verdict", [head, *lines], css="pass" if passed else "fail")


def _matrix_table(matrix: pd.DataFrame) -> pd.DataFrame:
    """The matrix's columns and a link to each run's report.html (its run directory under runs/)."""
    table = matrix[list(MATRIX_COLUMNS)]
    if "run_dir" in matrix:
        table = table.assign(report=[f"{d}/report.html" if isinstance(d, str) and d else None
                                     for d in matrix["run_dir"]])
    return table
