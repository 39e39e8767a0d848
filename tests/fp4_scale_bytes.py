"""Inputs of the routed FP4 expert kernels (``fp4_expert_linear`` / op ``fp4_picked_linear``, op ``grouped_expert``)
whose 1x32 e8m0 scale bytes reach the ends of the format: 0 (2^-127, an fp32 subnormal), 1 (2^-126), 127 (1),
254 (2^127) and 255 (NaN), and a check of the kernels' byte decode (``_common.e8m0_scale``) against
``formats.decode_e8m0``. Used under Triton's CPU interpreter (``tests/interpreted/``) and on a GPU (``tests/gpu/``).

The GEMV case is exact by construction: each output row reads one live 1x32 block (a few nonzero codes, the row's
byte) and the other blocks of the row hold zero codes (with random bytes, so a scale read from the wrong block
shows), x is +-{0.5, 1} x 2^t (on the e4m3 grid: the activation quantization keeps it), so every product, sum and
scaled sum is an fp32 and bf16 value: any summation order gives the emulation's bits. The byte-254 rows sit in an
expert whose codes are at most 1.5 (so 1.5 x 2^127 stays finite in the emulation's dequantized weight) and whose
slot's x is 2^-12 small (so y stays finite); the slots of the expert with the byte-0 rows read x of size 16, so
that its nonzero y are at least 2^-125: normal numbers (Triton's CPU interpreter converts fp32 subnormals to bf16
wrongly; the kernels' results are bf16).

The grouped case cannot be exact (dense random w13), so it holds the grouped kernels to the emulation's bits as the
other interpreted checks do; its byte-0 / byte-1 w2 rows have codes of at least 2 (the kernel's dequantized bf16
weight then is a normal number, for the same interpreter reason) and the slots on that expert weigh 2^10 (large h,
so y stays normal)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import e8m0_scale
from fidelity.model.formats import decode_e8m0

BF16 = torch.bfloat16
SPECIAL = (0, 1, 127, 254, 255)
LOW_BYTES = (0, 1, 2, 127, 100, 160)  # expert 0 (x of size 1): y = S x 2^(b - 127) stays finite
HIGH_BYTES = (254, 253, 250, 127)  # expert 1 (x of size 2^-12, codes <= 1.5)
NAN_BYTES = (255, 127)  # expert 2: every other row NaN


@triton.jit
def _decode_kernel(b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e8m0_scale(tl.load(b_ptr + offs)))


def kernel_decode(b: torch.Tensor) -> torch.Tensor:
    """fp32 [N] = ``e8m0_scale`` of the bytes b (uint8 [N], N a power of two) in a Triton kernel on b's device."""
    out = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    _decode_kernel[(1,)](b, out, N=b.numel())
    return out


def decode_differs(device: torch.device | str = "cpu") -> str:
    """'' when the kernel decodes every byte 0..255 to ``decode_e8m0``'s fp32 bits (NaN's bits included)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    want, got = decode_e8m0(b).view(torch.int32), kernel_decode(b).view(torch.int32)
    bad = (want != got).nonzero().flatten().tolist()
    return "" if not bad else f"bytes {bad[:8]} decode to {[hex(v) for v in got[bad[:8]].tolist()]}, " \
                              f"formats gives {[hex(v) for v in want[bad[:8]].tolist()]}"


def _live_block_weight(g: torch.Generator, rows: int, k: int, row_bytes: tuple[int, ...], max_mag: int,
                       min_mag: int = 1, live: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's FP4 weight [rows, k] as stored: (packed codes uint8 [rows, k/2], e8m0 bytes uint8 [rows, k/32]).
    Row r's codes are zero but for ``live`` of them (magnitude index min_mag..max_mag, random signs) in one random
    1x32 block, whose byte is ``row_bytes[r % len]``; the row's other blocks get random bytes 1..254."""
    blocks = k // 32
    codes = torch.zeros(rows, k, dtype=torch.uint8)
    scales = torch.randint(1, 255, (rows, blocks), generator=g).to(torch.uint8)
    for r in range(rows):
        b = int(torch.randint(0, blocks, (1,), generator=g))
        cols = 32 * b + torch.randperm(32, generator=g)[:live]
        mag = torch.randint(min_mag, max_mag + 1, (live,), generator=g)
        codes[r, cols] = (mag + 8 * torch.randint(0, 2, (live,), generator=g)).to(torch.uint8)
        scales[r, b] = row_bytes[r % len(row_bytes)]
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales


def gemv_case(seed: int = 0, n: int = 40, k: int = 256) -> dict:
    """``fp4_picked_linear``'s inputs (x bf16 [6, k], experts [6], packed [3, n, k/2], scales uint8 [3, n, k/32]):
    expert 0 has rows of bytes 0, 1, 2, 127, 100, 160 (slots of x size 16), expert 1 rows of bytes 254, 253, 250, 127
    (codes <= 1.5, slots of x size 2^-12), expert 2 every other row 255 (NaN). n = 40 leaves masked rows in the
    kernels' 16-row blocks."""
    g = torch.Generator().manual_seed(seed)
    weights = [_live_block_weight(g, n, k, LOW_BYTES, 7), _live_block_weight(g, n, k, HIGH_BYTES, 3),
               _live_block_weight(g, n, k, NAN_BYTES, 7)]
    experts = torch.tensor([0, 1, 2, 0, 1, 2])
    sizes = torch.tensor([16.0, 2.0**-12, 1.0, 16.0, 2.0**-12, 1.0])[:, None]
    x = torch.where(torch.rand(6, k, generator=g) < 0.5, 0.5, 1.0) * (1 - 2 * torch.randint(0, 2, (6, k), generator=g))
    return {"x": (x * sizes).to(BF16), "experts": experts, "packed": torch.stack([w[0] for w in weights]),
            "scales": torch.stack([w[1] for w in weights])}


