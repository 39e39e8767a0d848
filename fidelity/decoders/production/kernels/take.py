"""Copy one slice of a stacked tensor chosen by a device-side index (graph decode's expert weights): the index
stays on the GPU, so the copy can sit inside a captured CUDA graph, at streaming-copy speed (torch's
``index_select`` of one large slice runs at about half the HBM bandwidth on the H200)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program


@triton.jit
def _take_kernel(src_ptr, idx_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.load(idx_ptr).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + i * n + offs, mask=mask), mask=mask)


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
        _take_kernel[(triton.cdiv(n, BLOCK),)](stack, index, out, n, BLOCK=BLOCK, num_warps=4)
    return out
