"""The scenarios report (``fidelity scenarios``): report.md and report.html read like a run's report (the verdict
first, then what ran, the plots, the scenario matrix with a link to each run's own report, the self-consistency
pairs, the skipped scenarios), with matrix.csv, pairs.csv and plots/ beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fidelity.harness.thresholds import site_order_key
from fidelity.outputs.plots import DPI, FLOOR
from fidelity.outputs.report import Section, render_html, render_markdown

CAPTIONS = {"worst_local_cos.png": "1 - worst local cos (layer / op mode) per run, over prompt length and over "
                                   "chunk size",
            "first_divergence.png": "Where each run first diverges from the oracle, over prompt length and over "
                                    "chunk size"}


class ScenarioOutcome(Protocol):
    """What the report reads of a scenarios job's result (``fidelity.studies.scenarios.ScenarioResult``)."""

    out_dir: Path
    matrix: pd.DataFrame  # a row per run judged against the oracle
    pairs: pd.DataFrame  # a row per self-consistency pair
    seconds: float
    skipped: dict[str, str]
    resumed: str  # what a resumed job reused and redid ('' for a job that was not resumed)

    @property
    def passed(self) -> bool: ...

    def failures(self) -> list[str]: ...

    def verdict(self) -> str: ...


MATRIX_COLUMNS = ("scenario", "run", "parameter", "verdict", "first_divergence", "worst_local_cos",
                  "self_consistency", "seconds")

MARKERS = "osD^v<>ph*"


def _panels(matrix: pd.DataFrame) -> list[tuple[pd.DataFrame, str, str]]:
    """(rows, x column, x label) of the two panels: every run over prompt length, the chunks scenario's runs of
    one chunk size over that size."""
    chunked = matrix[(matrix["param_name"] == "chunk") & (matrix["param_value"] > 0)]
    return [(matrix, "prompt_len", "prompt length (tokens)"),
            (chunked, "param_value", "prefill chunk size (tokens; the whole prompt is the largest)")]


NO_CHUNKS = "no run of the chunks scenario in this report"


def _no_data(ax, empty: bool, why: str) -> bool:
    """Write on an empty panel why it is empty; returns ``empty``."""
    if empty:
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#555")
    return empty


