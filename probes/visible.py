"""visible range: the exact set of KV each query may attend to, and its set difference against the
production's ``L{i}.attn.visible`` (docs/design.md "Probes").

Layout of the site, per query row: the first ``window`` columns hold window TOKEN POSITIONS
(t-window+1 .. t, self included), the remaining columns hold COMPRESSED ENTRY IDS (HCA: every
j < (t+1)//ratio; CSA: the indexer's picks); -1 (any negative id) is padding. The two parts are different
namespaces and are compared separately.
"""

from __future__ import annotations

import torch

from probes.sets import first_true, gather_or, member, unique_sorted

KINDS = ("missing_window", "missing_compressed", "extra_window", "extra_compressed")  # first_kind 0..3


def expected_visible(positions: torch.Tensor, window: int, ratio: int, topk_picks: torch.Tensor | None,
                     n_entries: int) -> torch.Tensor:
    """positions int [n] -> int64 [n, window + K]: window positions, then compressed ids (-1 padding).

    ratio 0: no compressed part (K = 0); topk_picks None: HCA, K = n_entries, column j holds j if
    j < (t+1)//ratio; topk_picks [n, K]: CSA, the given picks as they are.
    """
    pos = positions.to(torch.int64)
    win = pos[:, None] - (window - 1) + torch.arange(window, device=pos.device)
    win = torch.where(win >= 0, win, -1)
    if ratio == 0:
        comp = win.new_zeros((len(pos), 0))
    elif topk_picks is None:
        j = torch.arange(n_entries, device=pos.device)
        comp = torch.where(j[None, :] < ((pos + 1) // ratio)[:, None], j, -1)
    else:
        comp = topk_picks.to(device=pos.device, dtype=torch.int64)
    return torch.cat((win, comp), dim=1)


def _diff(test: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 [n, L'], [n, L] -> (missing mask over sorted ref, sorted ref, extra mask over sorted test, sorted test)."""
    ref_s, ref_u = unique_sorted(ref)
    test_s, test_u = unique_sorted(test)
    return ref_u & ~member(ref_s, test), ref_s, test_u & ~member(test_s, ref), test_s


def _first_offender(per_kind: torch.Tensor, masks: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...],
                    positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """per_kind bool [n, 4], masks/values per kind [n, L_k] (values sorted per row), positions int64 [n] ->
    first_row, first_query, first_kind, first_kv of the first offence in (row, kind, kv) order (-1 none)."""
    first_kv = torch.stack([gather_or(v, first_true(m)[:, None])[:, 0] for m, v in zip(masks, values, strict=True)],
                           dim=1)  # [n, 4]: smallest offending kv per kind
    row = first_true(per_kind.any(dim=1))
    r = row.clamp(min=0).reshape(1)  # a dummy last row keeps this defined for n == 0
    kind = first_true(torch.cat((per_kind, per_kind.new_zeros(1, 4))).index_select(0, r))  # [1]
    kv = gather_or(torch.cat((first_kv, first_kv.new_full((1, 4), -1))).index_select(0, r), kind[:, None])
    return {
        "first_row": row,
        "first_query": gather_or(positions, row.reshape(1))[0],
        "first_kind": torch.where(row >= 0, kind[0], -1),
        "first_kv": torch.where(row >= 0, kv[0, 0], -1),
    }


def visible_range(test_visible: torch.Tensor, ref_visible: torch.Tensor, positions: torch.Tensor, window: int,
                  test_window: int | None = None) -> dict[str, torch.Tensor]:
    """test_visible [n, W' + K'], ref_visible [n, W + K] (site layout), positions int [n] -> int64 0-d metrics.

    ``window`` splits ref (and test unless ``test_window`` gives the production's own window width).
    missing / extra: (query, kv) pairs in ref not in test / in test not in ref, also split into
    missing_window, missing_compressed, extra_window, extra_compressed; bad_queries: rows with any offence.
    The first offending pair, ordered by (query row, kind, kv): first_row (row index), first_query (its token
    position), first_kind (0 missing window, 1 missing compressed, 2 extra window, 3 extra compressed),
    first_kv (token position or entry id, per kind); all -1 when the sets agree.
    """
    dev = ref_visible.device
    ref, test = ref_visible.to(torch.int64), test_visible.to(dev, torch.int64)
    tw = window if test_window is None else test_window
    mw, rw, ew, tws = _diff(test[:, :tw], ref[:, :window])
    mc, rc, ec, tcs = _diff(test[:, tw:], ref[:, window:])
    masks, values = (mw, mc, ew, ec), (rw, rc, tws, tcs)
    out = {name: m.sum() for name, m in zip(KINDS, masks, strict=True)}
    out["missing"] = out["missing_window"] + out["missing_compressed"]
    out["extra"] = out["extra_window"] + out["extra_compressed"]
    per_kind = torch.stack([m.any(dim=-1) for m in masks], dim=1)  # [n, 4]
    out["bad_queries"] = per_kind.any(dim=1).sum()
    out.update(_first_offender(per_kind, masks, values, positions.to(device=dev, dtype=torch.int64)))
    return out
