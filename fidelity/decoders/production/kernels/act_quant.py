"""FP8 activation quantization in Triton (spec §3 ``act_quant``, ue8m0 scales), as the production model consumes it:
quantize-dequantize in place (``formats.fake_quant_fp8``) of 1 x ``block`` blocks, one launch instead of the
torch emulation's bit-level graph.

* ``act_linear``: the FP8 GEMM input of every linear layer (1x128 blocks), then the same fp32 GEMM as
  ``ops.act_linear`` (``x_q.float() @ W^T`` -> bf16), so results equal the emulation on the same device bit for
  bit (the quantizer is bit-exact: :func:`fidelity.decoders.production.kernels._common.e4m3_blocks`).
* ``kv_round``: the in-place ``act_quant(kv[..., :448], 64)`` of the window / compressed KV rows; rope dims copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    SCALE_FLOOR_FALLBACK,
    UNSUPPORTED,
    e4m3_blocks,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
)


@triton.jit(do_not_specialize=["n_rows"])
def _fake_quant_kernel(x_ptr, y_ptr, n_rows, n_cols, n_quant, stride_x, stride_y, NB: tl.constexpr,
                       B: tl.constexpr, ROWS: tl.constexpr):
    """Rows as [ROWS, NB, B] blocks: blocks below column ``n_quant`` are quantized-dequantized, the rest copied."""
    wait_for_previous_kernel()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.arange(0, NB)
    cols = blk[:, None] * B + tl.arange(0, B)[None, :]
    mask = (rows < n_rows)[:, None, None] & (cols < n_cols)[None, :, :]
    x = tl.load(x_ptr + rows[:, None, None] * stride_x + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    codes, _, s = e4m3_blocks(tl.reshape(x, [ROWS * NB, B]))
    deq = tl.reshape(codes.to(tl.float32) * s[:, None], [ROWS, NB, B])
    y = tl.where((blk * B < n_quant)[None, :, None], deq, x)
    tl.store(y_ptr + rows[:, None, None] * stride_y + cols[None, :, :], y.to(tl.bfloat16), mask=mask)


def fake_quant_fp8(x: torch.Tensor, block: int = 128, n_quant: int | None = None, *, rows: int = 1,
                   num_warps: int = 4) -> torch.Tensor:
    """``formats.fake_quant_fp8(x[..., :n_quant], block)`` with the remaining columns copied, for bf16 x [..., d]
    on CUDA (``n_quant`` defaults to d and must be a multiple of ``block``)."""
    d = x.shape[-1]
    n_quant = d if n_quant is None else n_quant
    if x.dtype != torch.bfloat16 or n_quant % block or n_quant > d or block not in (32, 64, 128):
        raise ValueError(f"x: expected bf16 [..., d] with n_quant ({n_quant}) a multiple of block ({block}) <= d "
                         f"({d}), found {x.dtype}")
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _fake_quant_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, y, x2.shape[0], d, n_quant, x2.stride(0), y.stride(0), NB=next_pow2(triton.cdiv(d, block)),
            B=block, ROWS=rows, num_warps=num_warps, **PDL_LAUNCH)
    return y.reshape(x.shape)


def takes_act_linear(x: torch.Tensor, weight: torch.Tensor, act: str = "fp8") -> str | None:
    """Why :func:`act_linear_cuda` cannot take these inputs (None: it can): act "fp8", bf16 x [..., 128 k]."""
    if act != "fp8" or not on_device(x) or x.dtype != torch.bfloat16 or x.shape[-1] % 128:
        return UNSUPPORTED
    return None


def act_linear_cuda(x: torch.Tensor, weight: torch.Tensor, act: str = "fp8") -> torch.Tensor:
    """Same signature and result as ``ops.act_linear``: x bf16 [n, k] quantized e4m3 1x128 in one launch (``act``
    "fp8"; "bf16" multiplies x as given), then ``x_q.float() @ W^T`` -> bf16 [n, m]."""
    xq = fake_quant_fp8(x, 128) if act == "fp8" else x
    return (xq.float() @ weight.float().T).to(torch.bfloat16)


def takes_kv_round(kv: torch.Tensor, rope_dims: int, fmt: str, scale_floor: str = "amax") -> str | None:
    """Why :func:`kv_round_cuda` cannot take these inputs (None: it can): fmt "fp8", bf16 kv with 64 k nope dims,
    the official scale rule (``scale_floor`` "amax"; FlashMLA's "scale" runs the emulation, and says so)."""
    if scale_floor != "amax":
        return SCALE_FLOOR_FALLBACK
    nope = kv.shape[-1] - rope_dims
    if fmt != "fp8" or not on_device(kv) or kv.dtype != torch.bfloat16 or nope % 64 or nope < 0:
        return UNSUPPORTED
    return None


def kv_round_cuda(kv: torch.Tensor, rope_dims: int, fmt: str, scale_floor: str = "amax") -> torch.Tensor:
    """Same signature and result as ``ops.kv_round`` (bit-exact): kv bf16 [n, hd], nope dims rounded 1x64 e4m3
    with the official scale rule (``takes_kv_round`` refuses another ``scale_floor``)."""
    if scale_floor != "amax":
        raise ValueError(f"kv_round_cuda: implements scale_floor 'amax' only, found {scale_floor!r}")
    return fake_quant_fp8(kv, 64, kv.shape[-1] - rope_dims, num_warps=2)
