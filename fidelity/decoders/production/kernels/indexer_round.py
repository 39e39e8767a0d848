"""The indexer's query / key rounding in one launch (spec §3 ``rotate_activation`` then ``fp4_act_quant``):
Walsh-Hadamard rotation of each row, then FP4 e2m1 quantize-dequantize in 1x32 blocks with ue8m0 scales.

:func:`indexer_round_cuda` equals ``ops.indexer_round(x, "fp4", rotate)`` bit for bit (signed zeros included):
the rotation takes the emulation's butterflies (each output of a stage is one fp32 add or subtract of the same
two values, so the order cannot differ), the n^-0.5 multiply and bf16 store follow, then the scale is built from
the bits of ``max(amax, 6 * 2^-126) * fp32(1/6)`` as ``formats.ue8m0_scale`` builds it and each value is rounded
to the e2m1 grid with ties to even. One launch replaces the emulation's ~80 element-wise kernels per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    UNSUPPORTED,
    bf16_rne,
    max_nan,
    on_device,
    wait_for_previous_kernel,
)


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """One Hadamard stage over the last dim of x fp32 [ROWS, D]: (a, b) at columns (i, i + H) of each 2H-block
    -> (a + b, a - b)."""
    if H < D:
        pairs = tl.permute(tl.reshape(x, [ROWS, D // (2 * H), 2, H]), [0, 1, 3, 2])  # [.., H, 2]: (a, b)
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])
    return x


@triton.jit
def _hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr):
    """Sylvester-order butterflies over the last dim (D <= 512), stage by stage as ``formats.hadamard``."""
    x = _butterfly(x, ROWS, D, 1)
    x = _butterfly(x, ROWS, D, 2)
    x = _butterfly(x, ROWS, D, 4)
    x = _butterfly(x, ROWS, D, 8)
    x = _butterfly(x, ROWS, D, 16)
    x = _butterfly(x, ROWS, D, 32)
    x = _butterfly(x, ROWS, D, 64)
    x = _butterfly(x, ROWS, D, 128)
    return _butterfly(x, ROWS, D, 256)


@triton.jit
def _fp4_blocks(y):
    """``fake_quant_fp4`` of the rows of y fp32 [NB, 32] (one block per row) -> fp32 values code x scale."""
    amax = tl.reduce(tl.abs(y), 1, max_nan)
    v = tl.maximum(amax, 6.0 * 2.0**-126) * 0.16666666666666666  # formats.FP4_AMAX_FLOOR, fp32(1/6)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = ((tl.maximum(tl.minimum(e, 127), -126) + 127) << 23).to(tl.float32, bitcast=True)
    s = tl.where(e > 127, float("inf"), s)
    s = tl.where(v != v, float("nan"), s)
    q = tl.math.div_rn(y, s[:, None])  # exact: s is a power of two
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -6.0), 6.0))  # saturate, NaN kept
    qb = q.to(tl.int32, bitcast=True)
    e2 = tl.maximum(((qb >> 23) & 0xFF) - 127, 0)  # floor(log2 |q|), at least the e2m1 min normal exponent 0
    up = ((128 - e2) << 23).to(tl.float32, bitcast=True)  # 2^(1 - e2): one fraction bit at |q|'s exponent
    down = ((126 + e2) << 23).to(tl.float32, bitcast=True)  # 2^(e2 - 1)
    m = tl.abs(q) * up
    r = ((m + 12582912.0) - 12582912.0) * down  # + 1.5 * 2^23 rounds 0 <= m < 4 to an integer, ties to even
    r = (r.to(tl.int32, bitcast=True) | (qb & -2147483648)).to(tl.float32, bitcast=True)  # q's sign, -0 too
    return r * s[:, None]


@triton.jit(do_not_specialize=["n_rows"])
def _indexer_round_kernel(x_ptr, y_ptr, n_rows, stride_x, stride_y, ROWS: tl.constexpr, D: tl.constexpr,
                          SCALE: tl.constexpr, ROTATE: tl.constexpr):
    wait_for_previous_kernel()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    mask = (rows < n_rows)[:, None]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x = bf16_rne(_hadamard_rows(x, ROWS, D) * SCALE)
    y = tl.reshape(_fp4_blocks(tl.reshape(x, [ROWS * D // 32, 32])), [ROWS, D])
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(tl.bfloat16), mask=mask)


def takes_indexer_round(x: torch.Tensor, fmt: str, rotate: bool) -> str | None:
    """Why :func:`indexer_round_cuda` cannot take these inputs (None: it can): fmt "fp4", bf16 x [..., d], d a
    power of two in 32..512."""
    if fmt != "fp4" or not on_device(x) or x.dtype != torch.bfloat16 or x.shape[-1] not in (32, 64, 128, 256, 512):
        return UNSUPPORTED
    return None


def indexer_round_cuda(x: torch.Tensor, fmt: str, rotate: bool, *, rows: int = 4, num_warps: int = 4) -> torch.Tensor:
    """Same signature and result as ``ops.indexer_round`` for bf16 x [..., d] and fmt "fp4" (bit-exact)."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _indexer_round_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, y, x2.shape[0], x2.stride(0), y.stride(0), ROWS=rows, D=d,
            SCALE=float(torch.tensor(d**-0.5, dtype=torch.float32)), ROTATE=rotate, num_warps=num_warps, **PDL_LAUNCH)
    return y.reshape(x.shape)
