"""Shrinking a failing call script (``fidelity fuzz``): greedy delta debugging over its ops, its sequences and its
calls' lengths, keeping each smaller script that still fails the same check.

Every candidate is rebuilt from its ops (``rebuild``): sequences renumbered in order of appearance, each stream
cut to what the ops read, forks and proposals checked against where their sequence stands, so a candidate is
always a script the decoder can be asked for. Smaller means fewer ops, then fewer tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from fidelity.studies.catalogue import Feed, Fork, Propose, Script
from fidelity.studies.fuzz import cut

Op = Feed | Fork | Propose


def size(script: Script) -> tuple[int, int]:
    """(model calls, forks and proposals; tokens fed): what shrinking reduces."""
    tokens = sum(n for op in script.ops if isinstance(op, Feed) for _, n in op.calls)
    tokens += sum(op.n for op in script.ops if isinstance(op, Propose))
    return len(script.ops), tokens


def rebuild(script: Script, ops: list[Op]) -> Script | None:
    """``ops`` over ``script``'s token offsets as a script (sequences renumbered, streams cut to what is read), or
    None where an op asks for what cannot be (a fork past where its parent stands, a sequence forked twice, a call
    of no tokens)."""
    own = {seq: segs[-1][0] for seq, segs in script.streams}  # each sequence's own tokens' offset
    names: dict[int, int] = {}
    pos: dict[int, int] = {}
    extent: dict[int, int] = {}
    origin: dict[int, tuple[int, int]] = {}
    out: list[Op] = []

    def name(seq: int) -> int:
        return names.setdefault(seq, len(names))

    for op in ops:
        if isinstance(op, Fork):
            if op.parent not in pos or op.seq in pos or not 0 < op.pos <= pos[op.parent]:
                return None
            pos[op.seq] = extent[op.seq] = op.pos
            origin[op.seq] = (op.parent, op.pos)
            out.append(Fork(name(op.seq), name(op.parent), op.pos))
        elif isinstance(op, Propose):
            if op.seq not in pos or op.n < 1 or not 0 <= op.accept <= op.n:
                return None
            extent[op.seq] = max(extent[op.seq], pos[op.seq] + op.n)
            pos[op.seq] += op.accept
            out.append(Propose(name(op.seq), op.n, op.accept))
        else:
            calls = [(s, n) for s, n in op.calls if n > 0]
            if not calls or len({s for s, _ in calls}) != len(calls):
                return None
            for s, n in calls:
                pos[s] = pos.get(s, 0) + n
                extent[s] = max(extent.get(s, 0), pos[s])
            out.append(Feed(tuple((name(s), n) for s, n in calls)))
    if not out or not isinstance(out[0], Feed):
        return None

    def stream(seq: int) -> tuple[tuple[int, int], ...]:
        if seq not in origin:
            return ((own.get(seq, 0), extent[seq]),)
        parent, at = origin[seq]
        return cut(stream(parent), at) + (((own.get(seq, 0), extent[seq] - at),) if extent[seq] > at else ())

    return Script(script.label, tuple((names[s], stream(s)) for s in sorted(names, key=names.get)), tuple(out))


def candidates(script: Script) -> Iterator[list[Op]]:
    """Smaller op lists than ``script``'s, the largest cuts first: halves and quarters of the ops, each op, each
    sequence with its forks, each batched call split, calls and proposals shortened, forks moved earlier."""
    ops = list(script.ops)
    n = len(ops)
    for parts in (2, 4, 8):
        step = max(1, n // parts)
        for start in range(0, n, step):
            if step < n:
                yield ops[:start] + ops[start + step :]
        if step == 1:
            break
    for k in reversed(range(n)):
        yield ops[:k] + ops[k + 1 :]
    seqs = sorted({s for s, _ in script.streams})
    for seq in reversed(seqs[1:]):
        gone = _descendants(ops, seq)
        yield [o for o in (_without(op, gone) for op in ops) if o is not None]
    for k, op in enumerate(ops):
        if isinstance(op, Feed) and len(op.calls) > 1:
            yield ops[:k] + [Feed((c,)) for c in op.calls] + ops[k + 1 :]
            for j in range(len(op.calls)):
                yield ops[:k] + [Feed(op.calls[:j] + op.calls[j + 1 :])] + ops[k + 1 :]
    for k, op in enumerate(ops):
        if k + 1 < n and isinstance(op, Feed) and isinstance(ops[k + 1], Feed) and len(op.calls) == 1 \
                and len(ops[k + 1].calls) == 1 and op.calls[0][0] == ops[k + 1].calls[0][0]:
            yield ops[:k] + [Feed(((op.calls[0][0], op.calls[0][1] + ops[k + 1].calls[0][1]),))] + ops[k + 2 :]
    for k, op in enumerate(ops):
        for smaller in _shorter(op):
            yield ops[:k] + [smaller] + ops[k + 1 :]


def _shorter(op: Op) -> Iterator[Op]:
    if isinstance(op, Feed):
        for j, (s, n) in enumerate(op.calls):
            for m in dict.fromkeys((1, n // 2, n - 1)):
                if 0 < m < n:
                    yield Feed(op.calls[:j] + ((s, m),) + op.calls[j + 1 :])
    elif isinstance(op, Propose):
        for m in dict.fromkeys((2, op.n - 1)):
            if 1 < m < op.n:
                yield Propose(op.seq, m, min(op.accept, m))
        for a in dict.fromkeys((0, op.accept - 1)):
            if 0 <= a < op.accept:
                yield Propose(op.seq, op.n, a)
    elif isinstance(op, Fork):
        for m in dict.fromkeys((1, op.pos // 2, op.pos - 1)):
            if 0 < m < op.pos:
                yield Fork(op.seq, op.parent, m)


def _descendants(ops: list[Op], seq: int) -> set[int]:
    gone = {seq}
    for op in ops:
        if isinstance(op, Fork) and op.parent in gone:
            gone.add(op.seq)
    return gone


def _without(op: Op, gone: set[int]) -> Op | None:
    if isinstance(op, Feed):
        calls = tuple(c for c in op.calls if c[0] not in gone)
        return Feed(calls) if calls else None
    return None if op.seq in gone else op


def shrink(script: Script, fails: Callable[[Script], bool], budget_s: float,
           progress: Callable[[str], None] = lambda line: None) -> tuple[Script, int]:
    """The smallest script found from ``script`` for which ``fails`` holds, within ``budget_s`` seconds, and the
    number of candidates tried: each pass takes the first smaller candidate that still fails and starts again."""
    t0, tried, best = time.perf_counter(), 0, script
    seen = {best.ops}
    improved = True
    while improved and time.perf_counter() - t0 < budget_s:
        improved = False
        for ops in candidates(best):
            if time.perf_counter() - t0 >= budget_s:
                break
            cand = rebuild(best, ops)
            if cand is None or cand.ops in seen or size(cand) >= size(best):
                continue
            seen.add(cand.ops)
            tried += 1
            if fails(cand):
                best, improved = cand, True
                progress(f"shrink: {size(best)[0]} ops, {size(best)[1]} tokens (candidate {tried})")
                break
    return best, tried
