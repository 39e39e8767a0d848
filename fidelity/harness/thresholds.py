"""Threshold rules that judge metric rows, their defaults per profile, and the first divergence of a run.

A rule ``Threshold(site_regex, metric, op, value, modes=...)`` applies to rows whose site fully matches
``site_regex``, whose metric is ``metric`` and whose mode is in ``modes`` (empty: every mode); a row passes when
``value op limit`` holds (a NaN value never passes). For each (site, metric, mode) only the LAST matching rule
applies, so rules appended after the defaults (a user TOML) override them; ``op="off"`` switches a default off.
Metrics without a rule are informational.

Defaults follow from a profile's *fields*, not its name (``profile_class``): ``exact`` (the names fp32, fp64,
exact, oracle: a decoder without quantization or bf16 rounding), ``bf16`` (no FP8/FP4 format in any field) and
``quantized`` (any FP8/FP4 field: the official QAT numerics or variants); the FMHA field picks the attention
core's gap. Cosine floors apply to every mode; free mode inherits upstream error, so it is the strictest test.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fidelity.decoders.profiles import CHOICES, Profile, get_profile, profile_dict
from fidelity.model import sites
from fidelity.model.sites import ROW, RUN_ROWS, SITE, layer_sites_regex, sites_regex
from probes.metrics import METRIC_PATTERNS, METRICS, is_metric

# The metric table contract (long format, one value per row).
COLUMNS = ("run_id", "mode", "profile", "step", "phase", "position", "layer", "site", "metric", "value")
RANK_COLUMNS = ("rank", "ranks")  # optional: a sharded site's rows of one rank's own tensor (empty elsewhere)
MODES = ("op", "layer", "free")  # tie-break order for a divergence: the most local evidence first
# then alphabetical, for rows failing together
METRIC_PRIORITY = ("nonfinite_mismatch", "test_nonfinite", "cos", "calc_diff")

# Data-flow order of the sites: the site table's (``fidelity.model.sites``), then the run's own rows.
SITES_BEFORE_LAYERS = sites.SITES_BEFORE_LAYERS
LAYER_SITE_ORDER = sites.LAYER_SITE_ORDER
SITES_WITHOUT_UPSTREAM = (SITE.embed,)  # a free-mode failure here is local: both models read the same token ids
LOCAL_MODES = ("op", "layer")
SITES_AFTER_LAYERS = (*sites.SITES_AFTER_LAYERS, *RUN_ROWS)
NUMERIC_AFTER_LAYERS = (SITE.final, SITE.logits, ROW.tokens)  # downstream of the layers' numerics (not the run's loop)

EXACT_PROFILES = frozenset({"exact", "fp32", "fp64", "oracle"})
# Profile fields whose listed formats quantize (FP8 / FP4): any of them makes a profile "quantized".
QUANTIZING_FIELDS = {"gemm_act": ("fp8",), "kv_nope": ("fp8",), "kv_storage": ("fp8",), "fmha": ("fp8", "fp8-nope"),
                     "indexer_qk": ("fp4", "fp8")}
# Calibrated on the tiny default (seeds 0 and 1, 1024-token prompt, 64 decode steps; measured worst values in
# BENCHMARKS-style notes of the closing report): op-mode cos >= 1 - gap, layer-mode >= 1 - layer_gap.
COS_GAP = {"exact": 1e-8, "bf16": 1e-3, "quantized": 1e-2}  # op mode: cos >= 1 - gap, calc_diff <= gap
LAYER_GAP = {"exact": 1e-6, "bf16": 5e-3, "quantized": 2e-2}  # layer mode, non-CSA attention sites
FREE_LOGITS_COS = {"exact": 1 - 1e-6, "bf16": 0.9, "quantized": 0.8}  # free mode: gross divergence only
CORE_GAP = 5e-4  # op mode attn.core: the bf16 kernel on production's own q / KV measures cos 0.999998
CORE_GAP_FP8 = 5e-3  # ... and with e4m3 Q, K/V and P (profile fp8-fmha) cos >= 0.9992
# FP4 q / keys after the Hadamard rotation: clean worst 0.9888 (op and layer mode, every built-in profile, trained
# default, 16 / 64 decode steps and 4 held-out files); without the rotation (profile field hadamard=off) the FP4
# grid meets the keys' outliers unspread: clean worst 0.9774 (no-hadamard, copy.py), so that format gets its own
# floor and the cost of dropping the rotation shows in the indexer's recall, not as a false alarm on its keys.
INDEXER_QK_COS = {"exact": 1 - 1e-6, "bf16": 0.999, "quantized": 0.985}
INDEXER_QK_COS_UNROTATED = 0.97
COMB_ERR = 1e-4  # op mode: fp32 Sinkhorn vs the oracle's on the same streams differ by ~1e-7
ROUTING_WEIGHT_ERR = 1e-3  # op mode: the fp32 gate on production's own input leaves ~1e-6
# Layer mode recall@k per step (a decode step is one query), the oracle layer ranking on its own exact keys, at the
# run's own top-k (the config's index_topk) and context (``recall_floor``). Op mode requires true_miss == 0.
# Quantized floors: one entry below the worst clean query of the indexer recall study (benchmarks/recall_study.py,
# benchmarks/results/2026-12-05-recall-study/summary_pooled.csv "recall_min"): the trained default, 16K, 64K and 256K
# tokens of stdlib code, 256 queries x 2 CSA layers per context, every quantized indexer the profiles offer (fp8,
# fp4, fp4-packed, fp4 without Hadamard) scoring the oracle's exact q / keys / weights. Worst query per k, up to 64K
# (16K and 64K pooled; all at 64K, fp4-no-hadamard) and at 256K (fp4-no-hadamard):
#   k=32:   11/32 = 0.34375 (fp4 12/32, fp8 25/32)   -> 10/32     | 256K: 0/32 (fp4 4/32, fp8 15/32)      -> none
#   k=128:  67/128 = 0.5234 (fp4 0.5859, fp8 0.8672) -> 66/128    | 256K: 4/128 (fp4 0.2188, fp8 0.6563)  -> 3/128
#   k=512:  320/512 = 0.625 (fp4 0.6387, fp8 0.9121) -> 319/512   | 256K: 54/512 (fp4 0.4531, fp8 0.8477) -> 53/512
#   k=1024: 701/1024 = 0.6846 (fp4 0.7080, fp8 0.9307) -> 700/1024 | 256K: 266/1024 (fp4 0.5869, fp8 0.8760) -> 265/1024
# A run past 64K takes the 256K floors, one past 256K too (not studied further); at 256K a clean FP4 indexer without
# the rotation can keep none of a query's exact top-32, so that k has no recall floor there. k=32 was 0.46875 (one
# entry below the harness's clean worst 0.5 on 2.3K-2.9K-token files), which correct 64K runs fail. Means at 64K / 256K:
# fp4 0.827 / 0.781 at k=512 and 0.853 / 0.808 at k=1024, against about 99.7% published for DeepSeek-V4, whose score
# sums over 64 index heads of 128 dims (here 4 of 64, and a model trained on 4096-token windows). bf16 stays 0.85:
# study worst 0.906 / 0.930 / 0.953 / 0.964 at 256K (k = 32 .. 1024), every bf16 miss within 1e-2 of the k-th score
# (a rounding tie, which op mode's miss_gap judges); harness clean worst 0.9375 (64 decode steps).
RECALL_FLOORS = {  # profile class -> longest context the floors hold for -> top-k -> floor (0: no floor)
    "bf16": {65536: dict.fromkeys((32, 128, 512, 1024), 0.85), 262144: dict.fromkeys((32, 128, 512, 1024), 0.85)},
    "quantized": {65536: {32: 10 / 32, 128: 66 / 128, 512: 319 / 512, 1024: 700 / 1024},
                  262144: {32: 0.0, 128: 3 / 128, 512: 53 / 512, 1024: 265 / 1024}},
}
DEFAULT_INDEX_TOPK = 32  # the shipped trained default's index_topk: the floor where a run's config is unknown
RECALL_FLOOR = {kind: bands[min(bands)][DEFAULT_INDEX_TOPK] for kind, bands in RECALL_FLOORS.items()}
# Op mode, indexer: the oracle's fp32 scores on the decoder's own q / keys / weights against the decoder's picks.
# miss_gap is the largest oracle-score gap the decoder's picks invert, in units of the query's largest score; the
# decoder's score arithmetic bounds it: fp32 (exact) ~1e-7; bf16 (every production profile: the official scores are
# bf16 einsum, ReLU, product and head sum) a few 2^-8: clean worst 0.0168 over every built-in profile on the trained
# default (16 and 64 decode steps, 4 held-out files; benchmarks/results/2026-12-04-clean-margins), about 4 bf16
# ulps; 5e-2 allows 12.
SCORE_TIE_MARGIN = {"exact": 1e-5, "bf16": 5e-2, "quantized": 5e-2}
# Layer mode, CSA attention when the decoder reports no top-k: the oracle layer picks its own entries, so the
# sites after the selection are compared on the queries whose oracle selection is unambiguous at this margin
# (the gap between the k-th and the next visible score, as above; ``harness.site_pairs``). A quantized indexer
# (FP4 / FP8 q and keys, errors of ~5-10% per score) has no such margin: its layers are compared on every query
# against CSA_LAYER_COS. Clean worst of the production decoder (reference) reporting only logits, embed and its
# residual, attn.core / attn.out and moe.out streams (benchmarks/calibrate_thresholds.py --sites ...): attn.core
# 0.9939 on the trained default (64 decode steps, default prompt and unittest/main.py), 0.9527 on random tiny
# weights (16 steps); the floor sits below both.
SELECTION_MARGIN = {"exact": 1e-4, "bf16": 3e-2}
CSA_LAYER_COS = 0.9
# Routing: routing_gap is the largest oracle gate-score gap a decoder's expert choice inverts (``probes.routing``;
# +inf for any flip of a hash layer, whose lookup has no near-tie). Op mode: the oracle's fp32 gate on the
# decoder's own MoE input (clean worst 0 for every built-in profile: its gate is fp32 too); layer mode adds the
# layer's attention error to that input (clean worst 0.0052 for bf16, 0.081 for the quantized profiles, fp8-fmha
# on unittest/main.py; same sweep as above).
ROUTING_GAP = {"exact": 1e-4, "bf16": 3e-2, "quantized": 3e-2}
ROUTING_GAP_LAYER = {"exact": 1e-3, "bf16": 1e-1, "quantized": 2.5e-1}
# hc_sinkhorn_iters = 20 ends on a column normalisation: columns sum to 1 to rounding (clean: ~1e-6), but rows of
# peaky (near-permutation) matrices stay off: up to 0.075 in the oracle itself on the trained default. Rows are
# therefore judged by their deviation beyond the oracle's own (row_dev_excess; clean worst 0.005 in layer mode),
# columns absolutely. Free mode mixes different streams (inherited error), so its rows are not compared.
SINKHORN_DEV = 1e-2
# A greedy-token disagreement is only a failure when the oracle's top-1 beat its top-2 by more than this many
# logits: below it the two candidates are a near tie that any rounding may flip (``agree`` stays informational).
TOKEN_FLIP_MARGIN = 1.0
# Bytes a decoder may add after the warm-up to what it holds (tensors reachable from it), to the CUDA allocator's
# reserved bytes, or to the CUDA bytes its calls keep beyond their outputs: +-50 MB over 1000 steps.
MEMORY_GROWTH_BAND = 50 * 2**20

MAIN_SITES = sites_regex(lambda site: site.gated)  # the site table's gated sites (q, kv, core, out, residual, ...)
ROWS_SITES = ".*"  # a different number of rows (tokens, entries, experts) than the oracle's, at any site
EXPECTED_NONFINITE = SITE.indexer_scores.regex  # -inf marks causally invisible entries in both models
NONFINITE_SITES = rf"(?!{EXPECTED_NONFINITE}$).*"
COMB_SITES = sites_regex(lambda site: site.probe == "sinkhorn")
KV_CACHE_SITES = sites_regex(lambda site: site.probe == "kv_storage")  # stored KV rows vs the decoder's own attn.kv


class ThresholdError(ValueError):
    """A threshold file or rule that cannot be used; the message names the file, key, expected and found."""


@dataclass(frozen=True)
class Threshold:
    """Rows at sites matching ``site_regex`` (full match) with metric ``metric`` must satisfy ``value op limit``."""

    site_regex: str
    metric: str
    op: str  # ">=", "<=" or "off"
    value: float
    source: str = "default"
    modes: tuple[str, ...] = ()  # comparison modes the rule judges; () = every mode

    def __post_init__(self) -> None:
        if self.op not in (">=", "<=", "off"):
            raise ThresholdError(f"threshold op: expected '>=', '<=' or 'off', found {self.op!r}")
        try:
            re.compile(self.site_regex)
        except re.error as err:
            raise ThresholdError(f"site regex {self.site_regex!r} is invalid: {err}") from None

    @property
    def text(self) -> str:
        return "off" if self.op == "off" else f"{self.op} {fmt_num(self.value)}"

    def matches(self, site: str, metric: str, mode: str | None = None) -> bool:
        in_mode = not self.modes or mode is None or mode in self.modes
        return metric == self.metric and in_mode and re.fullmatch(self.site_regex, site) is not None

    def to_dict(self) -> dict:
        return asdict(self)


def unmatched_rules(rules: Sequence[Threshold], site_names: Sequence[str]) -> list[Threshold]:
    """The rules whose ``site_regex`` fully matches none of ``site_names`` (a model's, ``sites.model_row_sites``):
    a misspelt regex judges nothing and would pass silently."""
    return [r for r in rules if not any(re.fullmatch(r.site_regex, name) for name in site_names)]


def fmt_num(v: float) -> str:
    """Six significant digits, more when that would round a value next to +-1 onto +-1 (cos 0.99999999)."""
    s = format(float(v), ".6g")
    return format(float(v), ".12g") if s in ("1", "-1") and abs(v) != 1 else s


def recall_floor(kind: str, index_topk: int | None = None, context: int | None = None) -> float:
    """The layer-mode recall floor of profile class ``kind`` ('bf16' or 'quantized') for a run at top-k
    ``index_topk`` over ``context`` tokens (prompt + decode steps): the floors of the shortest studied context band
    that holds ``context`` (past the longest, the longest's; None: the shortest), and in it the floor of the
    largest studied k <= ``index_topk`` (the study's recall rises with k at every precision and context, so a
    smaller k's floor is the conservative one; below them the smallest k's); None: DEFAULT_INDEX_TOPK. 0: no
    floor."""
    bands = RECALL_FLOORS[kind]
    band = min((c for c in bands if context is None or c >= context), default=max(bands))
    floors = bands[band]
    k = DEFAULT_INDEX_TOPK if index_topk is None else int(index_topk)
    return floors[max((t for t in floors if t <= k), default=min(floors))]


def profile_fields(profile: object) -> dict[str, str] | None:
    """The format fields of a profile (a ``Profile``, its dict as in a run manifest, or a profile spec string
    such as ``reference:fmha=fp8``); None for the exact names and for strings that name no profile."""
    if isinstance(profile, Mapping):
        return {k: str(profile[k]) for k in CHOICES if k in profile}
    if isinstance(profile, Profile):
        return {k: v for k, v in profile_dict(profile).items() if k in CHOICES}
    if str(profile) in EXACT_PROFILES or str(profile).startswith("exact"):
        return None
    try:
        return profile_fields(get_profile(str(profile)))
    except (ValueError, OSError):
        return None


def kv_scale_floor(profile: object) -> str:
    """The FP8 scale rule a decoder's stored KV rows are held to: its profile's ``kv_scale_floor`` ("amax", the
    official rule, where the profile does not name one). ValueError naming the profile for another value."""
    value = (profile_fields(profile) or {}).get("kv_scale_floor", "amax")
    if value not in CHOICES["kv_scale_floor"]:
        raise ValueError(f"profile {profile_label(profile)!r}: kv_scale_floor: expected one of "
                         f"{CHOICES['kv_scale_floor']}, found {value!r}")
    return value


def profile_class(profile: object) -> str:
    """'exact', 'bf16' or 'quantized', from the profile's fields (see the module docstring), or its ``precision``
    entry where a decoder states it. A string that names no profile is 'exact' for the exact names and
    'quantized' otherwise."""
    if isinstance(profile, Mapping) and profile.get("precision") in COS_GAP:
        return str(profile["precision"])  # a decoder that states its class (foreign decoders, traces)
    fields = profile_fields(profile)
    if fields is None:
        name = str(profile.get("name", "")) if isinstance(profile, Mapping) else str(profile)
        return "exact" if name in EXACT_PROFILES or name.startswith("exact") else "quantized"
    quantized = any(fields.get(k) in formats for k, formats in QUANTIZING_FIELDS.items())
    return "quantized" if quantized else "bf16"


def profile_label(profile: object) -> str:
    """A profile's name (a ``Profile``, a manifest dict or a string)."""
    if isinstance(profile, Mapping):
        return str(profile.get("name", "?"))
    return str(getattr(profile, "name", profile))


def csa_layers_regex(csa_layers: Sequence[int] | None, unknown: str = r"L\d+") -> str:
    """``L(2|4|...)`` for these layers of a config, ``unknown`` (default: every layer) when None, none for an
    empty list."""
    if csa_layers is None:
        return unknown
    if not csa_layers:
        return "(?!)"
    return "L(" + "|".join(str(i) for i in csa_layers) + ")"


def default_thresholds(profile: object, csa_layers: Sequence[int] | None = None, reports_topk: bool = True,
                       hash_layers: Sequence[int] | None = None, index_topk: int | None = None,
                       context: int | None = None) -> list[Threshold]:
    """The built-in rules for ``profile`` (a ``Profile``, a manifest's profile dict or a profile spec string).
    ``csa_layers`` (from the config) and ``reports_topk`` (whether the decoder reports ``L{i}.indexer.topk``)
    decide how CSA layers are held in layer mode; ``hash_layers`` are judged on exact routing in every mode;
    ``index_topk`` (the config's) and ``context`` (the run's prompt + decode tokens) pick the recall floor
    (``recall_floor``).

    op mode (a kernel alone, on the decoder's inputs) is held tightest; layer mode adds the layer's cache
    precision (a CSA layer attends the decoder's own top-k where it reports one, else the oracle's, compared on
    the queries whose selection is unambiguous, or, for a quantized indexer, against a floor); free mode inherits
    everything upstream and only guards against gross divergence of the output. Structural checks (non-finite,
    Sinkhorn, orientation, visible sets, row counts) hold in every mode, and so does the embedding (a table lookup:
    a mismatch there is the weights, the tokenizer or the vocabulary, not numerics).
    """
    kind = profile_class(profile)
    gap, layer_gap = COS_GAP[kind], LAYER_GAP[kind]
    fields = profile_fields(profile) or {}
    core_gap = CORE_GAP_FP8 if fields.get("fmha") in ("fp8", "fp8-nope") else CORE_GAP
    unrotated = kind == "quantized" and fields.get("hadamard") == "off" and fields.get("indexer_qk") in ("fp4", "fp8")
    qk_cos = INDEXER_QK_COS_UNROTATED if unrotated else INDEXER_QK_COS[kind]
    # downstream of the top-k
    csa = layer_sites_regex(SITE.attn_core, SITE.attn_out, SITE.moe_out, SITE.residual,
                            layers=csa_layers_regex(csa_layers))
    hashed = layer_sites_regex(SITE.moe_experts, layers=csa_layers_regex(hash_layers, unknown="(?!)"))
    qk = layer_sites_regex(SITE.indexer_q, SITE.indexer_keys)
    embed, visible, core, scores, topk, experts = (h.regex for h in (
        SITE.embed, SITE.attn_visible, SITE.attn_core, SITE.indexer_scores, SITE.indexer_topk, SITE.moe_experts))
    memory, sampler = ROW.memory.regex, ROW.sampler.regex
    rules = [
        Threshold(ROWS_SITES, "rows_missing", "<=", 0),
        Threshold(ROWS_SITES, "rows_extra", "<=", 0),
        Threshold(ROWS_SITES, "shape_mismatch", "<=", 0),
        Threshold(embed, "cos", ">=", 1 - gap),
        Threshold(".*", "nonfinite_mismatch", "<=", 0),
        # a NaN/Inf in the decoder is a failure where it first appears, even where the oracle has it too (a bad
        # weight): only the index scores hold -inf by design (causally invisible entries)
        Threshold(NONFINITE_SITES, "test_nonfinite", "<=", 0),
        Threshold(COMB_SITES, "row_dev_excess", "<=", SINKHORN_DEV, modes=("op", "layer")),
        Threshold(COMB_SITES, "col_dev", "<=", SINKHORN_DEV),
        Threshold(COMB_SITES, "min_value", ">=", 0),
        Threshold(COMB_SITES, "negative_count", "<=", 0),
        # the decoder's pre / post weights in their sigmoids' ranges, [0, 1 + hc_eps] / [0, 2] (every mode: no oracle)
        Threshold(r"L\d+\.mhc_(attn|ffn)\.(pre|post)", "range_excess", "<=", 0),
        # op mode only: there both combs come from the same streams; in layer and free mode a near-permutation comb
        # mixed from slightly different streams can land nearer the oracle's transpose (clean 512-step runs on the
        # trained default: a few such steps)
        Threshold(COMB_SITES, "orientation_flip", "<=", 0, modes=("op",)),
        # the decoder's stored KV rows hold its own attn.kv, packed with its profile's scale rule (every mode: no
        # oracle involved); rows only the other rule explains fail on their own metric, whose hint names the rule
        Threshold(KV_CACHE_SITES, "rows_mismatch", "<=", 0),
        Threshold(KV_CACHE_SITES, "rule_mismatch", "<=", 0),
        Threshold(KV_CACHE_SITES, "other_rule_rows", "<=", 0),
        Threshold(visible, "missing", "<=", 0),
        Threshold(visible, "extra", "<=", 0),
        Threshold(ROW.tokens.regex, "token_flip_with_margin", "<=", 0, modes=("free",)),
        Threshold(sampler, "pick_flip_with_margin", "<=", 0),
        Threshold(sampler, "sampler_impl_mismatch", "<=", 0),
        Threshold(ROW.stops.regex, "stop_mismatch", "<=", 0),
        Threshold(ROW.decoder.regex, "raised", "<=", 0),  # the decoder raised while it ran a call: the run ended there
        Threshold(memory, "cache_growth", "<=", 0),
        Threshold(memory, "reserved_growth", "<=", MEMORY_GROWTH_BAND),
        Threshold(memory, "retained_growth", "<=", MEMORY_GROWTH_BAND),
        Threshold(memory, "held_growth", "<=", MEMORY_GROWTH_BAND),
        Threshold(memory, "new_device_mallocs", "<=", 0),
        Threshold(MAIN_SITES, "cos", ">=", 1 - gap, modes=("op",)),
        Threshold(MAIN_SITES, "calc_diff", "<=", gap, modes=("op",)),
        Threshold(core, "cos", ">=", 1 - core_gap, modes=("op",)),
        Threshold(core, "calc_diff", "<=", core_gap, modes=("op",)),
        Threshold(scores, "cos", ">=", 1 - gap, modes=("op",)),
        Threshold(qk, "cos", ">=", qk_cos, modes=("op", "layer")),
        Threshold(COMB_SITES, "orientation_err", "<=", COMB_ERR, modes=("op",)),
        Threshold(topk, "miss_gap", "<=", SCORE_TIE_MARGIN[kind], modes=("op",)),
        Threshold(topk, "size_mismatch", "<=", 0),  # every precision picks index_topk entries
        Threshold(SITE.moe_weights.regex, "weight_max_err", "<=", ROUTING_WEIGHT_ERR, modes=("op",)),
        Threshold(experts, "routing_gap", "<=", ROUTING_GAP[kind], modes=("op",)),
        Threshold(experts, "routing_gap", "<=", ROUTING_GAP_LAYER[kind], modes=("layer",)),
        Threshold(hashed, "routing_gap", "<=", 0),  # a hash lookup has no near-tie: any flip, in any mode
        Threshold(MAIN_SITES, "cos", ">=", 1 - layer_gap, modes=("layer",)),
        Threshold(MAIN_SITES, "calc_diff", "<=", layer_gap, modes=("layer",)),
        Threshold(SITE.logits.regex, "cos", ">=", FREE_LOGITS_COS[kind], modes=("free",)),
    ]
    if kind == "quantized" and not reports_topk:
        # the oracle layer attends its own top-k, which an FP4 / FP8 indexer's picks differ from by whole entries
        rules += [Threshold(csa, "cos", ">=", CSA_LAYER_COS, modes=("layer",)),
                  Threshold(csa, "calc_diff", "off", 0, modes=("layer",))]
    if kind == "exact":
        rules.append(Threshold(topk, "miss_gap", "<=", SCORE_TIE_MARGIN[kind]))
    else:
        floor = recall_floor(kind, index_topk, context)
        if floor > 0:
            rules.append(Threshold(topk, "recall", ">=", floor, modes=("layer",)))
    return rules


def thresholds_for(profile: object, path: str | Path | None = None, csa_layers: Sequence[int] | None = None,
                   reports_topk: bool = True, hash_layers: Sequence[int] | None = None,
                   index_topk: int | None = None, context: int | None = None) -> list[Threshold]:
    """Defaults for ``profile`` followed by the rules of the TOML file ``path`` (which therefore win)."""
    return (default_thresholds(profile, csa_layers, reports_topk, hash_layers, index_topk, context)
            + (load_thresholds(path) if path is not None else []))


_SPEC = re.compile(r"\s*(<=|>=)\s*(\S+)\s*")


def load_thresholds(path: str | Path) -> list[Threshold]:
    """Read a TOML file mapping a quoted site regex to ``{metric = "<=1e-3" | ">=0.99" | "off"}``.

    Example: ``['L\\d+\\.attn\\.out']`` then ``cos = ">=0.995"`` on the next line.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ThresholdError(f"{path}: cannot read the threshold file: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ThresholdError(f"{path}: not valid TOML: {err}") from None
    rules = []
    for regex, table in data.items():
        if not isinstance(table, dict):
            raise ThresholdError(f"{path}: key {regex!r}: expected a table of metric = \"<=limit\" entries, "
                                 f"found {type(table).__name__} {table!r}")
        for metric, spec in table.items():
            rules.append(_parse_rule(path, regex, metric, spec))
    return rules


def _parse_rule(path: Path, regex: str, metric: str, spec: object) -> Threshold:
    where = f"{path}: key {regex!r}.{metric}"
    if isinstance(spec, dict):
        raise ThresholdError(f"{where}: expected a string like \"<=1e-3\", found a table; quote the site regex "
                             f"(['L3\\.attn\\.out']), a bare dotted key makes nested tables")
    if not is_metric(metric):
        raise ThresholdError(f"{where}: unknown metric; expected one of {', '.join(sorted(METRICS))}, "
                             + ", ".join(METRIC_PATTERNS))
    source = path.name
    if spec == "off":
        return _rule(where, regex, metric, "off", 0.0, source)
    m = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    limit = _to_float(m.group(2)) if m else None
    if m is None or limit is None or math.isnan(limit):
        raise ThresholdError(f"{where}: expected a string \"<=number\", \">=number\" or \"off\", "
                             f"found {type(spec).__name__} {spec!r}")
    return _rule(where, regex, metric, m.group(1), limit, source)


def _rule(where: str, regex: str, metric: str, op: str, limit: float, source: str) -> Threshold:
    try:
        return Threshold(regex, metric, op, limit, source)
    except ThresholdError as err:
        raise ThresholdError(f"{where}: {err}") from None


def _to_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def wide(rows: pd.DataFrame) -> pd.DataFrame:
    """Long rows -> one row per (run_id, mode, profile, step, phase, position, layer, site), one column per
    metric; NaN values are kept (a metric whose every value is NaN still gets its column)."""
    keys = [c for c in COLUMNS if c not in ("metric", "value")]
    if "rank" in rows.columns:  # one rank's own tensor: not the site's value
        rows = rows[rows["rank"].isna()]
    unique = rows.drop_duplicates([*keys, "metric"])
    return unique.set_index([*keys, "metric"])["value"].unstack("metric").reset_index().rename_axis(columns=None)


def token_flip_rows(df: pd.DataFrame, margin: float = TOKEN_FLIP_MARGIN) -> pd.DataFrame:
    """Derived rows ``tokens / token_flip_with_margin``: 1.0 where tokens disagree and ref_margin > ``margin``
    (a NaN margin counts as a flip: the oracle's logits are not finite there)."""
    tok = df[(df["site"] == "tokens") & df["metric"].isin(["agree", "ref_margin"])]
    keys = [c for c in COLUMNS if c not in ("metric", "value")]
    if tok.empty:
        return df.iloc[0:0][list(COLUMNS)]
    table = wide(tok).reindex(columns=[*keys, "agree", "ref_margin"])
    flip = (table["agree"] == 0) & ~(table["ref_margin"] <= margin)
    return table[keys].assign(metric="token_flip_with_margin", value=flip.astype(float))


def apply_thresholds(df: pd.DataFrame, thresholds: Sequence[Threshold] | None = None,
                     token_margin: float = TOKEN_FLIP_MARGIN) -> pd.DataFrame:
    """Rows that have a rule, with columns ``op``, ``limit``, ``threshold``, ``rule``, ``source``,
    ``rule_index`` (the rule's position in ``thresholds``) and ``passed``.

    ``thresholds=None`` uses ``default_thresholds`` of each row's profile name (no config: CSA rules for every
    layer); a run is judged with the rules stored in its manifest instead. Derived token-flip rows are included.
    """
    flips = token_flip_rows(df, token_margin)
    full = pd.concat([df, flips], ignore_index=True) if not flips.empty else df
    if thresholds is None:
        parts = [_judge(g, default_thresholds(str(p))) for p, g in full.groupby("profile", sort=False)]
        return pd.concat(parts, ignore_index=True) if parts else _judge(full, [])
    return _judge(full, thresholds)


def _judge(df: pd.DataFrame, thresholds: Sequence[Threshold]) -> pd.DataFrame:
    """Rules judge whole-call aggregates (position -1); per-position rows are informational."""
    df = df[df["position"] == -1]
    rows = []
    for site, metric, mode in df[["site", "metric", "mode"]].drop_duplicates().itertuples(index=False):
        index = next((k for k in reversed(range(len(thresholds))) if thresholds[k].matches(site, metric, mode)), None)
        rule = thresholds[index] if index is not None else None
        if rule is not None and rule.op != "off":
            rows.append((site, metric, mode, rule.op, float(rule.value), rule.text, rule.site_regex, rule.source,
                         index))
    table = pd.DataFrame(rows, columns=["site", "metric", "mode", "op", "limit", "threshold", "rule", "source",
                                        "rule_index"])
    out = df.merge(table, on=["site", "metric", "mode"], how="inner")
    value = out["value"].astype(float)
    out["passed"] = np.where(out["op"] == ">=", value >= out["limit"], value <= out["limit"])
    return out


def evaluate(df: pd.DataFrame, thresholds: Sequence[Threshold] | None = None,
             token_margin: float = TOKEN_FLIP_MARGIN) -> pd.DataFrame:
    """The failing rows with their rule (``op``, ``limit``, ``threshold``, ``rule``), in divergence order."""
    judged = apply_thresholds(df, thresholds, token_margin)
    return sort_divergence(judged[~judged["passed"]].drop(columns="passed"))


_LAYER_SITE = re.compile(r"L(\d+)\.(.+)")


def site_order_key(site: str) -> tuple[int, int, int]:
    """(group, layer, rank): sites before the layers, then layer by layer in data-flow order, then the rest."""
    m = _LAYER_SITE.fullmatch(site)
    if m:
        suffix = m.group(2)
        rank = LAYER_SITE_ORDER.index(suffix) if suffix in LAYER_SITE_ORDER else len(LAYER_SITE_ORDER)
        return (1, int(m.group(1)), rank)
    if site in SITES_BEFORE_LAYERS:
        return (0, 0, SITES_BEFORE_LAYERS.index(site))
    rank = SITES_AFTER_LAYERS.index(site) if site in SITES_AFTER_LAYERS else len(SITES_AFTER_LAYERS)
    return (2, 0, rank)


def is_local(rows: pd.DataFrame) -> pd.Series:
    """bool per row: evidence of error made where it is seen: op and layer mode, and free mode at the sites with
    no upstream (the embedding: the same token ids go in)."""
    return rows["mode"].isin(LOCAL_MODES) | rows["site"].isin(SITES_WITHOUT_UPSTREAM)


def sort_divergence(rows: pd.DataFrame) -> pd.DataFrame:
    """Local failures first (``is_local``), by site in data-flow order, then mode (op, layer, free), step,
    position and metric priority: the earliest site that fails locally, at its first step, leads. Then the rest
    (free mode: inherited error), by step, site, mode, position and metric priority."""
    if rows.empty:
        return rows.reset_index(drop=True)
    sites = sorted(rows["site"].unique(), key=site_order_key)
    metrics = sorted(rows["metric"].unique(), key=lambda m: (METRIC_PRIORITY.index(m) if m in METRIC_PRIORITY
                                                             else len(METRIC_PRIORITY), m))
    local = is_local(rows).to_numpy()
    step = rows["step"].to_numpy()
    site = rows["site"].map({s: i for i, s in enumerate(sites)}).to_numpy()
    order = pd.DataFrame({
        "_inherited": ~local,
        "_first": np.where(local, site, step),
        "_second": np.where(local, 0, site),
        "_mode": rows["mode"].map({m: i for i, m in enumerate(MODES)}).fillna(len(MODES)).to_numpy(),
        "_step": step,
        "_pos": rows["position"].to_numpy(),
        "_metric": rows["metric"].map({m: i for i, m in enumerate(metrics)}).to_numpy(),
    }, index=rows.index)
    return rows.loc[order.sort_values(list(order.columns), kind="stable").index].reset_index(drop=True)


# What a first divergence at these sites means beyond its numbers (the verdict line names it).
SITE_HINTS = {
    "embed": "the decoder's embeddings are not the checkpoint's: wrong weights, tokenizer or vocabulary mapping",
}
# ... and at these metrics (any site)
METRIC_HINTS = {
    "other_rule_rows": "the stored KV rows follow the other FP8 scale-floor rule, not the profile's kv_scale_floor "
                       "('amax': max(amax, 1e-4) / 448, the official rule; 'scale': max(amax / 448, 1e-4), "
                       "FlashMLA's): judge them with the engine's rule (kv_scale_floor in its profile); the rules "
                       "differ only for blocks with amax below 0.0274, so this is the rule, not a bug",
    "rule_mismatch": "the stored KV rows' FP8 scales follow neither scale-floor rule (kv_scale_floor 'amax' or "
                     "'scale') for their codes: a quantizer or cache layout bug",
    "rows_mismatch": "the stored KV rows do not decode to the decoder's own attn.kv: a cache layout or store bug",
}


@dataclass(frozen=True)
class Divergence:
    """The first failing row: ``str()`` gives 'step 3 (decode), L2.attn.out cos 0.95 < 0.99 (layer mode)',
    followed by what it means at sites with a hint and by the count of the inherited (free-mode) failures after
    a local one (``consequences``)."""

    step: int
    phase: str
    site: str
    metric: str
    value: float
    op: str
    limit: float
    mode: str
    position: int
    consequences: int = 0  # free-mode failures at later sites or steps: inherited from this one
    first_consequence: str = ""  # the earliest of them, 'logits (step 0)'
    ranks_failed: tuple[int, ...] = ()  # tensor-parallel ranks whose own tensor fails a check at this site
    ranks: int = 0  # ranks judged one by one at this site (0: a tensor of no ranks)

    def rank_text(self) -> str:
        """' on rank 1 of 2' where some ranks' own tensors fail, ' on every rank (2 of 2)' where all do."""
        if not self.ranks or not self.ranks_failed:
            return ""
        if len(self.ranks_failed) == self.ranks:
            return f" on every rank ({self.ranks} of {self.ranks}: not one rank's shard)"
        which = ", ".join(map(str, self.ranks_failed))
        return f" on rank{'s' if len(self.ranks_failed) > 1 else ''} {which} of {self.ranks}"

    def __str__(self) -> str:
        if math.isnan(self.value):
            check = f"{self.metric} nan (expected {self.op} {fmt_num(self.limit)})"
        else:
            check = f"{self.metric} {fmt_num(self.value)} {'<' if self.op == '>=' else '>'} {fmt_num(self.limit)}"
        where = f"{self.mode} mode" + (f", position {self.position}" if self.position >= 0 else "")
        text = f"step {self.step} ({self.phase}), {self.site}{self.rank_text()} {check} ({where})"
        hint = SITE_HINTS.get(self.site) or METRIC_HINTS.get(self.metric)
        if hint:
            text += f": {hint}"
        if self.consequences:
            many = self.consequences > 1
            text += (f"; {self.consequences} free-mode failure{'s' if many else ''} downstream "
                     f"follow{'' if many else 's'} from it (first: {self.first_consequence})")
        return text


def blame_ranks(div: Divergence, judged: pd.DataFrame) -> Divergence:
    """``div`` with the ranks whose own tensor fails a check (rows with a ``rank``: a sharded site judged one rank
    at a time) at the same step, mode and site (a scaled shard keeps its own cosine: its calc_diff fails)."""
    if "rank" not in judged.columns:
        return div
    own = judged[judged["rank"].notna() & (judged["step"] == div.step) & (judged["mode"] == div.mode)
                 & (judged["site"] == div.site)]
    if own.empty:
        return div
    failed = tuple(sorted(int(r) for r in own.loc[~own["passed"], "rank"].unique()))
    return dataclasses.replace(div, ranks_failed=failed, ranks=int(own["ranks"].max()))


def first_divergence(failures: pd.DataFrame) -> Divergence | None:
    """The earliest site that fails locally (op, then layer mode; ``sort_divergence``) at its first step, else the
    earliest free-mode failure; None when nothing failed. A local first divergence counts the free-mode failures
    downstream of it as its consequences."""
    if failures.empty:
        return None
    ordered = sort_divergence(failures)
    r = ordered.iloc[0]
    consequences, first = 0, ""
    if is_local(ordered.iloc[:1]).iloc[0]:
        origin = site_order_key(str(r["site"]))
        later = ordered[~is_local(ordered)]
        later = later[[site_order_key(s) > origin and (s in NUMERIC_AFTER_LAYERS or site_order_key(s)[0] < 2)
                       for s in later["site"]]]
        consequences = len(later)
        if consequences:
            c = later.sort_values(["step"], kind="stable").iloc[0]
            first = f"{c['site']} {c['metric']} (step {int(c['step'])})"
    return Divergence(int(r["step"]), str(r["phase"]), str(r["site"]), str(r["metric"]), float(r["value"]),
                      str(r["op"]), float(r["limit"]), str(r["mode"]), int(r["position"]), consequences, first)
