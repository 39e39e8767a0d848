"""How a production session runs its calls, as three small policies the session is given (the layers themselves
are the same objects whatever the policies):

* ``decode``: how a decode token's step runs and where its window slot, window indices, compressed entries,
  indexer picks and routed experts come from, and how its sites are recorded. :class:`EagerDecode` reads the
  position on the host; ``graph_decode.GraphDecode`` keeps it on the device with fixed shapes (CUDA graphs).
* ``rows``: whose caches the call's rows attend. :class:`OneSequence`: the session's; ``batch.Batched``: each
  sequence of a batched call its own slice of rows.
* ``stage``: which layers the session runs, where the streams come from and where they go. :class:`WholeModel`:
  every layer, from the embedding to the logits; ``pipeline.PipelineStage``: a range of layers between
  processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fidelity.decoders.production.shapes import window_decode_idx
from fidelity.decoders.production.sublayer import Session
from fidelity.model.sites import record

if TYPE_CHECKING:
    from fidelity.decoders.production.attention import Attention
    from fidelity.decoders.production.compressor import Compressor
    from fidelity.decoders.production.moe import MoE


class EagerDecode:
    """A decode step at the session's host position ``s.pos``: sizes and branches read it on the host."""

    def step(self, s: Session, ids: torch.Tensor) -> torch.Tensor:
        """One checked decode token ids [1] (on the host) -> fp32 logits [1, vocab]; advances ``s``."""
        return s._run(ids.to(s.model.device), torch.tensor([s.pos], device=s.model.device))

    def emit(self, s: Session, template: str, layer: int | None, tensor) -> None:
        """A site to the session's recorder if it wants it (a callable evaluated only then)."""
        record(s.rec, template, layer, tensor)

    def window_slot(self, s: Session, win: int) -> slice:
        """The ring-buffer slot of the decode token."""
        return slice(s.pos % win, s.pos % win + 1)

    def window_idx(self, s: Session, win: int, device: torch.device) -> torch.Tensor:
        """The decode token's window ring slots [1, win], oldest first, -1 where the window is not full yet."""
        return window_decode_idx(s.pos, win, device)

    def compressed(self, attn: Attention, s: Session, x: torch.Tensor, qr,
                   positions: torch.Tensor) -> torch.Tensor:
        """The compressed entries the decode token sees [1, k] (``Attention.compressed``)."""
        return attn.compressed(s, x, qr, positions)

    def compress(self, compressor: Compressor, s: Session, x: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor | None:
        """The decode token through a compressor: the entry it completes, written, else None."""
        return compressor.decode(s, x)

    def attend(self, attn: Attention, s: Session, x, qr, q, kv, positions) -> torch.Tensor:
        """The decode token's attention core (``Attention.decode``)."""
        return attn.decode(s, x, qr, q, kv, positions)

    def moe(self, moe: MoE, s: Session, h, ids: torch.Tensor) -> torch.Tensor:
        """The MoE of the call's rows (``MoE.forward``: expert ids read on the host)."""
        return moe.forward(s, h, ids)


class OneSequence:
    """The call's rows are one sequence's: its session's caches."""

    def emit(self, s: Session, template: str, layer: int | None, tensor) -> None:
        s.decode.emit(s, template, layer, tensor)

    def core(self, attn: Attention, s: Session, x, qr, q, kv, positions) -> torch.Tensor:
        return attn.core(s, x, qr, q, kv, positions)


class WholeModel:
    """Every layer in this process: the embedding in, the logits out."""

    head_rows_free = True  # a prefill whose caller reads the last row may run the head on fewer rows

    def layers(self, s: Session) -> range:
        return range(s.cfg.n_layers)

    def enter(self, s: Session, ids: torch.Tensor) -> torch.Tensor:
        return s.embed(ids)

    def leave(self, s: Session, x: torch.Tensor) -> torch.Tensor:
        return s.head(x)


EAGER, ONE_SEQUENCE, WHOLE_MODEL = EagerDecode(), OneSequence(), WholeModel()
