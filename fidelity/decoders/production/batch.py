"""One model call over several sequences at once, as serving engines batch them (varlen).

Each sequence brings its own session (caches, position) and its tokens for this call: a prefill chunk, or one
decode token after its first call; a call may mix both. The rows of every sequence are concatenated in call
order and everything that does not read a cache runs once over all of them: the embedding, mHC, the norms, the
q / kv / output projections, RoPE (each row at its own position), the MoE and the head. The attention core runs
per sequence on its slice of rows over its own caches (``Attention.core``: window ring, compressor carries,
compressed entries, indexer keys), prefill or decode as that sequence's call is: the shared part is a session
without caches under the :class:`Batched` rows policy.

Rounding: a GEMM over all the batch's rows may round a sequence's rows differently from the same GEMM over its
rows alone (the CPU BLAS blocks by row count), so a batched sequence's logits equal its logits alone up to that
rounding, not bit for bit. Sites go to each sequence's own recorder (``session.rec``): a site of the shared part
split into the sequences' rows, the attention core's (compressed entries, indexer, visible sets) as each session
emits them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fidelity.decoders.production.call_counts import counting
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.model import ProductionSession
from fidelity.model.sites import record

if TYPE_CHECKING:
    from fidelity.decoders.production.attention import Attention


class Batched:
    """The rows policy of a batched call's shared part: each sequence's rows (``spans``, in call order) go to that
    sequence's session, for its attention core and its recorder."""

    def __init__(self, sessions: Sequence[ProductionSession], spans: Sequence[slice]):
        self.sessions, self.spans = list(sessions), list(spans)
        self.recording = any(s.rec is not None for s in sessions)

    def emit(self, s: ProductionSession, template: str, layer: int | None, tensor) -> None:
        """A site of the shared part (rows of every sequence, in call order): each sequence's rows to its recorder."""
        if not self.recording:
            return
        t = tensor() if callable(tensor) else tensor
        for seq, sl in zip(self.sessions, self.spans, strict=True):
            record(seq.rec, template, layer, t[sl])

    def core(self, attn: Attention, s: ProductionSession, x, qr, q, kv, positions) -> torch.Tensor:
        """Every sequence's attention core on its rows over its own caches -> o [n_all, heads, hd]."""
        if on("batch-key-range"):  # every sequence's indexer key range ends where the first sequence's does
            first = self.sessions[0]
            for seq in self.sessions[1:]:
                seq.key_range_end = first.pos + self.spans[0].stop - self.spans[0].start
        o = torch.cat([attn.core(seq, x[sl], qr[sl], q[sl], kv[sl], positions[sl])
                       for seq, sl in zip(self.sessions, self.spans, strict=True)])
        for seq in self.sessions:
            seq.key_range_end = None
        return o


@torch.no_grad()
def forward_batch(sessions: Sequence[ProductionSession], ids: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Sequence k's ``ids[k]`` [n_k] at ``sessions[k].pos``.. -> fp32 logits [n_k, vocab] each, from one model
    call. Every call is checked (count, position, context, vocabulary) before any runs; each session's ``pos``
    and ``calls`` advance as a one-sequence call would advance them. The sessions must be distinct and share one
    model."""
    if len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("forward_batch: a session appears twice in one call")
    if any(s.model is not sessions[0].model for s in sessions):
        raise ValueError("forward_batch: the sessions belong to different models")
    prefill = [s.pos == 0 or len(torch.as_tensor(t).flatten()) > 1 for s, t in zip(sessions, ids, strict=True)]
    checked = [s._check(t, p) for s, t, p in zip(sessions, ids, prefill, strict=True)]
    sizes = [len(t) for t in checked]
    ends = torch.tensor(sizes).cumsum(0).tolist()
    spans = [slice(end - n, end) for n, end in zip(sizes, ends, strict=True)]
    device = sessions[0].model.device
    positions = torch.cat([torch.arange(s.pos, s.pos + n, device=device) for s, n in zip(sessions, sizes,
                                                                                        strict=True)])
    call = ProductionSession(sessions[0].model, None, own=range(0), rows=Batched(sessions, spans))  # no caches
    try:
        for s, p in zip(sessions, prefill, strict=True):
            s.in_prefill = p
            if s.rec is not None:
                s.rec.step = s.calls
        with counting(sessions[0].counts):
            logits = call._forward(torch.cat(checked), positions)
    finally:
        for s in sessions:
            s.in_prefill = False
    for s, n in zip(sessions, sizes, strict=True):
        s.pos += n
        s.calls += 1
    return [logits[sl] for sl in spans]
