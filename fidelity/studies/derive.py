"""Self-consistency pairs derived from any call script (``fidelity fuzz``, scenario files: docs/fuzz.md).

A played script (``Script``: feeds, forks, proposals rolled back, over several sequences) is turned into a
:class:`~fidelity.studies.catalogue.Scenario` whose scripts are the played one and the scripts it must agree with,
and whose checks are the catalogue's pairs:

- ``batched==alone`` / ``forked==cold`` (two or more sequences): each sequence against its own history played alone
  on a fresh decoder (a fork replaced by its parent's calls up to the fork, a proposal by its accepted tokens);
  equal bits promised where none of those calls shared a model call with another sequence (``Decoder.same_bits``);
- ``rolled back==never proposed`` (a script with proposals): every sequence against the script that fed the
  accepted tokens as one call instead (bitwise, as the catalogue's ``verify``);
- ``chunked==whole``: a sequence whose prompt came in several calls (before its last call of more than one token)
  against the same tokens in one call, then the same decode steps; bitwise where the decoder keeps its bits across
  those boundaries (``same_bits(split)``) and no decode step lies among them, else the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fidelity.studies.catalogue import Check, Feed, Fork, Propose, Scenario, Script

PLAYED = "played"
NEVER = "never proposed"


@dataclass(frozen=True)
class Item:
    """One call of a sequence's history: ``n`` tokens (``accept`` of them kept when ``proposal``), ``batched``
    when it shared its model call with another sequence."""

    n: int
    batched: bool = False
    proposal: bool = False
    accept: int = 0

    @property
    def kept(self) -> int:
        return self.accept if self.proposal else self.n


def history(script: Script, seq: int, upto: int | None = None) -> list[Item]:
    """The calls that made sequence ``seq`` of ``script`` (ops before index ``upto``): a fork becomes its parent's
    history, proposals replaced by their accepted tokens, cut at the fork's position."""
    items: list[Item] = []
    ops = script.ops if upto is None else script.ops[:upto]
    for k, op in enumerate(ops):
        if isinstance(op, Fork) and op.seq == seq:
            items = truncate(history(script, op.parent, k), op.pos)
        elif isinstance(op, Feed):
            items += [Item(n, len(op.calls) > 1) for s, n in op.calls if s == seq]
        elif isinstance(op, Propose) and op.seq == seq:
            items.append(Item(op.n, False, True, op.accept))
    return items


def truncate(items: list[Item], pos: int) -> list[Item]:
    """``items`` with proposals replaced by their accepted tokens, cut to the first ``pos`` tokens."""
    out, at = [], 0
    for it in items:
        if at >= pos:
            break
        if it.kept:
            n = min(it.kept, pos - at)
            out.append(Item(n, it.batched))
            at += n
    return out


def fed(script: Script, seq: int) -> bool:
    """Whether ``seq`` has a call of its own in ``script`` (rows to compare)."""
    return any(isinstance(op, Feed) and any(s == seq for s, _ in op.calls) for op in script.ops)


def ops_of(items: list[Item]) -> tuple[Feed | Propose, ...]:
    return tuple(Propose(0, it.n, it.accept) if it.proposal else Feed(((0, it.n),)) for it in items)


def boundaries(sizes: list[int]) -> tuple[int, ...]:
    return tuple(sum(sizes[:k]) for k in range(1, len(sizes)))


def derive(script: Script, name: str = "fuzz", description: str = "a generated call script") -> Scenario:
    """``script`` (played as ``played``) and the scripts and checks it must agree with, as a scenario."""
    played = Script(PLAYED, script.streams, script.ops)
    streams = dict(script.streams)
    multi = len(streams) > 1
    scripts, checks = [played], []
    for seq, segs in script.streams:
        if not fed(script, seq):  # no rows of its own to compare
            continue
        items = history(played, seq)
        side = (PLAYED, seq)
        forked = any(isinstance(op, Fork) and op.seq == seq for op in script.ops)
        if multi or forked:
            alone = Script(f"alone {seq}", ((0, segs),), ops_of(items))
            scripts.append(alone)
            shared = any(it.batched for it in items)
            kind = "forked==cold" if forked else ("batched==alone" if shared else "parent==alone")
            checks.append(Check(kind, (alone.label, 0), side,
                                "" if shared else "the same calls of this sequence, none shared with another"))
            side = (alone.label, 0)
        if whole := _whole(items, seq, segs):
            scripts.append(whole[0])
            checks.append(Check("chunked==whole", (whole[0].label, 0), side, whole[1], whole[2]))
    if any(isinstance(op, Propose) for op in script.ops):
        never = played.never_proposed(NEVER)
        scripts.append(never)
        checks += [Check("rolled back==never proposed", (NEVER, seq), (PLAYED, seq),
                         "the rollback replays the accepted tokens as one call, as the other run feeds them")
                   for seq in streams if fed(script, seq)]
    return Scenario(name, description, (), scripts=tuple(scripts), checks=tuple(checks))


def _whole(items: list[Item], seq: int, segs) -> tuple[Script, str, tuple[int, ...]] | None:
    """The script feeding ``seq``'s tokens up to its last call of more than one token as one call (then the same
    decode steps), why equal bits may be promised ('' when a decode step lies among the merged calls) and the
    boundaries merged; None where fewer than two calls would merge."""
    kept = [it.kept for it in items if it.kept]
    last = max((k for k, n in enumerate(kept) if n > 1), default=-1)
    if last < 1:
        return None
    merged, tail = kept[: last + 1], kept[last + 1 :]
    decode_inside = any(n == 1 for n in merged[1:])
    ops = (Feed(((0, sum(merged)),)), *(Feed(((0, n),)) for n in tail))
    why = "" if decode_inside else "the same tokens, the calls differ only at the merged boundaries"
    return Script(f"whole {seq}", ((0, segs),), ops), why, boundaries(merged)
