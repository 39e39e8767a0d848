"""The MoE output of a few tokens in one launch: each token's routed expert outputs added in fp32 in slot order
(ascending expert id), then the shared expert's, rounded once to bf16, the order ``MoE.forward`` adds them
in (so the bits are the torch loop's). Replaces that loop's eleven small kernels per decode step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import PDL_LAUNCH, UNSUPPORTED, bf16_rne, wait_for_previous_kernel


@triton.jit(do_not_specialize=["dim"])
def _moe_sum_kernel(out_ptr, shared_ptr, y_ptr, dim, K: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < dim
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        y += tl.load(out_ptr + (row * K + j) * dim + cols, mask=ok, other=0.0).to(tl.float32)
    y += tl.load(shared_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * dim + cols, bf16_rne(y).to(tl.bfloat16), mask=ok)


def takes_moe_sum(out: torch.Tensor, shared: torch.Tensor) -> str | None:
    """None when :func:`moe_sum` takes these inputs (op ``moe_sum``): CUDA out bf16 [n, k, dim], shared bf16
    [n, dim] on its device."""
    ok = out.is_cuda and out.dim() == 3 and out.dtype == shared.dtype == torch.bfloat16
    return None if ok and shared.shape == (out.shape[0], out.shape[2]) and shared.device == out.device else UNSUPPORTED


def moe_sum(out: torch.Tensor, shared: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """out bf16 [n, k, dim] (routed slot outputs, ascending expert id), shared bf16 [n, dim] -> bf16 [n, dim]."""
    n, k, dim = out.shape
    if shared.shape != (n, dim) or out.dtype != torch.bfloat16 or shared.dtype != torch.bfloat16:
        raise ValueError(f"moe_sum: expected out bf16 [n, k, dim] and shared bf16 [n, dim], found out "
                         f"{out.dtype} {tuple(out.shape)}, shared {shared.dtype} {tuple(shared.shape)}")
    y = torch.empty((n, dim), dtype=torch.bfloat16, device=out.device)
    if n and dim:
        _moe_sum_kernel[(n, triton.cdiv(dim, block))](out.contiguous(), shared.contiguous(), y, dim, K=k,
                                                     BLOCK=block, num_warps=4, **PDL_LAUNCH)
    return y
