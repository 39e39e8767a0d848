"""Judging the mutant gate: which probe caught each run's first failure, where, and whether that is where the mutant
was planted (the detection matrix: a row per run and probe plus its "first" row), and why the gate fails."""

from __future__ import annotations

import re

import pandas as pd

from fidelity.decoders.base import raised
from fidelity.harness.thresholds import first_divergence, sort_divergence
from fidelity.model.config import ModelConfig
from fidelity.studies.mutants import CATALOGUE, Mutant, where_label

PROBE_OF_METRIC = {
    "cos": "similarity", "calc_diff": "similarity", "nonfinite_mismatch": "similarity",
    "row_dev": "sinkhorn", "row_dev_excess": "sinkhorn", "col_dev": "sinkhorn", "min_value": "sinkhorn",
    "negative_count": "sinkhorn", "orientation_flip": "sinkhorn", "orientation_err": "sinkhorn",
    "range_excess": "sinkhorn",
    "recall": "indexer", "true_miss": "indexer", "miss_gap": "indexer", "size_mismatch": "indexer",
    "missing": "visible", "extra": "visible",
    "weight_max_err": "routing", "routing_gap": "routing",
    "rows_missing": "rows", "rows_extra": "rows", "shape_mismatch": "rows",
    "token_flip_with_margin": "tokens", "pick_flip_with_margin": "sampler", "sampler_impl_mismatch": "sampler",
    "stop_mismatch": "stops",
    "cache_growth": "memory",
    "reserved_growth": "memory",
    "retained_growth": "memory",
    "held_growth": "memory",
    "new_device_mallocs": "memory",
}  # fmt: skip
PROBES = ("similarity", "sinkhorn", "indexer", "visible", "routing", "rows", "tokens", "sampler", "stops", "memory")


def _split_site(site: str) -> tuple[int, str]:
    m = re.fullmatch(r"L(\d+)\.(.+)", site)
    return (int(m.group(1)), m.group(2)) if m else (-1, site)


def detection_rows(name: str, judged: pd.DataFrame, mutant: Mutant | None, cfg: ModelConfig) -> list[dict]:
    """One row per probe: detected?, first (step, layer, site), metric value vs threshold, located?"""
    failures = sort_divergence(judged[~judged["passed"]].drop(columns="passed"))
    first = first_divergence(failures)
    rows = []
    for probe in PROBES:
        hits = failures[failures["metric"].map(PROBE_OF_METRIC).eq(probe)]
        row = {"mutant": name, "probe": probe, "detected": not hits.empty}
        if not hits.empty:
            h = hits.iloc[0]
            row.update(step=int(h["step"]), layer=int(h["layer"]), site=str(h["site"]), metric=str(h["metric"]),
                       value=float(h["value"]), threshold=str(h["threshold"]), mode=str(h["mode"]))
        rows.append(row)
    summary = {"mutant": name, "probe": "first", "detected": first is not None}
    if first is not None:
        layer, site = _split_site(first.site)
        summary.update(step=first.step, layer=layer, site=first.site, metric=first.metric, value=first.value,
                       threshold=f"{first.op} {first.limit:g}", mode=first.mode)
        if mutant is not None:
            summary["located"] = bool(re.fullmatch(mutant.site, site)) and layer in mutant.layers(cfg)
    if mutant is not None:
        summary["expected"] = _expected_site(mutant, cfg)
    return [summary] + rows


def _expected_site(mutant: Mutant, cfg: ModelConfig) -> str:
    layers = sorted(mutant.layers(cfg))
    where = mutant.site.replace("\\", "")
    return where if layers == [-1] else f"L{{{','.join(map(str, layers))}}}.{where}"


def crash_row(name: str, err: BaseException, mutant: Mutant | None, cfg: ModelConfig) -> dict:
    """The "first" row of a run whose decoder raised outside a judged call (a script as it played): detected (the
    run stopped) but located by no probe; ``crash`` holds the exception's type and first line. (A raise inside a
    judged call ends the run there: ``Runner.run``; its rows up to that call are judged as usual.)"""
    row = {"mutant": name, "probe": "first", "detected": True, "crash": raised(err)}
    if mutant is not None:
        row.update(located=False, expected=_expected_site(mutant, cfg))
    return row


