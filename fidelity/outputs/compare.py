"""Runs side by side (profiles, versions, checkpoints): one row per run (verdict, logits cosine, indexer recall,
token agreement, repetition onset, memory), worst cos / calc_diff per layer and site family in one table,
1 - cos per layer in one plot, each run under a short label (its profile name, or the profile fields that
differ between the runs). ``fidelity compare A B ...`` writes ``compare.md`` and the plot to a folder of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fidelity.atomic_write import check_new_dir, write_dir_atomic
from fidelity.harness.thresholds import LAYER_SITE_ORDER, MODES, profile_fields, profile_label, site_order_key
from fidelity.outputs.plots import DPI, FLOOR
from fidelity.outputs.report import md_escape, md_table, worst
from fidelity.outputs.rundir import check_metrics, read_run

RunLike = str | Path | tuple[pd.DataFrame, dict]
PLOT_NAME, TABLE_NAME = "compare_1mcos.png", "compare.md"


class CompareError(ValueError):
    """Runs that cannot be compared (fewer than two, no common mode, no similarity rows)."""


def _load(run: RunLike) -> tuple[pd.DataFrame, dict]:
    if isinstance(run, tuple):
        return check_metrics(run[0]), run[1]
    return read_run(run)


def _run_id(df: pd.DataFrame, manifest: dict) -> str:
    return str(manifest.get("run_id") or ", ".join(map(str, df["run_id"].unique())))


def short_labels(runs: Sequence[tuple[pd.DataFrame, dict]]) -> list[str]:
    """One label per run: the profile names when they differ, else the profile fields that differ between the
    runs; labels still repeated get the run id added (and a position for the same run given twice)."""
    profiles = [m.get("profile") or ", ".join(map(str, df["profile"].unique())) for df, m in runs]
    labels = [profile_label(p) for p in profiles]
    if len(set(labels)) < len(labels):
        fields = [profile_fields(p) or {} for p in profiles]
        keys = sorted({k for f in fields for k in f if len({g.get(k) for g in fields}) > 1})
        if keys:
            labels = [", ".join(f"{k}={f.get(k)}" for k in keys) for f in fields]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({_run_id(df, m)})" for label, (df, m) in zip(labels, runs, strict=True)]
    if len(set(labels)) < len(labels):  # the same run twice
        labels = [f"{label} [{k + 1}]" for k, label in enumerate(labels)]
    return labels


def _common_mode(frames: Sequence[pd.DataFrame]) -> str:
    common = set.intersection(*(set(f["mode"]) for f in frames))
    for mode in reversed(MODES):  # free first: end-to-end effect of the profile
        if mode in common:
            return mode
    raise CompareError("no mode common to every run: " + "; ".join(str(sorted(set(f["mode"]))) for f in frames))


def family_table(df: pd.DataFrame) -> pd.DataFrame:
    """Worst cos (min) and calc_diff (max) per (layer, family); family = the site part after ``L{i}.`` up to '.'."""
    sub = df[df["metric"].isin(["cos", "calc_diff"])]
    layer_part = sub["site"].str.extract(r"^L\d+\.([^.]+)")[0]
    sub = sub.assign(family=layer_part.fillna(sub["site"]), layer=sub["layer"].where(layer_part.notna(), -1))
    keys = ["layer", "family"]
    cols = {name: worst(sub[sub["metric"] == name], keys, how)
            for name, how in (("cos", "min"), ("calc_diff", "max")) if (sub["metric"] == name).any()}
    if not cols:
        return pd.DataFrame(columns=["cos", "calc_diff"], index=pd.MultiIndex.from_tuples([], names=keys))
    return pd.DataFrame(cols)


def _family_key(layer: int, family: str) -> tuple:
    """Data-flow position of a (layer, family) row: the first site of the family in ``LAYER_SITE_ORDER``."""
    if layer < 0:
        return site_order_key(family)
    first = next((s for s in LAYER_SITE_ORDER if s == family or s.startswith(family + ".")), family)
    return site_order_key(f"L{layer}.{first}")


def _side_by_side(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    parts = [t.rename(columns=lambda c, k=label: f"{c} {k}") for label, t in tables.items()]
    both = pd.concat(parts, axis=1, join="outer")
    both = both.reindex(sorted(both.index, key=lambda k: _family_key(int(k[0]), str(k[1]))))
    order = [f"{m} {label}" for m in ("cos", "calc_diff") for label in tables]
    both = both[[c for c in order if c in both.columns]].reset_index()
    both["layer"] = both["layer"].map(lambda v: "-" if v < 0 else f"L{int(v)}")
    return both


def _value(df: pd.DataFrame, site: str, metric: str, how: str, mode: str | None = None) -> object:
    rows = df[(df["site"].str.fullmatch(site)) & (df["metric"] == metric)]
    if mode is not None:
        rows = rows[rows["mode"] == mode]
    rows = rows[rows["value"].notna()]
    return getattr(rows["value"], how)() if len(rows) else "-"


def summary_row(label: str, df: pd.DataFrame, manifest: dict) -> dict:
    """One run in one row: verdict, worst logits cos (free mode), indexer recall (layer mode), token agreement,
    repetition of the stream, peak memory and cache growth."""
    verdict = manifest.get("verdict", {})
    tokens = df[(df["site"] == "tokens") & (df["metric"] == "agree") & (df["mode"] == "free")]
    loop = _value(df, "repetition", "loop_onset", "max")
    peaks = manifest.get("memory_peaks", {}).get("decode", {})
    peak = peaks.get("gpu_reserved_peak_bytes", peaks.get("host_rss_peak_bytes"))
    return {
        "run": label, "verdict": ("PASS" if verdict.get("passed") else "FAIL") if verdict else "-",
        "free logits cos min": _value(df, "logits", "cos", "min", "free"),
        "layer recall min": _value(df, r"L\d+\.indexer\.topk", "recall", "min", "layer"),
        "layer recall mean": _value(df, r"L\d+\.indexer\.topk", "recall", "mean", "layer"),
        "token agreement": float((tokens["value"] != 0).mean()) if len(tokens) else "-",
        "decode steps": manifest.get("decode_steps", "-"),
        "4-gram repeat rate": _value(df, "repetition", "repeat_rate", "max"),
        "loop onset": ("none" if loop < 0 else int(loop)) if loop != "-" else "-",
        "peak memory (decode)": f"{peak / 2**20:.0f} MiB" if peak else "-",
        "cache growth": _value(df, "memory", "cache_growth", "max"),
    }


def comparison_figure(tables: dict[str, pd.DataFrame], mode: str) -> Figure:
    """1 - cos per layer (worst site, step, position), one line per run label, legend outside the axes."""
    fig = Figure(figsize=(7.5, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    markers = "osD^v<>ph*"
    drawn = 0
    for k, (label, table) in enumerate(tables.items()):
        per_layer = table.reset_index()
        per_layer = per_layer[per_layer["layer"] >= 0].dropna(subset=["cos"]) if "cos" in per_layer else per_layer[:0]
        if per_layer.empty:
            continue
        err = (1 - per_layer.groupby("layer")["cos"].min()).clip(lower=FLOOR)
        ax.plot(err.index, err.to_numpy(), marker=markers[k % len(markers)], ms=4, lw=1.2, label=label)
        drawn += 1
    if not drawn:
        raise CompareError(f"no run has per-layer cos rows in {mode} mode")
    ax.set(yscale="log", xlabel="layer", ylabel="1 - cos (worst site, step, position)",
           title=f"{mode} mode: worst 1 - cos per layer")
    fig.legend(loc="outside right upper", fontsize=8, title="run", title_fontsize=8)
    return fig


def _steps_note(runs: Sequence[tuple[pd.DataFrame, dict]], labels: Sequence[str]) -> str:
    """A warning when the runs decoded different numbers of steps ('' when they agree)."""
    steps = [int(df["step"].max()) if len(df) else 0 for df, _ in runs]
    if len(set(steps)) == 1:
        return ""
    per_run = ", ".join(f"{label}: {n}" for label, n in zip(labels, steps, strict=True))
    return (f"The runs decoded different numbers of steps ({per_run}); worst values over steps compare different "
            "spans of decoding.")


def default_out(runs: Sequence[RunLike]) -> Path:
    """``<parent of the first run>/compare-<id A>-vs-<id B>[...]``."""
    paths = [Path(r) for r in runs if not isinstance(r, tuple)]
    parent = paths[0].parent if paths else Path("runs")
    names = [p.name for p in paths] or ["runs"]
    stem = "-vs-".join(names[:3]) + (f"-and-{len(names) - 3}-more" if len(names) > 3 else "")
    return parent / f"compare-{stem}"


def compare_runs(runs: Sequence[RunLike], out_dir: str | Path | None = None, mode: str | None = None,
                 overwrite: bool = False) -> tuple[str, Path]:
    """Markdown (caption + table) and the plot for two or more runs, written to ``out_dir`` (default
    ``default_out``) as compare.md and compare_1mcos.png. Runs are run directories or ``(df, manifest)``
    pairs. ``mode=None`` picks the first mode every run has of free, layer, op."""
    if len(runs) < 2:
        raise CompareError(f"compare: expected at least two runs, found {len(runs)}")
    out_dir = check_new_dir(out_dir or default_out(runs), overwrite, "--out")
    loaded = [_load(r) for r in runs]
    labels = short_labels(loaded)
    mode = mode or _common_mode([df for df, _ in loaded])
    tables = {label: family_table(df[df["mode"] == mode]) for label, (df, _) in zip(labels, loaded, strict=True)}
    if all(t.empty for t in tables.values()):
        raise CompareError(f"no run has cos / calc_diff rows in {mode} mode")
    key = "; ".join(f"{label} = {_run_id(df, m)}" for label, (df, m) in zip(labels, loaded, strict=True))
    caption = [md_escape(f"{mode} mode; worst over steps and positions. Runs: {key}.")]
    if note := _steps_note(loaded, labels):
        caption.append(md_escape(note))
    summary = pd.DataFrame([summary_row(label, df, m) for label, (df, m) in zip(labels, loaded, strict=True)])
    summary = summary.loc[:, (summary != "-").any()]  # columns no run has
    text = (f"{md_table(summary)}\n\n" + "\n\n".join(caption) + f"\n\n{md_table(_side_by_side(tables))}\n")

    def fill(tmp: Path) -> None:
        comparison_figure(tables, mode).savefig(tmp / PLOT_NAME, dpi=DPI)
        (tmp / TABLE_NAME).write_text(f"# dsv4-fidelity comparison\n\n{text}", encoding="utf-8")

    write_dir_atomic(out_dir, fill, overwrite)
    return text, out_dir / PLOT_NAME
