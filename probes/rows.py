"""Probe metrics -> tidy rows, with one device-to-host transfer per step.

``to_rows`` only labels tensors (no sync); ``collect`` casts every pending value to float64 on its own
device, concatenates them per device and moves each device's block with a single ``.cpu()``.
Row keys: site, layer, position (token position; -1 for whole-call aggregates), metric, value (float;
integer metrics such as counts and indices are exact up to 2**53).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

AGGREGATE = -1  # position of a whole-call metric


def to_rows(site: str, layer: int | None, metrics: dict[str, torch.Tensor],
            positions: torch.Tensor | Sequence[int] | None = None) -> list[dict[str, Any]]:
    """metrics name -> 0-d or [n] tensor -> pending rows (one per metric; values stay tensors).

    [n] metrics take their positions from ``positions`` ([n] tensor or ints; default 0..n-1).
    """
    pending = []
    for name, value in metrics.items():
        if value.ndim > 1:
            raise ValueError(f"{site} {name}: metrics are 0-d or [n], got shape {tuple(value.shape)}")
        pos = None
        if value.ndim == 1:
            pos = range(len(value)) if positions is None else positions
            if len(pos) != len(value):
                raise ValueError(f"{site} {name}: {len(value)} values but {len(pos)} positions")
        pending.append({"site": site, "layer": layer, "metric": name, "value": value, "position": pos})
    return pending


def _to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Tensors (any devices) -> their flattened float64 values, one ``.cpu()`` per device (one concatenation and
    one cast per dtype before it: a step's thousands of 0-d metrics are a handful of launches)."""
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
    out: list[list[float]] = [[] for _ in tensors]
    for by_dtype in groups.values():
        order = [i for idx in by_dtype.values() for i in idx]
        flat = torch.cat([torch.cat([tensors[i].detach().reshape(-1) for i in idx]).to(torch.float64)
                          for idx in by_dtype.values()]).cpu().tolist()
        start = 0
        for i in order:
            out[i] = flat[start : start + tensors[i].numel()]
            start += tensors[i].numel()
    return out


def collect_columns(pending: Iterable[dict[str, Any]], **fields: Any) -> dict[str, list[Any]]:
    """``collect``'s rows as columns, in the order ``pandas.DataFrame`` gives the rows' keys (a DataFrame's input,
    built without a dict per row): every key any row has, None where a row lacks it."""
    pending = list(pending)
    tensors = [p["value"] for p in pending]
    tensors += [p["position"] for p in pending if isinstance(p["position"], torch.Tensor)]
    host = _to_host(tensors)
    host_pos = iter(host[len(pending) :])
    cols: dict[str, list[Any]] = {}
    n = 0
    for p, vals in zip(pending, host[: len(pending)], strict=True):
        pos = p["position"]
        if pos is None:
            pos, vals = [AGGREGATE], vals[:1]
        elif isinstance(pos, torch.Tensor):
            pos = next(host_pos)
        row = {"site": p["site"], "layer": p["layer"], "metric": p["metric"], **p.get("extra", {}), **fields}
        for k, v in row.items():
            _column(cols, k, n).extend([v] * len(vals))
        _column(cols, "position", n).extend(int(t) for t in pos)
        _column(cols, "value", n).extend(vals)
        n += len(vals)
        for col in cols.values():
            if len(col) < n:
                col.extend([None] * (n - len(col)))
    return cols


def _column(cols: dict[str, list[Any]], key: str, n: int) -> list[Any]:
    """The column ``key``, new ones holding None for the ``n`` rows before."""
    if key not in cols:
        cols[key] = [None] * n
    return cols[key]


def collect(pending: Iterable[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """Pending rows (from ``to_rows``) -> tidy rows; ``fields`` (e.g. step=3, phase="decode") are added to each."""
    pending = list(pending)
    tensors = [p["value"] for p in pending]
    tensors += [p["position"] for p in pending if isinstance(p["position"], torch.Tensor)]
    host = _to_host(tensors)
    values, host_pos = host[: len(pending)], iter(host[len(pending) :])
    rows = []
    for p, vals in zip(pending, values, strict=True):
        base = {"site": p["site"], "layer": p["layer"], "metric": p["metric"], **p.get("extra", {}), **fields}
        pos = p["position"]
        if pos is None:
            rows.append({**base, "position": AGGREGATE, "value": vals[0]})
            continue
        pos = next(host_pos) if isinstance(pos, torch.Tensor) else pos
        rows.extend({**base, "position": int(t), "value": v} for t, v in zip(pos, vals, strict=True))
    return rows
