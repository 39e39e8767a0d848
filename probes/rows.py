"""Probe metrics -> tidy rows, with one device-to-host transfer per step.

``to_rows`` only labels tensors (no sync); ``collect`` casts every pending value to float64 on its own
device, concatenates them per device and moves each device's block with a single ``.cpu()``.
Row keys: site, layer, position (token position; -1 for whole-call aggregates), metric, value (float;
integer metrics such as counts and indices are exact up to 2**53). A batch of pairs probed together hands its
metrics over as ``PairRows``: one metric of every pair of the batch, a [B] tensor, not B rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


@dataclass
class PairRows:
    """Pending rows of one metric of a batch of pairs, one whole-call row per pair: ``value`` [B] (on its device),
    the pairs' ``sites`` and ``layers``, and each pair's ``extra`` fields (None: none)."""

    sites: list[str]
    layers: list[int | None]
    metric: str
    value: torch.Tensor
    extras: list[dict | None]


def _to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Tensors (any devices) -> their flattened float64 values, one ``.cpu()`` per device: the 0-d tensors of a
    dtype go through one ``stack``, the others through one ``cat``, then one cast per dtype (a step's thousands of
    0-d metrics are a handful of ops)."""
    groups: dict[torch.device, dict[tuple[torch.dtype, bool], list[int]]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, {}).setdefault((t.dtype, t.ndim == 0), []).append(i)
    out: list[list[float]] = [[] for _ in tensors]
    for by_kind in groups.values():
        order = [i for idx in by_kind.values() for i in idx]
        parts = [(torch.stack([tensors[i] for i in idx]) if scalar else
                  torch.cat([tensors[i].reshape(-1) for i in idx])).to(torch.float64)
                 for (_, scalar), idx in by_kind.items()]
        flat = torch.cat(parts).detach().cpu().tolist()
        start = 0
        for i in order:
            n = tensors[i].numel()
            out[i] = flat[start : start + n]
            start += n
    return out


def collect_columns(pending: Iterable[dict[str, Any] | PairRows], **fields: Any) -> dict[str, list[Any]]:
    """``collect``'s rows as columns, in the order ``pandas.DataFrame`` gives the rows' keys (a DataFrame's input,
    built without a dict per row): every key any row has, None where a row lacks it."""
    pending = list(pending)
    tensors = [p.value if isinstance(p, PairRows) else p["value"] for p in pending]
    tensors += [p["position"] for p in pending if isinstance(p, dict) and isinstance(p["position"], torch.Tensor)]
    host = _to_host(tensors)
    host_pos = iter(host[len(pending) :])
    values, positions = host[: len(pending)], []
    for i, p in enumerate(pending):
        if isinstance(p, PairRows):  # one whole-call row per pair
            positions.append([AGGREGATE] * len(values[i]))
        elif p["position"] is None:
            positions.append([AGGREGATE])
            values[i] = values[i][:1]
        else:
            positions.append(next(host_pos) if isinstance(p["position"], torch.Tensor) else p["position"])
    counts = [len(v) for v in values]
    keys: dict[str, None] = {}
    for extra_keys in dict.fromkeys(tuple(e or ()) for p in pending for e in _extras(p)):
        keys.update(dict.fromkeys(("site", "layer", "metric", *extra_keys, *fields, "position", "value")))
    cols = {}
    for key in keys:
        if key == "position":
            cols[key] = [int(t) for pos in positions for t in pos]
        elif key == "value":
            cols[key] = [v for vals in values for v in vals]
        elif key in fields:
            cols[key] = [fields[key]] * sum(counts)
        else:
            cols[key] = _column(pending, key, counts)
    return cols


def _extras(p: dict[str, Any] | PairRows) -> list[dict | None]:
    return p.extras if isinstance(p, PairRows) else [p.get("extra")]


def _column(pending: list[dict[str, Any] | PairRows], key: str, counts: list[int]) -> list[Any]:
    """The values of ``key`` (site, layer, metric or an extra field) of every row, rows of a ``PairRows`` each
    their own, a dict's repeated once per value it holds."""
    out: list[Any] = []
    for p, n in zip(pending, counts, strict=True):
        if isinstance(p, PairRows):
            out += _pair_column(p, key)
            continue
        v = p[key] if key in ("site", "layer", "metric") else p.get("extra", {}).get(key)
        if n == 1:
            out.append(v)
        else:
            out += [v] * n
    return out


def _pair_column(p: PairRows, key: str) -> list[Any]:
    """``key``'s value in each of ``p``'s rows."""
    if key == "site":
        return p.sites
    if key == "layer":
        return p.layers
    if key == "metric":
        return [p.metric] * len(p.sites)
    return [(e or {}).get(key) for e in p.extras]


def collect(pending: Iterable[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """Pending rows (from ``to_rows``) -> tidy rows; ``fields`` (e.g. step=3, phase="decode") are added to each
    (:func:`collect_columns`' columns as rows: a key another row has and this one lacks is None)."""
    cols = collect_columns(pending, **fields)
    return [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]
