"""Copies addressed by device-side indices, so that they sit inside a captured CUDA graph: :func:`take` copies one
slice of a stacked tensor (graph decode's expert weights) at streaming-copy speed (torch's ``index_select`` of one
large slice runs at about half the HBM bandwidth on the H200); :func:`put_at_block_end` writes one row of a cache
where the device-side position completes a block (graph decode's compressed entries), or at its ring slot (the
window's row), one launch instead of torch's position arithmetic, gather, ``where`` and scatter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import PDL_LAUNCH, UNSUPPORTED, on_device, wait_for_previous_kernel

BLOCK = 4096  # elements per program


@triton.jit
def _take_kernel(src_ptr, idx_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    wait_for_previous_kernel()
    i = tl.load(idx_ptr).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + i * n + offs, mask=mask), mask=mask)


def takes_take(stack: torch.Tensor, index: torch.Tensor) -> str | None:
    """None when :func:`take` takes these inputs (op ``take``): a contiguous CUDA stack, a one-element index on its
    device."""
    ok = stack.is_cuda and stack.is_contiguous() and index.numel() == 1 and index.device == stack.device
    return None if ok else UNSUPPORTED


def take(stack: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``stack[index[0]]`` as a new contiguous tensor: stack [E, ...] contiguous on CUDA, index int [1] on the same
    device (in range: it is not checked, as that would read it on the host)."""
    if not stack.is_cuda or not stack.is_contiguous() or index.numel() != 1 or index.device != stack.device:
        raise ValueError(f"take: expected a contiguous CUDA stack and a one-element index on its device, found "
                         f"stack {stack.device} contiguous={stack.is_contiguous()}, index {index.device} "
                         f"numel={index.numel()}")
    out = torch.empty(stack.shape[1:], dtype=stack.dtype, device=stack.device)
    n = out.numel()
    if n:
        _take_kernel[(triton.cdiv(n, BLOCK),)](stack, index, out, n, BLOCK=BLOCK, num_warps=4, **PDL_LAUNCH)
    return out


@triton.jit
def _put_at_block_end_kernel(store_ptr, pos_ptr, row_ptr, n, ratio, offset, ring, BLOCK: tl.constexpr):
    wait_for_previous_kernel()
    pos = tl.load(pos_ptr).to(tl.int64)
    if pos % ratio == ratio - 1:
        slot = pos // ratio + offset
        if ring > 0:
            slot = slot % ring
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(store_ptr + slot * n + offs, tl.load(row_ptr + offs, mask=mask), mask=mask)


def takes_put_at_block_end(store: torch.Tensor, pos: torch.Tensor, ratio: int, offset: int, row: torch.Tensor,
                           ring: int = 0) -> str | None:
    """None when :func:`put_at_block_end` takes these inputs (op ``put_at_block_end``)."""
    return None if _writable(store, pos, ratio, row, ring) else UNSUPPORTED


def _writable(store: torch.Tensor, pos: torch.Tensor, ratio: int, row: torch.Tensor, ring: int) -> bool:
    return (on_device(store) and store.is_contiguous() and row.shape == (1, *store.shape[1:])
            and row.dtype == store.dtype and pos.numel() == 1 and pos.device == store.device and ratio >= 1
            and ring >= 0)


def put_at_block_end(store: torch.Tensor, pos: torch.Tensor, ratio: int, offset: int, row: torch.Tensor,
                     ring: int = 0) -> torch.Tensor:
    """``store[pos // ratio + offset] = row[0]`` where ``pos % ratio == ratio - 1`` (the token at ``pos`` completes a
    block of ``ratio``); ``ring`` > 0: at ``(pos // ratio + offset) % ring`` (ratio 1, offset 0: a window's ring
    slot ``pos % ring``). store [capacity, ...] contiguous on CUDA, row [1, ...] of its row shape and dtype, pos int
    [1] on its device (read there: the slot is not range-checked, as that would read it on the host). Returns
    store."""
    if not _writable(store, pos, ratio, row, ring):
        raise ValueError(f"put_at_block_end: expected a contiguous CUDA store, a row [1, ...] of its row shape and "
                         f"dtype, a one-element position on its device, ratio >= 1 and ring >= 0, found store "
                         f"{tuple(store.shape)} {store.dtype} on {store.device}, row {tuple(row.shape)} {row.dtype}, "
                         f"pos numel {pos.numel()} on {pos.device}, ratio {ratio}, ring {ring}")
    flat = store.view(store.shape[0], -1).view(torch.uint8)
    n = flat.shape[1]
    if n:
        _put_at_block_end_kernel[(triton.cdiv(n, BLOCK),)](flat, pos, row.contiguous().view(1, -1).view(torch.uint8),
                                                           n, ratio, offset, ring, BLOCK=BLOCK, num_warps=4,
                                                           **PDL_LAUNCH)
    return store