def gate_failures(matrix: pd.DataFrame) -> list[str]:
    """Why ``--gate`` fails: the clean decoder alarmed on a scenario run, a mutant went undetected on its run or
    was found elsewhere than planted, or it alarmed on a run where it cannot show; a run whose decoder raised,
    unless a probe had located the mutant where planted before the raise."""
    first = matrix[matrix["probe"] == "first"]
    out = []
    for r in first.itertuples():
        where = where_label(r.scenario, r.run, r.decode_steps)
        expect = getattr(r, "expect", "clean" if r.mutant == "clean" else "caught")
        crash = getattr(r, "crash", None)
        if isinstance(crash, str) and not (expect == "caught" and r.located):  # caught where planted, then raised
            who = "clean decoder" if expect == "clean" else r.mutant
            out.append(f"{who}: the decoder raised on {where} ({crash})"
                       + (", where it cannot show" if expect == "silent" else "")
                       + ("; no probe located it" if expect == "caught" else ""))
        elif expect == "clean":
            if r.detected:
                out.append(f"clean decoder raised an alarm on {where}: {r.site} {r.metric} {r.value:g} "
                           f"({r.threshold})")
        elif expect == "silent":
            if r.detected:
                out.append(f"{r.mutant}: detected on {where}, where it cannot show: {r.site} {r.metric} "
                           f"{r.value:g} ({r.threshold})")
        elif expect == "caught" and not r.detected:
            out.append(f"{r.mutant}: not detected on {where}")
        elif expect == "caught" and not r.located:
            out.append(f"{r.mutant}: first detected at {r.site} (step {int(r.step)}, {r.mode} mode) on {where}, "
                       f"expected {r.expected}")
    return out


def _first_cell(r) -> str:
    if r.get("expect") == "cannot show":
        return f"cannot show: {r['note']}"
    crash = r.get("crash") if isinstance(r.get("crash"), str) else None
    probe_first = isinstance(r.get("site"), str) and r.get("site") != "decoder"  # a probe's failure before the raise
    if crash and not probe_first:
        return f"the decoder raised: {crash}"
    if not r.detected:
        return "none"
    cell = f"step {int(r.step)} {r.site} {r.metric} {r['value']:.4g} ({r.threshold}, {r['mode']})"
    return cell + (f"; then the decoder raised: {crash}" if crash else "")


def matrix_table(matrix: pd.DataFrame) -> pd.DataFrame:
    """(mutant, scenario run) x probe table: first detection step/site per probe, '-' when the probe stayed
    silent; the clean decoder's runs first, then the mutants in catalogue order. A run given other decode steps
    than its own (``MutantSettings.decode_steps``) says so."""
    key = ["mutant", "scenario run"]
    profiles = matrix["profile"] if "profile" in matrix else pd.Series("reference", index=matrix.index)
    label = [where_label(*w) + ("" if p in ("reference", None) or p != p else f" [profile {p}]")
             for *w, p in zip(matrix["scenario"], matrix["run"], matrix["decode_steps"], profiles, strict=True)]
    matrix = matrix.assign(**{"scenario run": label})
    probe_rows = matrix[matrix["probe"] != "first"]
    cell = [f"step {int(r.step)} {r.site}" if r.detected else "-" for r in probe_rows.itertuples()]  # none: cannot show
    wide = probe_rows.assign(cell=cell).pivot(index=key, columns="probe", values="cell")
    first = matrix[matrix["probe"] == "first"].set_index(key)
    wide = wide.reindex(first.index).fillna("-")  # a mutant listed as "cannot show" has no probe rows
    wide.insert(0, "first detection", first.apply(_first_cell, axis=1))
    if "located" in first:
        wide.insert(1, "where planted", first["expected"].fillna("-"))
        wide.insert(2, "located", first["located"].map({True: "yes", False: "NO"}).fillna("-"))
    if "expect" in first:
        wide.insert(3 if "located" in first else 1, "expect", first["expect"])
    order = {name: k for k, name in enumerate(["clean"] + [m.name for m in CATALOGUE])}
    keys = sorted(first.index, key=lambda mk: order.get(mk[0], len(order)))  # clean runs in run order
    return wide.reindex(keys).reset_index()
