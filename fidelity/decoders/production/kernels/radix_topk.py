"""Exact top-k of index scores by radix selection (Triton): the picks of a stable descending sort of each row,
without sorting the row.

Each score is mapped to an unsigned integer of the same order (bf16 -> 16 bits, fp32 -> 32 bits; -0.0 folded
into +0.0, every NaN into one NaN above +inf: the order of :func:`fidelity.decoders.production.ops.ordered_scores`).
The k-th largest integer ``T`` is found one byte at a time: a 256-bin histogram of the top byte (pass 0), then of
the next byte among the entries whose higher bytes equal the threshold found so far, and so on. The picks are
every entry above ``T`` plus the lowest-id entries equal to ``T`` (each chunk's count of ``T``-entries comes from
the last pass's per-chunk histogram, so a chunk knows how many lower-id ties precede it). The k picks are then
sorted by one distinct int64 key each, ``(ordered score) << 32 | (2^32 - 1 - id)``: highest score first, ties to
the lower id. Launches: a zeroed per-row workspace (histograms, candidate counter), one histogram per byte, one
selection, one sort of the k picks; every launch but the last reads the scores once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    UNSUPPORTED,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
    with_overrides,
)

MAX_K = 4096  # the final sort holds next_pow2(k) int64 keys in one program
SCORE_DTYPES = (torch.bfloat16, torch.float32)  # taken as their raw bits: int16 / int32


@triton.jit
def _ordered(bits, NBYTES: tl.constexpr):
    """Raw bits (int16 / int32) -> unsigned order of the numbers (int32 / int64): -0 == +0, NaNs above +inf."""
    if NBYTES == 2:
        b = bits.to(tl.int32)  # sign-extended
        b = tl.where(b == -32768, 0, b)
        b = tl.where((b & 0x7FFF) > 0x7F80, 0x7FC0, b)
        return (b ^ ((b >> 15) & 0x7FFF)) + 32768
    else:
        b = bits.to(tl.int64)
        b = tl.where(b == -2147483648, 0, b)
        b = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, b)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)) + 2147483648


@triton.jit
def _cut(hist, k):
    """hist [256] counts, 1 <= k <= hist.sum(): (bin b holding the k-th largest entry, entries in bins above b)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    b = tl.max(tl.where(at_or_above >= k, bins, -1), 0)
    return b, tl.sum(tl.where(bins > b, hist, 0), 0)


@triton.jit
def _threshold(hist_ptr, k, PASSES: tl.constexpr, NBYTES: tl.constexpr):
    """The threshold's top ``PASSES`` bytes (as one integer, int64 for 4-byte scores) and the count of entries
    above that prefix."""
    prefix = 0
    above = 0
    for p in tl.static_range(PASSES):
        b, a = _cut(tl.load(hist_ptr + p * 256 + tl.arange(0, 256)), k - above)
        if NBYTES == 4:
            b = b.to(tl.int64)
        prefix = prefix * 256 + b
        above += a
    return prefix, above


@triton.jit
def _load_ordered(s_ptr, stride_r, n, BLOCK: tl.constexpr, NBYTES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = _ordered(tl.load(s_ptr + row * stride_r + offs, mask=mask, other=0, eviction_policy="evict_last"), NBYTES)
    return u, offs, mask


@triton.jit
def _histogram_kernel(s_ptr, stride_r, n, k, hist_ptr, chunk_ptr, n_chunks,
                      PASS: tl.constexpr, NBYTES: tl.constexpr, HIST_STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Pass PASS: histogram of byte PASS (from the top) of the entries whose higher bytes match the threshold so
    far; added to the row's histogram, and on the last pass also stored per chunk."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    hist_row = hist_ptr + row * HIST_STRIDE
    u, offs, mask = _load_ordered(s_ptr, stride_r, n, BLOCK, NBYTES)
    shift: tl.constexpr = 8 * (NBYTES - 1 - PASS)
    if PASS > 0:
        prefix, above = _threshold(hist_row, k, PASS, NBYTES)
        mask = mask & ((u >> (shift + 8)) == prefix)
    h = tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=mask)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_row + PASS * 256 + bins, h, mask=h > 0, sem="relaxed")
    if PASS == NBYTES - 1:
        tl.store(chunk_ptr + (row * n_chunks + tl.program_id(1)) * 256 + bins, h)


