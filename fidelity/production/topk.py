"""Top-k entry selection with a fixed tie order: exactly the picks of a stable descending sort, by faster routes.

bf16 index scores tie often (8-bit mantissa; every all-negative entry scores exactly 0), and ``torch.topk``'s
order among equal values is implementation-defined (it differs between a prefill's and a decode step's shapes
and between devices). The reference rule (``oracles.indexer.select_topk``) is a stable descending sort: higher
score first, equal scores to the lower entry id. Sorting every visible entry to keep 512 of them dominates the
selection on the CPU and in long prefills, so two routes give that same result:

* ``sort``: the stable sort itself (fastest on CUDA for up to 64 rows: decode);
* ``keys``: one distinct int64 key per entry, ``(ordered score) << 32 | (2^32 - 1 - id)``, and ``torch.topk``
  of the keys (fastest on the CPU, and on CUDA from 128 rows: prefill chunks). The keys are distinct, so the
  picks and their order are fully determined.

The ordered score maps the fp32 sign-magnitude bits to a two's-complement order (negative floats have their
magnitude bits flipped); -0.0 is folded into +0.0 and every NaN into one NaN above +inf, which is where
``torch.sort`` puts NaN (as equals, so they keep id order).
"""

from __future__ import annotations

import torch

ID_BITS = 32
ID_MASK = (1 << ID_BITS) - 1
CANONICAL_NAN = 0x7FC00000  # positive quiet NaN: above +inf (0x7F800000) in the int32 order
CUDA_KEYS_MIN_ROWS = 128  # H200 (BENCHMARKS.md, top-k): the sort is faster at 1-64 rows, the keys from 128
ROUTES = ("sort", "keys")


def ordered_scores(scores: torch.Tensor) -> torch.Tensor:
    """[..., n] fp32 -> [..., n] int32 whose order is the float order (-0 == +0, NaN above +inf, NaNs equal)."""
    if scores.dtype != torch.float32:
        raise TypeError(f"top-k: scores must be float32, found {scores.dtype}")
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    bits = torch.where(torch.isnan(scores), CANONICAL_NAN, bits)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """[..., n] fp32 scores -> [..., n] int64 keys, distinct per row, ordered as (score, -entry id)."""
    n = scores.shape[-1]
    if n > ID_MASK:
        raise ValueError(f"top-k: at most {ID_MASK} entries per row, found {n}")
    ids = torch.arange(n, device=scores.device, dtype=torch.int64)
    return (ordered_scores(scores).to(torch.int64) << ID_BITS) | (ID_MASK - ids)


def default_route(scores: torch.Tensor) -> str:
    """The fastest route measured for this device and row count."""
    if not scores.is_cuda:
        return "keys"
    return "keys" if scores[..., 0].numel() >= CUDA_KEYS_MIN_ROWS else "sort"


def stable_topk(scores: torch.Tensor, k: int, route: str | None = None) -> torch.Tensor:
    """Ids [..., k] (int64) of the k highest fp32 ``scores`` [..., n], highest first, ties to the lower id:
    exactly ``scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]`` on every route."""
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"top-k: k must lie in [0, {n}] (entries per row), found {k}")
    route = route or default_route(scores)
    if route == "sort":
        ordered_scores(scores[..., :0])  # the same dtype check as the other routes
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    if route != "keys":
        raise ValueError(f"top-k: route must be one of {ROUTES}, found {route!r}")
    return torch.topk(order_keys(scores), k, dim=-1, largest=True, sorted=True).indices
