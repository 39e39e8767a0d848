"""Top-k entry selection with a fixed tie order: exactly the picks of a stable descending sort of the scores.

bf16 index scores tie often (8-bit mantissa; every all-negative entry scores exactly 0), and ``torch.topk``'s
order among equal values is implementation-defined (it differs between a prefill's and a decode step's shapes
and between devices). The reference rule (``oracles.indexer.select_topk``) is a stable descending sort: higher
score first, equal scores to the lower entry id, where equal means equal as numbers (-0.0 == +0.0) and NaN,
of either sign, ranks above +inf (torch's CPU sort). CUDA's float sort is a radix sort on the bit patterns,
which puts -0.0 below +0.0 and a negative NaN at the bottom, so the production path never sorts floats. It maps
each score to an integer of the same order, ``ordered_scores`` (fp32 -> int32, bf16 -> int16: negative values
get their magnitude bits flipped; -0.0 is folded into +0.0 and every NaN into one NaN above +inf), and selects
by one of three routes with the same result:

* ``radix`` (CUDA, bf16 or fp32 scores, k <= 4096; the default there): op ``radix_topk``'s kernel in the op
  table (``registry.OPS``, :mod:`fidelity.decoders.production.kernels.radix_topk`), a radix selection in Triton
  that finds the k-th largest integer one byte at a time and sorts only the k picks;
* ``sort``: a stable descending sort of those integers, op ``radix_topk``'s emulation (the CUDA default where
  ``radix`` does not apply, for bf16 scores at any row count, where it sorts 16-bit keys, and for fp32 scores up
  to 64 rows);
* ``keys``: one distinct int64 key per entry, ``(ordered score) << 32 | (2^32 - 1 - id)``, and ``torch.topk``
  of the keys (fastest on the CPU, and on CUDA for fp32 scores from 128 rows: prefill chunks). The keys are
  distinct, so the picks and their order are fully determined.

Scores are taken as produced (bf16 or fp32): no fp32 copy of the logits is made.
"""

from __future__ import annotations

import torch

from fidelity.decoders.production import kernels, routes
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.kernels._common import INTERPRET
from fidelity.decoders.production.ops import ordered_scores, radix_topk
from fidelity.decoders.production.registry import kernel_functions

ID_BITS = 32
ID_MASK = (1 << ID_BITS) - 1
CUDA_KEYS_MIN_ROWS = 128  # H200, fp32 scores (BENCHMARKS.md, top-k): the sort is faster at 1-64 rows, the keys from 128
TORCH_ROUTES = ("sort", "keys")
ROUTES = (*TORCH_ROUTES, "radix")


def topk_width(index_topk: int) -> int:
    """The indexer's top-k width, which the selection and the decode buffers (``cache.LayerCache``) take: the
    config's ``index_topk`` (fault ``index-topk-hardcoded``: a constant twice that, the config ignored)."""
    return 2 * index_topk if on("index-topk-hardcoded") else index_topk


def _check_dtype(scores: torch.Tensor) -> None:
    if scores.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"top-k: scores must be float32 or bfloat16, found {scores.dtype}")


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """[..., n] scores -> [..., n] int64 keys, distinct per row, ordered as (score, -entry id)."""
    n = scores.shape[-1]
    if n > ID_MASK:
        raise ValueError(f"top-k: at most {ID_MASK} entries per row, found {n}")
    ids = torch.arange(n, device=scores.device, dtype=torch.int64)
    return (ordered_scores(scores).to(torch.int64) << ID_BITS) | (ID_MASK - ids)


def _kernels_run_here(scores: torch.Tensor) -> bool:
    """True when the Triton kernels can take ``scores``: triton imports and they are on CUDA (or interpreted)."""
    return kernels.HAVE_TRITON and (scores.is_cuda or INTERPRET)


def default_route(scores: torch.Tensor, k: int = 512) -> str:
    """The fastest route measured for this device, dtype, row count and k (BENCHMARKS.md, top-k)."""
    if not scores.is_cuda:
        return "keys"
    if _kernels_run_here(scores):
        if kernel_functions("radix_topk")[1](scores, k) is None:
            return "radix"
    return "sort" if scores.dtype == torch.bfloat16 or scores[..., 0].numel() < CUDA_KEYS_MIN_ROWS else "keys"


def stable_topk(scores: torch.Tensor, k: int, route: str | None = None) -> torch.Tensor:
    """Ids [..., k] (int64) of the k highest ``scores`` [..., n] (fp32 or bf16), highest first, ties to the lower
    id: the CPU's ``scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]`` on every route and
    device."""
    n = scores.shape[-1]
    _check_dtype(scores)
    if not 0 <= k <= n:
        raise ValueError(f"top-k: k must lie in [0, {n}] (entries per row), found {k}")
    route = route or default_route(scores, k)
    if route not in ROUTES:
        raise ValueError(f"top-k: route must be one of {ROUTES}, found {route!r}")
    if route == "radix" and not _kernels_run_here(scores):
        raise ValueError(f"top-k: route 'radix' needs triton and the scores on a CUDA device, found scores on "
                         f"{scores.device}{'' if kernels.HAVE_TRITON else ' and no triton'}")
    routes.note("topk", route)
    if route == "radix":
        if k == 0:
            return torch.empty((*scores.shape[:-1], 0), dtype=torch.int64, device=scores.device)
        return kernel_functions("radix_topk")[0](scores, k)  # the op table's kernel (also under the interpreter)
    if route == "sort":
        return radix_topk(scores, k)  # the emulation: a stable sort of the ordered scores
    return torch.topk(order_keys(scores), k, dim=-1, largest=True, sorted=True).indices
