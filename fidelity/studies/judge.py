"""Judging a scenario: its self-consistency pairs through the logits-pair probe and threshold rules, and the matrix
columns of a run judged against the oracle.

A pair is two logits tables of the same positions from one decoder fed the same tokens two ways. The probe
(``probes.logits_pair``) turns them into metric rows on the site ``logits`` in mode ``self``; the rules judge the
whole-pair rows (position -1) with ``apply_thresholds`` as a run's rows are judged: ``unequal <= 0`` where the
decoder promises equal bits (``Decoder.same_bits``), else the bounds ``cos_min >= COS_MIN``, ``rel_l2_mean <=
REL_L2_MAX`` and ``nonfinite_mismatch <= 0``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import torch

from fidelity.decoders.base import Decoder
from fidelity.harness.thresholds import COLUMNS, Divergence, Threshold, apply_thresholds
from fidelity.studies.catalogue import Check, Pair, Run, Scenario
from fidelity.studies.site_checks import SiteRows, compare
from probes.logits_pair import logits_pair

# the bounds of a pair whose bits may differ: the smallest cosine of two logits rows at one position and the mean
# over positions of |b - a| / |a| (L2 per row). The clean production decoder (reference profile, trained default,
# CPU) stays at cos >= 0.969 and rel_l2 <= 0.032 (docs/scenarios.md); a chunk's positions restarted at 0 gives
# cos 0.55-0.90, rel_l2 0.04-0.28.
COS_MIN = 0.95
REL_L2_MAX = 0.04
SITE, MODE = "logits", "self"
BITWISE_RULES = (Threshold(SITE, "unequal", "<=", 0, "self-consistency", (MODE,)),)
BOUND_RULES = (Threshold(SITE, "cos_min", ">=", COS_MIN, "self-consistency", (MODE,)),
               Threshold(SITE, "rel_l2_mean", "<=", REL_L2_MAX, "self-consistency", (MODE,)),
               Threshold(SITE, "nonfinite_mismatch", "<=", 0, "self-consistency", (MODE,)))
PAIR_COLUMNS = ("scenario", "pair", "b", "a", "positions", "bitwise promised", "bitwise", "max_abs", "rel_max",
                "rel_l2", "cos_min", "worst_position", "bound", "passed", "site", "site_check", "site_detail")


def pair_rows(a: torch.Tensor, b: torch.Tensor, positions: list[int], label: str) -> pd.DataFrame:
    """The probe's metric rows of logits ``a`` (reference side), ``b`` [n, vocab] at ``positions`` [n]: a row per
    position and per-position metric, and the whole-pair metrics at position -1 (the rows the rules judge)."""
    rows = []
    for metric, value in logits_pair(a, b).items():
        values = value.double().cpu()
        where = positions if values.ndim else [-1]
        rows += [(label, MODE, "-", 0, "self", p, -1, SITE, metric, float(v))
                 for p, v in zip(where, values.reshape(-1).tolist(), strict=True)]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def judge_pair(a: torch.Tensor, b: torch.Tensor, positions: list[int], promised: str, label: str) -> dict:
    """The pairs table's columns of one pair: its whole-pair metrics, the position with the largest relative L2,
    the rules' text and whether every rule passes (``promised``: why equal bits are promised, '' for the bounds)."""
    df = pair_rows(a, b, positions, label)
    rules = BITWISE_RULES if promised else BOUND_RULES
    judged = apply_thresholds(df, rules)
    whole = df[df["position"] == -1].set_index("metric")["value"]
    per = df[(df["position"] >= 0) & (df["metric"] == "rel_l2")]
    return {"bitwise promised": promised or "no", "bitwise": bool(whole["unequal"] == 0),
            "max_abs": whole["max_abs"], "rel_max": whole["rel_max"], "rel_l2": whole["rel_l2_mean"],
            "cos_min": whole["cos_min"], "worst_position": int(per.loc[per["value"].idxmax(), "position"]),
            "bound": ", ".join(f"{r.metric} {r.text}" for r in rules),
            "passed": bool(len(judged) == len(rules) and judged["passed"].all())}


