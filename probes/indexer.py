"""indexer probe ``indexer_recall``: production top-k against the oracle top-k, tie-aware.

Definitions (per query q; ids < 0 are ignored, duplicates count once):
  recall@k   = |test ∩ ref| / |ref|, averaged over queries with a non-empty ref set (1.0 if there is none).
  kth        = the k-th largest oracle score of q, k = number of valid ref picks.
  A miss (ref pick absent from test) with oracle score s is a near-tie when s == kth or
  |s - kth| <= margin * max(|kth|, scale), scale = the query's largest finite |score| (so a k-th score near
  0, common under the ReLU, does not make every rounding-sized gap a true miss), else a true miss.
  (Ref picks score >= kth, so the gap is s - kth; exact
  ties, including the all-zero ReLU scores, are always near-ties.) Extras (test picks absent from ref) are
  classified the same way with the oracle score of the test pick.
  miss_gap = the largest oracle-score inversion in the test picks: per query, (largest oracle score of a miss -
  smallest oracle score of an extra) / max(|kth|, scale), +inf where the test picks fewer valid entries than it
  misses (an entry dropped for nothing) or picks an entry the oracle scores -inf; 0 without a miss. A decoder
  ranks every extra above every miss, so its score error is at least this gap: thresholds hold it to the score
  precision of the decoder's class (the near-tie margin lives in the rule, not in the probe).
  Rank displacement, for each test pick visible to the oracle (finite oracle score): the test rank i is its
  column among q's valid test picks (0 = first); the oracle rank is the tie interval
  [#{scores > s}, #{scores >= s} - 1]; displacement = distance from i to that interval (0 inside it).
  Meaningful when the test picks are score-ordered, as a sorted top-k returns them.
"""

from __future__ import annotations

import torch

from probes.sets import first_true, gather_or, inversion_gap, member, unique_sorted


def _near_tie(s: torch.Tensor, kth: torch.Tensor, margin: float, scale: torch.Tensor) -> torch.Tensor:
    """float64 [n, k], kth [n, 1], scale [n, 1] -> bool: s is within ``margin * max(|kth|, scale)`` of kth,
    exact ties included."""
    return (s == kth) | ((s - kth).abs() <= margin * torch.maximum(kth.abs(), scale))


def _rank_displacement(test: torch.Tensor, scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """test int64 [n, k], scores [n, e] -> rank_disp_mean / rank_disp_max (float64) / ranked (int64)."""
    valid = test >= 0
    s = gather_or(scores, torch.where(test < scores.shape[-1], test, -1), float("nan"))
    ranked = s.isfinite()
    asc = scores.sort(dim=-1).values.contiguous()
    s_q = torch.where(ranked, s, 0).to(asc.dtype).contiguous()
    e = scores.shape[-1]
    lo = e - torch.searchsorted(asc, s_q, right=True)  # entries scoring strictly higher
    hi = e - torch.searchsorted(asc, s_q, right=False) - 1
    i = valid.to(torch.int64).cumsum(dim=-1) - 1
    disp = torch.clamp(torch.maximum(lo - i, i - hi), min=0).to(torch.float64)
    disp = torch.where(ranked, disp, 0.0)
    count = ranked.sum()
    return {
        "rank_disp_mean": torch.where(count > 0, disp.sum() / count.clamp(min=1), 0.0),
        "rank_disp_max": torch.cat((disp.flatten(), disp.new_zeros(1))).amax(),
        "ranked": count,
    }


def indexer_recall(test_topk: torch.Tensor, ref_topk: torch.Tensor, ref_scores: torch.Tensor,
                   margin: float = 0.0) -> dict[str, torch.Tensor]:
    """test_topk [n, k'], ref_topk [n, k] entry ids (-1 = none), ref_scores [n, e] oracle scores (-inf =
    invisible) -> 0-d metrics: recall (float64), recall_queries, hits, near_tie_miss, true_miss,
    first_true_miss_query (row, -1 none), miss_gap (float64), near_tie_extra, true_extra, test_invisible (test
    picks out of range or with -inf/NaN oracle score), size_mismatch (queries whose number of distinct picks
    differs from the oracle's: a top-k width other than the config's), rank_disp_mean, rank_disp_max (float64),
    ranked (int64)."""
    dev = ref_scores.device
    ref, test = ref_topk.to(dev, torch.int64), test_topk.to(dev, torch.int64)
    ref_size = unique_sorted(ref)[1].sum(-1)  # distinct picks per query, as given
    e = ref_scores.shape[-1]
    ref = torch.where(ref < e, ref, -1)  # a ref id past the score row cannot be scored
    ref_s, ref_u = unique_sorted(ref)
    test_s, test_u = unique_sorted(test)
    hit = ref_u & member(ref_s, test)
    miss = ref_u & ~hit
    extra = test_u & ~member(test_s, ref)

    count = ref_u.sum(dim=-1)  # [n]
    top = ref_scores.topk(min(ref.shape[-1], e), dim=-1).values if e else ref_scores.new_zeros(ref.shape[0], 0)
    kth = gather_or(top, (count - 1)[:, None], float("nan")).to(torch.float64)  # [n, 1]
    miss_s = gather_or(ref_scores, torch.where(miss, ref_s, -1), float("nan")).to(torch.float64)
    extra_s = gather_or(ref_scores, torch.where(extra & (test_s < e), test_s, -1), float("nan")).to(torch.float64)
    finite = ref_scores.isfinite()
    scale = (torch.where(finite, ref_scores.abs(), 0).amax(dim=-1, keepdim=True) if e  # no entries yet: none
             else ref_scores.new_zeros(ref_scores.shape[0], 1)).to(torch.float64)
    near_miss = miss & _near_tie(miss_s, kth, margin, scale)
    true_miss = miss & ~near_miss
    gaps = inversion_gap(miss, miss_s, extra, extra_s, torch.maximum(kth.abs(), scale).squeeze(-1))
    near_extra = extra & _near_tie(extra_s, kth, margin, scale)

    has_ref = count > 0
    recall_q = hit.sum(dim=-1).to(torch.float64) / count.clamp(min=1)
    nq = has_ref.sum()
    valid = test >= 0
    test_sc = gather_or(ref_scores, torch.where(valid & (test < e), test, -1), float("nan"))
    out = {
        "recall": torch.where(nq > 0, torch.where(has_ref, recall_q, 0.0).sum() / nq.clamp(min=1), 1.0),
        "recall_queries": nq,
        "hits": hit.sum(),
        "near_tie_miss": near_miss.sum(),
        "true_miss": true_miss.sum(),
        "first_true_miss_query": first_true(true_miss.any(dim=-1)),
        "miss_gap": torch.cat((gaps, gaps.new_zeros(1))).amax(),
        "near_tie_extra": near_extra.sum(),
        "true_extra": (extra & ~near_extra).sum(),
        "test_invisible": (valid & ~test_sc.isfinite()).sum(),
        "size_mismatch": (ref_size != test_u.sum(-1)).sum(),
    }
    out.update(_rank_displacement(test, ref_scores))
    return out
