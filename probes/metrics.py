"""Every metric name a run's table can hold, with the probe that writes it: the one list that threshold files
are checked against and that ``runs/README.md`` describes. ``tests/test_report.py`` pins it to a real run."""

from __future__ import annotations

import re

METRICS: dict[str, str] = {
    # similarity (every float site)
    "cos": "similarity: cosine over coordinates finite in both",
    "calc_diff": "similarity: 1 - 2<x,y>/(|x|^2+|y|^2) in float64",
    "rel_l2": "similarity: |x - y| / |x|",
    "max_abs": "similarity: largest |x - y|",
    "max_abs_index": "similarity: flat index of max_abs",
    "sqnr_db": "similarity: 10 log10(|x|^2 / |x - y|^2)",
    "nonfinite_mismatch": "similarity: coordinates whose NaN/+inf/-inf pattern differs",
    "nonfinite_first": "similarity: flat index of the first mismatched coordinate (-1 none)",
    "test_nonfinite": "similarity: non-finite coordinates in production",
    "ref_nonfinite": "similarity: non-finite coordinates in the oracle",
    "compared": "similarity: coordinates finite in both",
    # self-consistency (a scenario's logits pair: one decoder fed the same tokens two ways; not a run's table)
    "unequal": "self-consistency: logits coordinates whose values differ between the two sides (0: equal values)",
    "cos_min": "self-consistency: smallest cos of the two sides' logits at one position",
    "rel_l2_mean": "self-consistency: mean over positions of |b - a| / |a| (a: the reference side's logits)",
    "rel_max": "self-consistency: max_abs over the largest |a|",
    # sinkhorn (mHC comb)
    "row_dev": "sinkhorn: max |row sum - 1|",
    "row_dev_excess": "sinkhorn: max over rows of |row sum - 1| beyond the oracle's own",
    "col_dev": "sinkhorn: max |column sum - 1|",
    "min_value": "sinkhorn: smallest entry",
    "negative_count": "sinkhorn: negative entries",
    "nonfinite": "sinkhorn: non-finite entries",
    "orientation_err": "sinkhorn: max |C - C_oracle|",
    "transposed_err": "sinkhorn: max |C - C_oracle^T|",
    "orientation_flip": "sinkhorn: 1 when C is closer to the oracle's transpose",
    "range_excess": "sinkhorn: how far the decoder's mHC pre / post weights reach outside [0, 1 + hc_eps] / [0, 2]",
    # residual
    "rms_max": "residual: largest RMS over the mHC streams",
    "rms": "residual: RMS over every mHC stream (the whole [n, hc, dim] record)",
    "ref_rms_max": "residual: the oracle's rms_max",
    "ref_rms": "residual: the oracle's rms",
    # indexer
    "recall": "indexer: recall@k of production's top-k against the oracle's",
    "recall_queries": "indexer: queries with at least one visible entry",
    "hits": "indexer: picks in both top-k sets",
    "near_tie_miss": "indexer: misses within the tie margin of the k-th oracle score",
    "true_miss": "indexer: the other misses",
    "first_true_miss_query": "indexer: row of the first true miss (-1 none)",
    "miss_gap": "indexer: largest (k-th oracle score - missed pick's) / the query's score scale (0 no miss)",
    "near_tie_extra": "indexer: extra picks within the tie margin",
    "true_extra": "indexer: the other extra picks",
    "size_mismatch": "indexer: queries whose number of picks differs from the oracle's (a top-k width other than "
                     "the config's index_topk)",
    "test_invisible": "indexer: production picks the oracle scores -inf or NaN",
    "rank_disp_mean": "indexer: mean oracle-rank displacement of production's picks",
    "rank_disp_max": "indexer: largest oracle-rank displacement",
    "ranked": "indexer: picks ranked",
    # visible range
    "missing": "visible: positions the oracle may see and production does not",
    "extra": "visible: positions production sees and the oracle may not",
    "missing_window": "visible: missing window positions",
    "missing_compressed": "visible: missing compressed entries",
    "extra_window": "visible: extra window positions",
    "extra_compressed": "visible: extra compressed entries",
    "bad_queries": "visible: queries with any difference",
    "first_row": "visible: row of the first difference (-1 none)",
    "first_query": "visible: token position of the first difference",
    "first_kind": "visible: 0 missing window, 1 missing compressed, 2 extra window, 3 extra compressed",
    "first_kv": "visible: the KV position or entry of the first difference",
    # routing
    "routing_agree": "routing: share of tokens routed to the same experts",
    "routing_flips": "routing: tokens routed differently",
    "weight_max_err": "routing: max |w_test - w_oracle| on tokens routed alike",
    "routing_gap": "routing: largest oracle selection-score gap a flip inverts, over the token's largest score "
                   "(+inf: a hash layer's flip, or fewer experts)",
    # rows (every site)
    "rows_missing": "rows: oracle rows (tokens, entries) the decoder did not report at this site and step",
    "rows_extra": "rows: rows the decoder reported beyond the oracle's",
    "shape_mismatch": "rows: 1 when a row's trailing shape differs from the oracle's (the site is not compared)",
    "ambiguous_tokens": "routing (no decoder experts): tokens whose oracle routing is a near-tie, left out of the "
                        "comparison of the MoE output and the streams after it",
    "ambiguous_queries": "indexer (layer mode, no decoder top-k): queries whose oracle selection is a near-tie, "
                         "left out of the comparison of the sites after it",
    # kv_storage (a decoder's stored KV cache rows, L{i}.attn.kv_cache, against its own attn.kv)
    "rows_mismatch": "kv_storage: stored rows whose decoded values differ from the decoder's attn.kv bit for bit",
    "rule_mismatch": "kv_storage: stored rows with an FP8 scale neither scale-floor rule gives for its codes",
    "other_rule_rows": "kv_storage: stored rows only the other scale-floor rule (not the profile's kv_scale_floor) "
                       "can have written",
    "rule_rows": "kv_storage: stored rows one scale-floor rule can have written and the other not (informational)",
    # tokens (free mode, logits)
    "agree": "tokens: 1 when the greedy tokens agree",
    "ref_token": "tokens: the oracle's greedy token",
    "test_token": "tokens: production's greedy token",
    "ref_margin": "tokens: oracle top-1 minus top-2 logit",
    "test_margin": "tokens: production top-1 minus top-2 logit",
    "test_rank_of_ref_token": "tokens: production logits above the oracle's token",
    "token_flip_with_margin": "tokens (derived when judged): a disagreement where ref_margin > the flip margin",
    # sampler
    "same_pick": "sampler: 1 when both samplers pick the same token",
    "pick_margin": "sampler: the oracle draw's winner minus runner-up",
    "pick_flip_with_margin": "sampler: a differing pick beyond the margin",
    "sampler_impl_mismatch": "sampler: the reference sampler on production's logits picks differently",
    # repetition (of the stream's decode tokens; informational)
    "ngram_seen": "repetition: 1 when the 4-gram ending at this decode token occurred earlier in the stream",
    "repeat_rate": "repetition: share of decode tokens whose 4-gram occurred earlier",
    "loop_onset": "repetition: decode step from which the stream repeats with one period to its end (-1 none)",
    "loop_period": "repetition: that period in tokens (0 none)",
    "longest_repeat": "repetition: the longest span of decode tokens that occurs twice",
    # stops
    "stop_mismatch": "stops: the decoder's stop set and the reference's disagree on this token",
    # memory
    "allocated_bytes": "memory: CUDA allocator's allocated bytes (CPU: process RSS)",
    "reserved_bytes": "memory: CUDA allocator's reserved bytes (CPU: process RSS)",
    "memory_supported": "memory: 1 when the counters exist on this platform",
    "memory_is_rss": "memory: 1 when the bytes are the process RSS (CPU)",
    "cache_bytes": "memory: production cache bytes",
    "cache_growth": "memory: cache bytes minus those after the prefill",
    "reserved_delta": "memory: bytes the CUDA allocator reserved during the decoder's call",
    "retained_delta": "memory: CUDA bytes the decoder's call allocated and still holds beyond its outputs",
    "retained_growth": "memory: retained_delta summed over the decode calls after the warm-up",
    "host_retained_delta": "memory: malloc bytes the decoder's call left in use beyond its outputs (CPU kernels' "
                           "caches included)",
    "host_retained_growth": "memory: host_retained_delta summed over the decode calls after the warm-up",
    "held_bytes": "memory: tensor bytes reachable from the decoder object (caches, weights, anything kept)",
    "held_growth": "memory: held_bytes minus those after the warm-up",
    "alloc_calls": "memory: CUDA allocator block requests during the decoder's call",
    "free_calls": "memory: CUDA allocator block releases during the decoder's call",
    "device_mallocs": "memory: cudaMalloc (or segment map) calls during the decoder's call",
    "reserved_growth": "memory: reserved_delta summed over the decode calls after the warm-up",
    "new_device_mallocs": "memory: device_mallocs of a decode call after the warm-up",
}
SELF_CONSISTENCY = ("unequal", "cos_min", "rel_l2_mean", "rel_max")  # written by ``fidelity scenarios`` only
METRIC_PATTERNS: dict[str, str] = {
    r"rms_stream\d+": "residual: RMS of mHC stream k",
    r"ref_rms_stream\d+": "residual: the oracle's RMS of mHC stream k",
    r"growth_.+": "residual: RMS ratio to the previous layer",
}


def is_metric(name: str) -> bool:
    """True for a name in ``METRICS`` or matching one of ``METRIC_PATTERNS``."""
    return name in METRICS or any(re.fullmatch(p, name) for p in METRIC_PATTERNS)