def pair_span(pair: Pair, a: Run, b: Run) -> range:
    """The positions ``pair`` compares: ``b``'s prompt (prefix), ``b``'s decode steps inside ``a``'s prompt
    (decode==prefill), or every position both runs have (chunked==whole)."""
    if pair.kind == "prefix":
        return range(0, b.prompt_len)
    if pair.kind == "decode==prefill":
        return range(b.prompt_len, min(b.positions, a.prompt_len))
    return range(0, min(a.positions, b.positions))


def pair_split(pair: Pair, a: Run, b: Run) -> tuple[int, ...] | None:
    """The call boundaries one side of ``pair`` has and the other lacks over the compared positions, or None where
    the sides compute the positions differently (a decode step against a prefill row: no equal bits to promise)."""
    if pair.kind == "chunked==whole":
        return tuple(sorted(set(a.boundaries()) ^ set(b.boundaries())))
    if pair.kind == "prefix":
        inside = {p for p in a.boundaries() if p < b.prompt_len}
        return tuple(sorted(inside ^ set(b.boundaries()) | {b.prompt_len}))
    return None


def check_pair(scenario: Scenario, pair: Pair, logits: dict[str, torch.Tensor], decoder: Decoder) -> dict:
    """One pair of two runs' logits ({run label: [positions, vocab]}) judged: a row of the pairs table."""
    a, b = scenario.run(pair.a), scenario.run(pair.b)
    span = pair_span(pair, a, b)
    split = pair_split(pair, a, b)
    promised = decoder.same_bits(split) if split is not None else ""
    got = judge_pair(logits[a.label][span.start : span.stop], logits[b.label][span.start : span.stop],
                     list(span), promised, f"{scenario.name}: {pair.kind} {b.label}")
    return {"scenario": scenario.name, "pair": pair.kind, "a": a.label, "b": b.label,
            "positions": f"{span.start}-{span.stop - 1}", **got}


def check_script_pair(scenario: Scenario, check: Check, rows: dict[str, dict[int, dict[int, torch.Tensor]]],
                      decoder: Decoder, sites: dict[str, dict[int, SiteRows]] | None = None) -> dict:
    """One check of two played sequences ({script: {seq: {position: logits [vocab]}}}) judged at the positions both
    computed: a row of the pairs table. With ``sites`` ({script: {seq: SiteRows}}) the sequences' sites are
    compared too (``site_checks.compare``): a site that breaks fails the pair."""
    a, b = rows[check.a[0]][check.a[1]], rows[check.b[0]][check.b[1]]
    span = sorted(set(a) & set(b))
    why = decoder.same_bits(check.split) if check.bitwise else ""
    got = judge_pair(torch.stack([a[p] for p in span]), torch.stack([b[p] for p in span]), span,
                     f"{why}: {check.bitwise}" if why else "", f"{scenario.name}: {check.kind} {check.b}")
    got["logits_passed"] = got["passed"]
    site = {"site": "", "site_check": "", "site_detail": "not recorded" if sites is not None else ""}
    sa, sb = ((sites or {}).get(side[0], {}).get(side[1]) for side in (check.a, check.b))
    if sa is not None and sb is not None:
        v = compare(sa, sb, span, bool(why), decoder.config)
        site = {"site": v.site, "site_check": v.check, "site_detail": v.detail, "site_stats": v.stats}
        got["passed"] = got["passed"] and not v.check
    return {"scenario": scenario.name, "pair": check.kind, "a": f"{check.a[0]} / seq {check.a[1]}",
            "b": f"{check.b[0]} / seq {check.b[1]}", "positions": f"{span[0]}-{span[-1]} ({len(span)})", **got,
            **site}


def worst_local_cos(run_dir: Path) -> float:
    """The smallest cos of any site in layer or op mode (the error a layer or an op adds), NaN without them."""
    df = pd.read_parquet(run_dir / "metrics.parquet", columns=["mode", "metric", "value"])
    rows = df[(df["metric"] == "cos") & df["mode"].isin(("layer", "op"))]["value"]
    return float(rows.min()) if len(rows) else float("nan")


def divergence_columns(div: Divergence | None) -> dict:
    """The matrix's first-divergence columns: its step, site and layer (-1 for a site outside the layers); step -1,
    site 'none' for a run without one."""
    if div is None:
        return {"first_step": -1, "first_site": "none", "first_layer": -1}
    m = re.match(r"L(\d+)\.", div.site)
    return {"first_step": div.step, "first_site": div.site, "first_layer": int(m.group(1)) if m else -1}
