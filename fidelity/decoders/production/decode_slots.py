"""The rows one graph decode step attends, from the position held on the device: the window ring buffer's slots
(oldest first, -1 where the window is not full yet), then the compressed entries it sees (the indexer's picks below
the causal limit ``(t+1)//4`` on CSA layers, every entry ``j < (t+1)//ratio`` on HCA layers), as the gather
indices into the layer's KV store (a -1 slot reads row 0, which the attention never uses) and the attention's
local indices (the row in the gathered buffer, -1 where none).

:func:`decode_slots` gives what ``Attention.decode`` builds from ``shapes.window_idx_on_device`` and the
masked picks in about twenty small torch kernels; :func:`decode_idx` gives the same slots as indices into the store
itself, for an attention that reads the store's rows where they are; :func:`mask_past` hides the compressed entries
past the causal limit from the indexer's scores. Each is an op of the op table (``registry.OPS``): the emulation in
``ops``, one Triton launch on a GPU (``kernels/decode_slots.py``), the same integers either way (tests).
"""

from __future__ import annotations

import torch

from fidelity.decoders.production.registry import implementation


def decode_slots(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                 n_compressed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Op ``decode_slots`` (``ops.decode_slots``) for ``pos``'s device."""
    return implementation("decode_slots", pos.device)(pos, picks, window, ratio, n_compressed)


def decode_idx(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
               n_compressed: int) -> torch.Tensor:
    """Op ``decode_idx`` (``ops.decode_idx``) for ``pos``'s device."""
    return implementation("decode_idx", pos.device)(pos, picks, window, ratio, n_compressed)


def mask_past(scores: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Op ``mask_past`` (``ops.mask_past``) for the scores' device: in place on a GPU with the kernels (one launch),
    a new tensor otherwise; use the result."""
    return implementation("mask_past", scores.device)(scores, pos, ratio)
