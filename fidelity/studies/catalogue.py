"""The scenario catalogue (``fidelity scenarios``, docs/scenarios.md): named sets of runs aimed at one port-bug
mechanism each.

A scenario is data, like a profile: a name, the mechanism it targets, its runs (prompt length, prefill chunk sizes,
decode steps, the parameter it varies) and the self-consistency pairs it checks. Runs are fed one fixed token
sequence (the default prompt's ids: prompt ``ids[:n]``, decode tokens ``ids[n:]``), so that two runs give logits for
the same positions after the same tokens. A :class:`Pair` compares two runs: ``chunked==whole`` (a chunked prefill
vs the whole prefill of the same prompt), ``prefix`` (a prompt's first-call rows vs a longer prompt's prefill rows),
``decode==prefill`` (the decode steps after prompt n vs the longer prompt's prefill rows at those positions).

Scenarios over several sequences (``batch``, ``prefix``, ``verify``) need decoder capabilities (``Decoder.
capabilities``: batch, fork, rollback) and play :class:`Script` s (forward calls, forks, proposals rolled back);
a :class:`Check` compares one script's sequence with another's at the positions both have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
    script ``a[0]`` at the positions both computed. ``bitwise``: why both sides feed the decoder the same tokens in
    the same calls, up to the call boundaries ``split`` only one side has ('' where they do not: the bounds judge
    the pair); equal bits are then promised where the decoder keeps its bits across such a split
    (``Decoder.same_bits``)."""

    kind: str
    a: tuple[str, int]
    b: tuple[str, int]
    bitwise: str = ""
    split: tuple[int, ...] = ()


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str  # the port-bug mechanism it targets
    runs: tuple[Run, ...]
    pairs: tuple[Pair, ...] = ()
    needs: tuple[str, ...] = ()  # decoder capabilities (fidelity.decoders.base.CAPABILITIES)
    scripts: tuple[Script, ...] = ()
    checks: tuple[Check, ...] = ()
    site_pairs: bool = True  # the checks compare the sequences at their sites too (``site_checks``); False: logits only

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
              "the fork's boundary 256 is the one call boundary the whole cold run lacks", (256,)),
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


def describe(script: Script) -> list[str]:
    """A script as lines: its sequences' streams, then one line per op."""
    lines = [f"- seq {s}: tokens " + " + ".join(f"ids[{o}:{o + n}]" for o, n in segs) for s, segs in script.streams]
    for k, op in enumerate(script.ops):
        if isinstance(op, Feed):
            what = "call " + ", ".join(f"seq {s} x{n}" for s, n in op.calls)
        elif isinstance(op, Fork):
            what = f"fork seq {op.seq} from seq {op.parent} at {op.pos}"
        else:
            what = f"propose seq {op.seq}: {op.n} tokens, {op.accept} accepted, rolled back to the accepted"
        lines.append(f"{k + 1}. {what}")
    return lines
