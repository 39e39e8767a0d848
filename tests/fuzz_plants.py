"""Port bugs planted in the production decoder that pass the whole fixed scenario catalogue (their trigger is a call
pattern the catalogue never makes) and that ``fidelity fuzz`` must find (tests/test_fuzz.py, docs/fuzz.md).

Each counts in ``fired`` the calls where its bug changed what the decoder did.
"""

from __future__ import annotations

from fidelity.decoders.base import Call
from fidelity.decoders.faults import inject
from fidelity.decoders.production.decoder import ProductionDecoder


class Planted(ProductionDecoder):
    """A production decoder with one planted bug; ``fired`` (each plant's class) survives ``reset``."""

    def reset(self) -> None:
        super().reset()
        self.aligned: set[int] = set()
        self.forked: dict[int, tuple[int, int]] = {}


class AlignedForkRollback(Planted):
    """A prefix-cache hit at a fork position that is a multiple of 256, then an MTP rollback on the child (vLLM
    #51441: DSv4 + MTP + prefix caching at 256-token blocks): the rollback restores the window ring but keeps the
    compressors' current carries."""

    fired = 0

    def fork(self, seq: int, parent: int, pos: int) -> None:
        super().fork(seq, parent, pos)
        if pos % 256 == 0:
            self.__dict__.setdefault("aligned", set()).add(seq)

    def rollback(self, seq: int, pos: int) -> None:
        if seq in self.__dict__.get("aligned", ()) and pos != self.seqs[seq].session.pos:
            AlignedForkRollback.fired += 1
            with inject("rollback-partial-carry"):
                return super().rollback(seq, pos)
        return super().rollback(seq, pos)


class ResumedPrefillAsVerify(Planted):
    """A call of 8 tokens at a position past 0 is taken for an MTP verify call (JustVugg/colibri #1554: ``n > 1 and
    start_pos > 0``, here at the verify width 8, which no catalogue call has: its verify calls are 2-4 tokens, its
    chunks past 0 are 2-7 tokens or 40 and more): its tokens' KV rows go to a scratch buffer, the window ring keeps
    what it held."""

    fired = 0
    WIDTH = 8

    def forward(self, calls: list[Call]) -> list:
        hits = [c for c in calls if len(c.ids) == self.WIDTH and c.start > 0]
        before = {c.seq: self.snapshot(self.seqs[c.seq].session) for c in hits}
        out = super().forward(calls)
        for c in hits:
            ResumedPrefillAsVerify.fired += 1
            for cache, saved in zip(self.seqs[c.seq].session.layers, before[c.seq].layers, strict=True):
                if cache is not None:
                    self.restore_ring(cache, saved)
        return out


class PastContext(Planted):
    """Past 768 tokens of context (24 x index_topk on the default) the indexer keeps half of index_topk: a candidate
    buffer sized for the contexts it was tried on (fault ``topk-cap-half`` from there on)."""

    fired = 0

    LIMIT = 768

    def forward(self, calls: list[Call]) -> list:
        if any(c.start + len(c.ids) > self.LIMIT for c in calls):
            PastContext.fired += 1
            with inject("topk-cap-half"):
                return super().forward(calls)
        return super().forward(calls)

    def prefill(self, ids):
        if len(ids) > self.LIMIT:
            PastContext.fired += 1
            with inject("topk-cap-half"):
                return super().prefill(ids)
        return super().prefill(ids)

    def step(self, token):
        if self.pos + 1 > self.LIMIT:
            PastContext.fired += 1
            with inject("topk-cap-half"):
                return super().step(token)
        return super().step(token)


class ForkOfForkFromRoot(Planted):
    """A fork of a forked sequence resolves its prefix to the root request's state (a prefix cache keyed by the
    first request's blocks): the grandchild starts from the root at that position."""

    fired = 0

    def fork(self, seq: int, parent: int, pos: int) -> None:
        forked = self.__dict__.setdefault("forked", {})
        root = parent
        while root in forked:
            root = forked[root][0]
        if root != parent and self.seqs[root].session.pos >= pos:
            ForkOfForkFromRoot.fired += 1
            super().fork(seq, root, pos)
        else:
            super().fork(seq, parent, pos)
        forked[seq] = (parent, pos)


class LatePassMask(Planted):
    """A prompt that spans more than one forward pass gets its compressed-attention mask wrong in the later passes
    (ggml-org/llama.cpp#26509: DSv4 garbage once a prompt spans several passes, the compressed-attention masks
    built in the wrong precision): here a prefill call of 2 tokens or more that starts at position ``START`` or later
    runs with the compressed entries' causal rule one entry late (fault ``causal-off-by-one``). The catalogue's
    resumed prefill calls all start before position 300."""

    fired = 0
    START = 320

    def forward(self, calls: list[Call]) -> list:
        if any(len(c.ids) > 1 and c.start >= self.START for c in calls):
            LatePassMask.fired += 1
            with inject("causal-off-by-one"):
                return super().forward(calls)
        return super().forward(calls)

    def prefill(self, ids):
        if len(ids) > 1 and self.pos >= self.START:
            LatePassMask.fired += 1
            with inject("causal-off-by-one"):
                return super().prefill(ids)
        return super().prefill(ids)


PLANTS = {"aligned-fork-rollback": AlignedForkRollback, "resumed-prefill-as-verify": ResumedPrefillAsVerify,
          "past-768-topk": PastContext, "fork-of-fork-root": ForkOfForkFromRoot, "late-pass-mask": LatePassMask}


class AllPlanted(AlignedForkRollback, ResumedPrefillAsVerify, PastContext, ForkOfForkFromRoot, LatePassMask):
    """Every plant at once (the catalogue check: one run of the whole catalogue)."""