def plot(matrix: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    local_cos_figure(matrix).savefig(path, dpi=DPI)
    return path


def local_cos_figure(matrix: pd.DataFrame) -> Figure:
    """1 - worst local cos over prompt length (every run) and over chunk size (the chunks scenario); a failing run
    is drawn as a red cross; an empty panel says why."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, (panel, x, xlabel) in zip(axes, _panels(matrix), strict=True):
        rows = panel.dropna(subset=["worst_local_cos"])  # free mode only, or nothing judged: no point
        for name, group in rows.groupby("scenario", sort=False):
            y = (1 - group["worst_local_cos"]).clip(lower=FLOOR)
            ax.scatter(group[x], y, label=name, s=18)
            bad = group[group["verdict"] != "PASS"]
            ax.scatter(bad[x], (1 - bad["worst_local_cos"]).clip(lower=FLOOR), marker="x", color="red", s=50)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("1 - worst local cos (layer/op)")
        if _no_data(ax, not len(rows), NO_CHUNKS if x == "param_value" and not len(panel) else
                    "no run judged in layer or op mode (free mode has no local cos)"):
            continue
        ax.set_yscale("log")
        if x == "param_value":
            ax.set_xscale("log")
    if len(matrix.dropna(subset=["worst_local_cos"])):
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle("worst local cos per run (red x: the run fails against the oracle)")
    return fig


def divergence_rows(matrix: pd.DataFrame) -> tuple[pd.Series, dict[float, str]]:
    """The first-divergence plot's y per run and its tick labels {y: label}: a layer site at its layer index, a
    site before the layers (embed) below layer 0, one after them (logits, tokens, ...) above the last layer, in
    data-flow order; runs without a divergence on a baseline row ('none') under all of them."""
    sites, layers = matrix["first_site"].astype(str), matrix["first_layer"].astype(int)
    failing = sites != "none"
    inside = failing & (layers >= 0)
    top = int(layers[inside].max()) if inside.any() else -1
    outside = sorted(set(sites[failing & ~inside]), key=site_order_key)
    before = [s for s in outside if site_order_key(s)[0] == 0]
    after = [s for s in outside if site_order_key(s)[0] != 0]
    at = {s: k - len(before) for k, s in enumerate(before)} | {s: top + 1 + k for k, s in enumerate(after)}
    y = pd.Series([layer if layer >= 0 else at.get(site, 0) for site, layer in zip(sites, layers, strict=True)],
                  index=matrix.index, dtype=float)
    none = (float(y[failing].min()) if failing.any() else 0.0) - 1.5
    ticks = {float(v): f"L{int(v)}" for v in sorted(set(y[inside]))} | {float(v): s for s, v in at.items()}
    return y.where(failing, none), {none: "none (passes)", **ticks}


def divergence_figure(matrix: pd.DataFrame) -> Figure:
    """The layer (or site outside the layers) of each run's first divergence over prompt length and over chunk
    size, a marker per scenario; passing runs on the 'none' row below a dashed line."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    y, ticks = divergence_rows(matrix)
    markers = {name: MARKERS[k % len(MARKERS)] for k, name in enumerate(matrix["scenario"].unique())}
    for ax, (rows, x, xlabel) in zip(axes, _panels(matrix), strict=True):
        _no_data(ax, not len(rows), NO_CHUNKS if x == "param_value" else "no run in this report")
        for name, group in rows.groupby("scenario", sort=False):
            ax.scatter(group[x], y[group.index], marker=markers[name], s=24, label=name)
        if x == "param_value" and len(rows):
            ax.set_xscale("log")
        ax.set_yticks(list(ticks), list(ticks.values()), fontsize=8)
        ax.axhline(min(ticks) + 0.75, color="grey", ls="--", lw=0.8)
        ax.set(xlabel=xlabel, ylabel="first divergence: layer (or site)", ylim=(min(ticks) - 0.75,
                                                                                 max(ticks) + 0.75))
    if len(matrix):
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle("where each run first diverges from the oracle (a boundary bug: a column of failures)")
    return fig


def plot_divergence(matrix: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    divergence_figure(matrix).savefig(path, dpi=DPI)
    return path


def write_report(folder: Path, result: ScenarioOutcome, checkpoint: str, label: str) -> None:
    """report.md and report.html (styled as a run's report: the verdict first, '-' where nothing ran, each run's
    report linked), matrix.csv, pairs.csv and plots/ into ``folder``; ``label`` names the decoder."""
    matrix, pairs = result.matrix, result.pairs
    matrix.to_csv(folder / "matrix.csv", index=False)
    pairs.to_csv(folder / "pairs.csv", index=False)
    pngs = [plot(matrix, folder / "plots" / "worst_local_cos.png"),
            plot_divergence(matrix, folder / "plots" / "first_divergence.png")]
    sections = [_verdict_section(result),
                Section("Run", [f"Decoder {label} on {checkpoint}; {len(matrix)} runs, {len(pairs)} self-consistency "
                                f"pairs, {len(result.skipped)} scenarios skipped, {result.seconds:.0f} s.",
                                "Each run's own report: the report column links to it.",
                                *([result.resumed] if result.resumed else [])]),
                Section("Plots", images=pngs, captions=CAPTIONS),
                Section("Scenario matrix", table=_matrix_table(matrix), na="-", links=("report",)),
                Section("Self-consistency (the decoder against itself)",
                        ["Each pair's logits are judged by the rules in its bound column: equal values (unequal <= 0) "
                         "where the decoder promises equal bits, bounds on their difference elsewhere."],
                        pairs if len(pairs) else None, na="-", nowrap=("bound",))]
    if result.skipped:
        sections.append(Section("Skipped (the decoder lacks a capability; not judged)", table=pd.DataFrame(
            {"scenario": list(result.skipped), "why": list(result.skipped.values())})))
    title = f"dsv4-fidelity scenarios: {result.out_dir.name}"
    (folder / "report.md").write_text(render_markdown(title, sections, folder), encoding="utf-8")
    (folder / "report.html").write_text(render_html(title, sections), encoding="utf-8")


def _verdict_section(result: ScenarioOutcome) -> Section:
    """PASS / FAIL (or SKIPPED) first, in the run report's banner, then each failure on its own line."""
    verdict = result.verdict()
    passed = result.passed and not verdict.startswith("SKIPPED")
    runs = int((result.matrix["verdict"] == "PASS").sum()) if len(result.matrix) else 0
    pairs = int(result.pairs["passed"].sum()) if len(result.pairs) else 0
    head = f"{'PASS' if passed else verdict.split(':')[0]}: {runs} of {len(result.matrix)} runs pass against the " \
           f"oracle, {pairs} of {len(result.pairs)} self-consistency pairs pass."
    lines = [f"FAIL {f}" for f in result.failures()] + [f"SKIPPED {k}: {why}" for k, why in result.skipped.items()]
    return Section("Verdict", [head, *lines], css="pass" if passed else "fail")


def _matrix_table(matrix: pd.DataFrame) -> pd.DataFrame:
    """The matrix's columns and a link to each run's report.html (its run directory under runs/)."""
    table = matrix[list(MATRIX_COLUMNS)]
    if "run_dir" in matrix:
        table = table.assign(report=[f"{d}/report.html" if isinstance(d, str) and d else None
                                     for d in matrix["run_dir"]])
    return table
