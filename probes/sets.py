"""Vectorised set helpers shared by the probes: first-True search, per-row dedupe and membership.

Ids are integers; any negative id means "none" (padding). Everything stays on the input's device and
never reads a tensor value back to the host.
"""

from __future__ import annotations

import torch


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., L] -> int64 [...]: index of the first True along the last dim, -1 where none (L may be 0)."""
    pad = torch.ones((*mask.shape[:-1], 1), dtype=torch.int32, device=mask.device)
    idx = torch.cat((mask.to(torch.int32), pad), dim=-1).argmax(dim=-1)
    return torch.where(idx < mask.shape[-1], idx, -1)


def gather_or(values: torch.Tensor, idx: torch.Tensor, fill: int | float = -1) -> torch.Tensor:
    """values [..., L], idx int [..., M] (-1 = none) -> [..., M]: values at idx, ``fill`` where idx < 0 or L == 0."""
    if values.shape[-1] == 0:
        return torch.full(idx.shape, fill, dtype=values.dtype, device=values.device)
    got = values.gather(-1, idx.clamp(min=0))
    return torch.where(idx >= 0, got, torch.full_like(got, fill))


def unique_sorted(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int [n, L] -> (ids sorted ascending per row [n, L], bool [n, L] first valid occurrence of each id)."""
    s = ids.sort(dim=-1).values
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return s, new & (s >= 0)


def member(values: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """values int [n, M], pool int [n, L] -> bool [n, M]: values[q, i] occurs in pool[q] (padding included:
    mask invalid values yourself)."""
    if pool.shape[-1] == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    s = pool.sort(dim=-1).values
    idx = torch.searchsorted(s, values.contiguous()).clamp(max=pool.shape[-1] - 1)
    return s.gather(-1, idx) == values


def inversion_gap(miss: torch.Tensor, miss_s: torch.Tensor, extra: torch.Tensor, extra_s: torch.Tensor,
                  unit: torch.Tensor) -> torch.Tensor:
    """How far a test selection inverts the reference's ranking, per row. miss / extra bool [n, L] (ids only the
    reference / only the test picked), their reference scores float64 [n, L] (NaN: unscored), unit [n] -> [n]
    float64: (largest score of a miss - smallest score of an extra) / unit, +inf where misses outnumber extras (an
    id dropped for nothing) or an extra is unscored, 0 without a miss. The test ranked every extra above every
    miss, so its score error is at least this gap."""
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=miss_s.device)
    top_miss = torch.where(miss, miss_s, -inf).amax(dim=-1)
    low_extra = torch.where(extra, torch.where(extra_s.isnan(), -inf, extra_s), inf).amin(dim=-1)
    gap = torch.clamp((top_miss - low_extra) / unit.clamp(min=torch.finfo(torch.float64).tiny), min=0)
    gap = torch.where(miss.sum(-1) > extra.sum(-1), inf, gap)
    return torch.where(miss.any(-1), gap, 0.0)
