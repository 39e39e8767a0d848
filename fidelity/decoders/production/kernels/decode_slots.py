"""``decode_slots`` in one launch: the window ring's slots and the visible compressed entries of a graph decode
step, written as gather rows and local attention indices, or as the attention's indices into the store
(``decode_idx_cuda``); ``mask_past``: the indexer scores past the causal limit
set to -inf in place (ops ``decode_slots``, ``decode_idx``, ``mask_past`` of the op table)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import PDL_LAUNCH, UNSUPPORTED, next_pow2, wait_for_previous_kernel

BLOCK = 1024  # slots per program


@triton.jit(do_not_specialize=["window", "n_comp", "ratio"])
def _decode_slots_kernel(pos_ptr, picks_ptr, rows_ptr, local_ptr, window, n_comp, ratio, BLOCK: tl.constexpr,
                         PICKS: tl.constexpr, DIRECT: tl.constexpr):
    """Slot s < window: the ring slot (oldest first) or -1; slot window + c: entry c (PICKS: picks[c]) if visible,
    as a store row (+ window), else -1. rows = max(slot, 0); local = s where slot >= 0, else -1. DIRECT: local
    (int32) = the slot itself, rows not written."""
    wait_for_previous_kernel()
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr)
    in_window = s < window
    ring = (s + pos % window + 1) % window
    win_slot = tl.where(pos >= window - 1, ring, tl.where(s <= pos, s, -1))
    c = s - window
    in_comp = (c >= 0) & (c < n_comp)
    if PICKS:
        entry = tl.load(picks_ptr + c, mask=in_comp, other=-1).to(tl.int64)
    else:
        entry = c.to(tl.int64)
    limit = (pos + 1) // ratio
    comp_slot = tl.where((entry >= limit) | (entry < 0), -1, entry + window)
    slot = tl.where(in_window, win_slot, comp_slot)
    ok = s < window + n_comp
    if DIRECT:
        tl.store(local_ptr + s, slot.to(tl.int32), mask=ok)
    else:
        tl.store(rows_ptr + s, tl.maximum(slot, 0), mask=ok)
        tl.store(local_ptr + s, tl.where(slot >= 0, s.to(tl.int64), -1), mask=ok)


def takes_decode_slots(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                       n_compressed: int) -> str | None:
    """None when :func:`decode_slots_cuda` takes these inputs (op ``decode_slots``): a one-element CUDA position,
    and on CSA layers (ratio 4) the picks on its device."""
    ok = pos.is_cuda and pos.numel() == 1 and window >= 1
    return None if ok and (ratio != 4 or (picks is not None and picks.device == pos.device)) else UNSUPPORTED


def takes_decode_idx(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                     n_compressed: int) -> str | None:
    """As :func:`takes_decode_slots` (op ``decode_idx``)."""
    return takes_decode_slots(pos, picks, window, ratio, n_compressed)


def decode_slots_cuda(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                      n_compressed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and integers as ``ops.decode_slots`` (pos int64 [1] on the GPU)."""
    return _launch(pos, picks, window, ratio, n_compressed, direct=False)


def decode_idx_cuda(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                    n_compressed: int) -> torch.Tensor:
    """Same signature and integers as ``ops.decode_idx`` (pos int64 [1] on the GPU): int32 [1, w + c]."""
    return _launch(pos, picks, window, ratio, n_compressed, direct=True)[1]


def _launch(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int, n_compressed: int,
            direct: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather rows int64 [w + c], local indices int64 [1, w + c]); ``direct``: (the same int32 [1, w + c] twice,
    the store indices)."""
    n_comp = (picks.shape[-1] if ratio == 4 else n_compressed) if ratio else 0
    total = window + n_comp
    local = torch.empty((1, total), dtype=torch.int32 if direct else torch.int64, device=pos.device)
    rows = local if direct else torch.empty(total, dtype=torch.int64, device=pos.device)
    block = min(BLOCK, next_pow2(total))
    _decode_slots_kernel[(triton.cdiv(total, block),)](pos, picks.contiguous() if ratio == 4 else rows, rows, local,
                                                       window, n_comp, max(ratio, 1), BLOCK=block, PICKS=ratio == 4,
                                                       DIRECT=direct, num_warps=4, **PDL_LAUNCH)
    return rows, local


@triton.jit
def _mask_past_kernel(s_ptr, pos_ptr, n, ratio, BLOCK: tl.constexpr):
    wait_for_previous_kernel()
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    limit = (tl.load(pos_ptr) + 1) // ratio
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + j, minus_inf, mask=(j < n) & (j >= limit))


def takes_mask_past(scores: torch.Tensor, pos: torch.Tensor, ratio: int) -> str | None:
    """None when :func:`mask_past_cuda` takes these inputs (op ``mask_past``): contiguous CUDA scores [1, n], a
    one-element position on their device."""
    ok = scores.is_cuda and scores.dim() == 2 and scores.shape[0] == 1 and scores.is_contiguous()
    return None if ok and pos.numel() == 1 and pos.device == scores.device else UNSUPPORTED


def mask_past_cuda(scores: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """``ops.mask_past`` in place on contiguous scores [1, n]; returns them."""
    n = scores.shape[-1]
    if n:
        _mask_past_kernel[(triton.cdiv(n, BLOCK),)](scores, pos, n, ratio, BLOCK=BLOCK, num_warps=4, **PDL_LAUNCH)
    return scores