def gemv_case_lost(y: torch.Tensor) -> str:
    """'' when y [6, n] (``gemv_case``'s emulated result) has what makes the case telling: its byte-0 rows (expert
    0, slots 0 and 3) nonzero, its byte-254 rows (expert 1, slots 1 and 4) past 2^100 and finite, NaN exactly on
    expert 2's byte-255 rows (slots 2 and 5)."""
    lost = []
    if not y[[0, 3], 0::len(LOW_BYTES)].ne(0).any():
        lost.append("byte-0 rows all zero")
    big = y[[1, 4], 0::len(HIGH_BYTES)].float()
    if not (big.isfinite().all() and big.abs().gt(2.0**100).any()):
        lost.append("byte-254 rows not large and finite")
    nan = torch.zeros(y.shape, dtype=torch.bool)
    nan[[2, 5], 0::len(NAN_BYTES)] = True
    if not torch.equal(y.isnan().cpu(), nan):
        lost.append("NaN elsewhere than on the byte-255 rows")
    return ", ".join(lost)


def grouped_case(seed: int = 0, n: int = 12, dim: int = 256, f: int = 128) -> dict:
    """``grouped_expert``'s inputs (act and quantized left to the caller) with the ends of the scale bytes: w2 of
    expert 0 with rows of bytes 0, 1, 2, 127, 100, 160 (codes >= 2; its slots weigh 2^10), w2 of expert 1
    with rows of bytes 254, 253, 250, 127 (codes <= 1.5; the slots routed to it weigh 2^-14, so h and y stay
    finite), w2 of expert 2 with NaN rows (every other one), w13 of expert 3 with a byte-255 block (NaN g: its slots'
    y all NaN), w13 of expert 0 with rows of bytes 0 and 1. Tokens pick two distinct experts of the four."""
    from fidelity.testing.strategies import _fp4_stored

    g = torch.Generator().manual_seed(seed)
    w13, s13 = _fp4_stored(g, 4, 2 * f, dim, 4.0)
    w2, s2 = _fp4_stored(g, 4, dim, f, 1.0)
    for e, (row_bytes, min_mag, max_mag) in enumerate(((LOW_BYTES, 4, 7), (HIGH_BYTES, 1, 3), (NAN_BYTES, 1, 7))):
        w2[e], s2[e] = _live_block_weight(g, dim, f, row_bytes, max_mag, min_mag)
    s13[0, :8], s13[0, f:f + 8] = 0, 1  # g rows and u rows of tiny scale
    s13[3, 5, 2] = 255
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)])
    weights = torch.where(experts == 1, 2.0**-14, 0.05 + 0.95 * torch.rand(n, 2, generator=g))
    weights = torch.where(experts == 0, 1024.0, weights)
    return {"x": (torch.randn(n, dim, generator=g) * 2).to(BF16), "weights": weights, "experts": experts,
            "w13": w13, "w13_scales": s13, "w2": w2, "w2_scales": s2, "limit": 10.0}


def grouped_case_lost(y: torch.Tensor, experts: torch.Tensor, nan_h: bool = True) -> str:
    """'' when y [n, 2, dim] (``grouped_case``'s emulated result) has what makes the case telling: on expert 0's
    slots the byte-0 columns nonzero somewhere and no bf16 subnormal in the byte-0 / 1 / 2 columns, on expert 1's
    the byte-254 columns past 2^100 and finite, NaN on expert 2's byte-255 columns, and on expert 3's slots (NaN g)
    NaN in every column where ``nan_h`` (the h quantizer keeps NaN, or act "bf16"), else none decided here; NaN
    nowhere else."""
    y, experts, lost = y.float().cpu(), experts.cpu(), []
    low = y[experts == 0][:, : len(LOW_BYTES) * (y.shape[-1] // len(LOW_BYTES))].unflatten(-1, (-1, len(LOW_BYTES)))
    if not low[..., 0].ne(0).any():
        lost.append("byte-0 columns all zero")
    if (low[..., :3].ne(0) & low[..., :3].abs().lt(2.0**-126)).any():
        lost.append("bf16 subnormals in the byte-0 / 1 / 2 columns")
    big = y[experts == 1][:, 0::len(HIGH_BYTES)]
    if not (big.isfinite().all() and big.abs().gt(2.0**100).any()):
        lost.append("byte-254 columns not large and finite")
    nan = torch.zeros(y.shape, dtype=torch.bool)
    nan[..., 0::len(NAN_BYTES)] = (experts == 2)[..., None]
    nan |= (experts == 3)[..., None]
    decided = torch.ones_like(nan) if nan_h else (experts != 3)[..., None].expand_as(nan)
    if not torch.equal(y.isnan()[decided], nan[decided]):
        lost.append("NaN elsewhere than on the byte-255 columns and expert 3's slots")
    return ", ".join(lost)


def nan_aware_differs(want: torch.Tensor, got: torch.Tensor) -> str:
    """'' when got has want's bits, NaN where want has NaN (whatever the NaN's sign and payload)."""
    nan = want.isnan()
    if not torch.equal(nan, got.isnan()):
        return f"NaN at {int(nan.sum())} elements, the kernel at {int(got.isnan().sum())}"
    differ = int((want.view(torch.int16) != got.view(torch.int16))[~nan].sum())
    return "" if differ == 0 else f"{differ} of {int((~nan).sum())} non-NaN elements differ"
