"""The rows one graph decode step attends, from the position held on the device: the window ring buffer's slots
(oldest first, -1 where the window is not full yet), then the compressed entries it sees (the indexer's picks below
the causal limit ``(t+1)//4`` on CSA layers, every entry ``j < (t+1)//ratio`` on HCA layers), as the gather
indices into the layer's KV store (a -1 slot reads row 0, which the attention never uses) and the attention's
local indices (the row in the gathered buffer, -1 where none).

:func:`decode_slots` gives what ``Attention.decode`` builds from ``shapes.window_idx_on_device`` and the
masked picks in about twenty small torch kernels: here in torch on the CPU, one Triton launch on a GPU
(``kernels/decode_slots.py``), the same integers either way (tests); :func:`decode_idx` gives the same slots as
indices into the store itself, for an attention that reads the store's rows where they are. :func:`mask_past`
hides the compressed entries past the causal limit from the indexer's scores, likewise.
"""

from __future__ import annotations

import torch

from fidelity.decoders.production import kernels


def _slots(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
           n_compressed: int) -> torch.Tensor:
    """The store rows of the step's window slots, then its compressed entries, -1 where none: int64 [w + c]."""
    j = torch.arange(window, device=pos.device)
    ring = (j + pos % window + 1) % window
    rows = [torch.where(pos >= window - 1, ring, torch.where(j <= pos, j, -1))]
    if ratio:
        limit = (pos + 1) // ratio
        comp = picks.flatten().long() if ratio == 4 else torch.arange(n_compressed, device=pos.device)
        rows.append(torch.where((comp >= limit) | (comp < 0), -1, comp + window))
    return torch.cat(rows)


def decode_slots_reference(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                           n_compressed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pos int64 [1]; picks int [1, k] (CSA: the indexer's top-k, before the causal limit) or None -> (gather rows
    int64 [w + c], local indices int64 [1, w + c]), c = k (CSA), ``n_compressed`` (HCA) or 0 (window only)."""
    slots = _slots(pos, picks, window, ratio, n_compressed)
    local = torch.where(slots >= 0, torch.arange(len(slots), device=pos.device), -1)
    return slots.clamp(min=0), local[None]


def decode_idx_reference(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                         n_compressed: int) -> torch.Tensor:
    """The same slots as the attention's indices into the layer's store itself (spec §4 attention step 5: the
    decode cache [window | compressed], -1 where none): int32 [1, w + c], nothing gathered."""
    return _slots(pos, picks, window, ratio, n_compressed).to(torch.int32)[None]


def decode_slots(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                 n_compressed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_slots_reference` in one launch on a GPU with the kernels available, else the reference."""
    if pos.is_cuda and kernels.available():
        from fidelity.decoders.production.kernels.decode_slots import decode_slots_cuda

        return decode_slots_cuda(pos, picks, window, ratio, n_compressed)
    return decode_slots_reference(pos, picks, window, ratio, n_compressed)


def decode_idx(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
               n_compressed: int) -> torch.Tensor:
    """:func:`decode_idx_reference` in one launch on a GPU with the kernels available, else the reference."""
    if pos.is_cuda and kernels.available():
        from fidelity.decoders.production.kernels.decode_slots import decode_idx_cuda

        return decode_idx_cuda(pos, picks, window, ratio, n_compressed)
    return decode_idx_reference(pos, picks, window, ratio, n_compressed)


def mask_past(scores: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """scores [1, n] with the entries a query at position ``pos`` (int64 [1], on the device) may not see,
    ``j >= (pos + 1) // ratio``, set to -inf (in place on a GPU with the kernels: one launch; a new tensor here)."""
    if scores.is_cuda and kernels.available() and scores.shape[0] == 1 and scores.is_contiguous():
        from fidelity.decoders.production.kernels.decode_slots import mask_past_cuda

        return mask_past_cuda(scores, pos, ratio)
    return scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device)[None] >= (pos + 1) // ratio,
                              float("-inf"))
