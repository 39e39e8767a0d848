"""Call scripts drawn at random (``fidelity fuzz``, docs/fuzz.md): Hypothesis strategies over the scenarios'
vocabulary, bounded by a decoder's capabilities and a context.

A drawn script is a catalogue :class:`~fidelity.studies.catalogue.Script`: sequences with token streams (segments
of the default prompt's ids at drawn offsets; a fork's stream is its parent's up to the fork, then its own), and
ops: ``Feed`` (one model call: prefill chunks of drawn lengths, decode steps, several sequences in one call, new
sequences arriving beside others' decode steps), ``Fork`` (at a drawn position of a sequence, the child then fed
tokens of its own) and ``Propose`` (a verify call of n tokens, some accepted, the rest rolled back). Lengths favour
the compressors' and the window's edges (multiples of 4, 128, 256, one either side). What the decoder's
``capabilities`` rule out is never drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Decoder
from fidelity.studies.catalogue import Feed, Fork, Propose, Script

EDGES = (4, 128, 256)  # CSA and HCA block sizes and the window (the default's), and twice the HCA block
NEAR = (0, 0, -1, 1)  # an edge itself half the time, else one either side
OFFSETS = (0, 1, 3, 64, 127, 128, 255, 300)  # where a sequence's own tokens start in the default prompt's ids


@dataclass(frozen=True)
class Space:
    """What may be drawn: positions per sequence (``context``), sequences, ops per script, the capabilities."""

    context: int
    seqs: int = 4
    steps: int = 10
    decode_run: int = 12
    propose_max: int = 6
    batch: bool = True
    fork: bool = True
    rollback: bool = True
    left_out: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, decoder: Decoder, context: int, **kw) -> Space:
        """The space a decoder's ``capabilities`` allow; ``left_out``: {capability: why} for what is not drawn."""
        have = decoder.capabilities()
        left = {c: why for c, why in have.items() if why is not None}
        return cls(context, batch=BATCH not in left, fork=FORK not in left, rollback=ROLLBACK not in left,
                   left_out=left, **kw)

    @property
    def longest(self) -> int:
        """The largest token index a drawn stream may read (its offset plus the context)."""
        return max(OFFSETS) + self.context


def _length(draw, at: int, room: int) -> int:
    """A call's length from position ``at`` with ``room`` positions left: small, to an edge (one either side), or
    anywhere."""
    how = draw(st.sampled_from(("small", "edge", "any")))
    if how == "small":
        n = draw(st.integers(1, 8))
    elif how == "edge":
        m = draw(st.sampled_from(EDGES))
        n = (at // m + draw(st.integers(1, 3))) * m + draw(st.sampled_from(NEAR)) - at
    else:
        n = draw(st.integers(1, max(1, room)))
    return max(1, min(n, room))


def _position(draw, pos: int) -> int:
    """A position in 1..pos: where it stands, an edge (one either side), or anywhere."""
    how = draw(st.sampled_from(("here", "edge", "any")))
    if how == "here":
        return pos
    if how == "edge":
        m = draw(st.sampled_from([m for m in EDGES if m <= pos] or [EDGES[0]]))
        return max(1, min(pos, (draw(st.integers(1, max(1, pos // m))) * m) + draw(st.sampled_from(NEAR))))
    return draw(st.integers(1, pos))


@st.composite
def scripts(draw, space: Space) -> Script:
    """A call script within ``space``."""
    pos: dict[int, int] = {}  # where each sequence stands
    extent: dict[int, int] = {}  # the stream positions each sequence reads
    origin: dict[int, tuple[int, int] | None] = {}  # a fork's (parent, position)
    offset: dict[int, int] = {}
    ops: list[Feed | Fork | Propose] = []

    def arrive() -> int:
        k = len(pos)
        pos[k], extent[k], origin[k] = 0, 0, None
        offset[k] = draw(st.sampled_from(OFFSETS))
        return k

    def feed(calls: list[tuple[int, int]]) -> None:
        for k, n in calls:
            pos[k] += n
            extent[k] = max(extent[k], pos[k])
        ops.append(Feed(tuple(calls)))

    def chunk(k: int) -> int:
        return _length(draw, pos[k], space.context - pos[k])

    def propose(k: int) -> None:  # a verify call of n tokens on sequence k, some accepted, the rest rolled back
        n = draw(st.integers(2, min(space.propose_max, space.context - pos[k])))
        accept = draw(st.integers(0, n))
        extent[k] = max(extent[k], pos[k] + n)
        pos[k] += accept
        ops.append(Propose(k, n, accept))
        if pos[k] < space.context and draw(st.booleans()):  # the next step reads what the rollback left
            feed([(k, 1)])

    arrive()
    feed([(0, chunk(0))])
    for _ in range(draw(st.integers(1, space.steps))):
        live = [k for k in pos if pos[k] < space.context]
        kinds = ["feed", "decode"] if live else []
        if space.batch and len(pos) < space.seqs:
            kinds.append("arrive")
        if space.fork and len(pos) < space.seqs:
            kinds.append("fork")
        if space.rollback and [k for k in live if space.context - pos[k] >= 2]:
            kinds.append("propose")
        if not kinds:
            break
        kind = draw(st.sampled_from(kinds))
        if not space.batch:
            chosen = [draw(st.sampled_from(live))] if live else []
        else:
            chosen = [k for k in live if draw(st.booleans())] or live[:1]
        if kind == "feed" and chosen:
            feed([(k, 1 if draw(st.booleans()) and pos[k] else chunk(k)) for k in chosen])
        elif kind == "decode" and chosen:
            for _ in range(draw(st.integers(1, space.decode_run))):
                if not (alive := [k for k in chosen if pos[k] < space.context]):
                    break
                feed([(k, 1) for k in alive])
        elif kind == "arrive":
            k = arrive()
            feed([(k, chunk(k))] + [(j, 1) for j in chosen if j != k and pos[j] and draw(st.booleans())])
        elif kind == "fork":
            forked = sorted(k for k in pos if origin[k] is not None)
            among = forked if forked and draw(st.booleans()) else sorted(pos, reverse=True)
            parent = draw(st.sampled_from(among))  # a forked sequence half the time there is one
            at = _position(draw, pos[parent])
            k = arrive()
            pos[k], extent[k], origin[k] = at, at, (parent, at)
            ops.append(Fork(k, parent, at))
            if pos[k] < space.context:  # the child continues with tokens of its own
                feed([(k, chunk(k))])
            if space.rollback and space.context - pos[k] >= 2 and draw(st.booleans()):  # a verify call on it
                propose(k)
        elif kind == "propose":
            propose(draw(st.sampled_from([k for k in live if space.context - pos[k] >= 2])))
    return Script("fuzz", tuple((k, _stream(k, extent, origin, offset)) for k in sorted(pos)), tuple(ops))


def _stream(k: int, extent: dict, origin: dict, offset: dict) -> tuple[tuple[int, int], ...]:
    """Sequence ``k``'s segments: its parent's up to the fork (if forked), then its own from its offset."""
    if origin[k] is None:
        return ((offset[k], max(1, extent[k])),)
    parent, at = origin[k]
    segs = cut(_stream(parent, extent, origin, offset), at)
    return segs + (((offset[k], extent[k] - at),) if extent[k] > at else ())


def cut(segs: tuple[tuple[int, int], ...], n: int) -> tuple[tuple[int, int], ...]:
    """The first ``n`` tokens of a stream's segments."""
    out, left = [], n
    for o, length in segs:
        if left <= 0:
            break
        out.append((o, min(length, left)))
        left -= length
    return tuple(out)