@triton.jit
def _select_kernel(s_ptr, stride_r, n, k, hist_ptr, chunk_ptr, n_chunks, cand_ptr, stride_c,
                   NBYTES: tl.constexpr, HIST_STRIDE: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """Writes the keys of this chunk's picks (the entries above the threshold, and its ties while the row needs
    them, in id order across chunks: only the chunk where the needed ties run out ranks its ties) to the row's
    candidate slots, claimed with one atomic per chunk."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    hist_row = hist_ptr + row * HIST_STRIDE
    t, above = _threshold(hist_row, k, NBYTES, NBYTES)
    ties_needed = k - above
    ties_at = chunk_ptr + row * n_chunks * 256 + (t & 255)
    cs = tl.arange(0, CHUNKS_P2)
    ties_before = tl.sum(tl.load(ties_at + cs * 256, mask=cs < chunk, other=0), 0)
    ties_here = tl.load(ties_at + chunk * 256)
    u, offs, mask = _load_ordered(s_ptr, stride_r, n, BLOCK, NBYTES)
    pick = mask & (u > t)
    tie = mask & (u == t)
    if ties_before + ties_here <= ties_needed:
        pick = pick | tie
    elif ties_before < ties_needed:
        tie_i = tie.to(tl.int32)
        pick = pick | (tie & (ties_before + tl.cumsum(tie_i, 0) - tie_i < ties_needed))
    pick_i = pick.to(tl.int32)
    n_picked = tl.sum(pick_i, 0)
    if n_picked > 0:
        slot = tl.atomic_add(hist_row + NBYTES * 256, n_picked, sem="relaxed") + tl.cumsum(pick_i, 0) - pick_i
        signed = u.to(tl.int64) - (1 << (8 * NBYTES - 1))
        key = (signed << 32) | (4294967295 - offs.to(tl.int64))  # low half: 2^32 - 1 - entry id
        tl.store(cand_ptr + row * stride_c + slot, key, mask=pick & (slot < k))


@triton.jit
def _sort_kernel(cand_ptr, stride_c, out_ptr, k, K_P2: tl.constexpr):
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, K_P2)
    key = tl.load(cand_ptr + row * stride_c + offs, mask=offs < k, other=-9223372036854775808)
    key = tl.sort(key, descending=True)
    tl.store(out_ptr + row * k + offs, 4294967295 - (key & 4294967295), mask=offs < k)


def default_config(rows: int, n: int, k: int, block: int | None = None) -> dict:
    """Entries per program (``block``, given or about 1024 programs in all, 1024 to 8192 entries each), warps per
    program for that block (at most 16 entries per thread at 8 warps, 8 at 4), and warps of the final sort (the
    fastest measured on the H200 for k = 512 / 1024-2048 / 4096: BENCHMARKS.md, top-k)."""
    block = block or min(8192, max(1024, next_pow2(triton.cdiv(rows * n, 1024))))
    sort_warps = 4 if k <= 512 else 16 if k <= 2048 else 8
    return {"block": block, "num_warps": 8 if block >= 4096 else 4, "sort_warps": sort_warps}


def supports(scores: torch.Tensor, k: int) -> bool:
    """True when :func:`radix_topk` takes these scores and k."""
    return scores.dtype in SCORE_DTYPES and 1 <= k <= min(MAX_K, scores.shape[-1]) and scores.shape[-1] < 2**31


def takes_radix_topk(scores: torch.Tensor, k: int) -> str | None:
    """None when :func:`radix_topk` takes these scores and k (op ``radix_topk``), on the GPU or the interpreter."""
    return None if on_device(scores) and supports(scores, k) else UNSUPPORTED


def radix_topk(scores: torch.Tensor, k: int, config: dict | None = None) -> torch.Tensor:
    """Ids [..., k] int64 of the k highest ``scores`` [..., n] (bf16 or fp32, on the GPU), highest first, ties to the
    lower id: the CPU's ``scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]``. ``config`` overrides
    :func:`default_config`'s ``block`` (entries per program, a power of two), ``num_warps`` and ``sort_warps``."""
    if not supports(scores, k):
        raise ValueError(f"radix top-k: expected bf16 or fp32 scores with 1 <= k <= min({MAX_K}, entries per row), "
                         f"found {scores.dtype}, k={k}, {scores.shape[-1]} entries")
    n = scores.shape[-1]
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    r, nbytes = rows.shape[0], scores.element_size()
    out = torch.empty((r, k), dtype=torch.int64, device=scores.device)
    if r == 0:
        return out.reshape(*scores.shape[:-1], k)
    c = with_overrides(default_config(r, n, k, (config or {}).get("block")), config)
    block, num_warps = c["block"], c["num_warps"]
    n_chunks = triton.cdiv(n, block)
    hist_stride = nbytes * 256 + 1  # one histogram per byte, then the row's candidate counter
    hist = torch.zeros((r, hist_stride), dtype=torch.int32, device=scores.device)
    chunk_hist = torch.empty((r, n_chunks, 256), dtype=torch.int32, device=scores.device)
    k_p2 = next_pow2(k)
    cand = torch.empty((r, k_p2), dtype=torch.int64, device=scores.device)
    bits = rows.view(torch.int16 if nbytes == 2 else torch.int32)
    grid = (r, n_chunks)
    for p in range(nbytes):
        _histogram_kernel[grid](bits, rows.stride(0), n, k, hist, chunk_hist, n_chunks, PASS=p, NBYTES=nbytes,
                                HIST_STRIDE=hist_stride, BLOCK=block, num_warps=num_warps, **PDL_LAUNCH)
    _select_kernel[grid](bits, rows.stride(0), n, k, hist, chunk_hist, n_chunks, cand, k_p2, NBYTES=nbytes,
                         HIST_STRIDE=hist_stride, BLOCK=block, CHUNKS_P2=next_pow2(n_chunks), num_warps=num_warps,
                         **PDL_LAUNCH)
    _sort_kernel[(r,)](cand, k_p2, out, k, K_P2=k_p2, num_warps=c["sort_warps"], **PDL_LAUNCH)
    return out.reshape(*scores.shape[:-1], k)
