"""Two runs (e.g. two profiles) side by side: worst cos / calc_diff per layer and site family, and a 1 - cos plot."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fidelity.plots import DPI, FLOOR
from fidelity.report import md_escape, md_table, worst
from fidelity.rundir import check_metrics, read_run
from fidelity.thresholds import LAYER_SITE_ORDER, MODES, site_order_key

RunLike = str | Path | tuple[pd.DataFrame, dict]
PLOT_NAME = "compare_1mcos.png"


class CompareError(ValueError):
    """Two runs that cannot be compared (no common mode, no similarity rows)."""


def _load(run: RunLike) -> tuple[pd.DataFrame, str]:
    if isinstance(run, tuple):
        df, manifest = check_metrics(run[0]), run[1]
    else:
        df, manifest = read_run(run)
    profile = manifest.get("profile") or ", ".join(map(str, df["profile"].unique()))
    run_id = manifest.get("run_id") or ", ".join(map(str, df["run_id"].unique()))
    return df, f"{profile} ({run_id})"


def _common_mode(a: pd.DataFrame, b: pd.DataFrame) -> str:
    common = set(a["mode"]) & set(b["mode"])
    for mode in reversed(MODES):  # free first: end-to-end effect of the profile
        if mode in common:
            return mode
    raise CompareError(f"no common mode: run A has {sorted(set(a['mode']))}, run B has {sorted(set(b['mode']))}")


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


def _side_by_side(ta: pd.DataFrame, tb: pd.DataFrame) -> pd.DataFrame:
    both = ta.add_suffix(" A").join(tb.add_suffix(" B"), how="outer")
    both = both.reindex(sorted(both.index, key=lambda k: _family_key(int(k[0]), str(k[1]))))
    both = both[[c for c in ("cos A", "cos B", "calc_diff A", "calc_diff B") if c in both.columns]].reset_index()
    both["layer"] = both["layer"].map(lambda v: "-" if v < 0 else f"L{int(v)}")
    return both


def _plot(tables: dict[str, pd.DataFrame], mode: str, path: Path) -> Path:
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    drawn = 0
    for label, table in tables.items():
        per_layer = table.reset_index()
        per_layer = per_layer[per_layer["layer"] >= 0].dropna(subset=["cos"]) if "cos" in per_layer else per_layer[:0]
        if per_layer.empty:
            continue
        err = (1 - per_layer.groupby("layer")["cos"].min()).clip(lower=FLOOR)
        ax.plot(err.index, err.to_numpy(), marker="o", ms=3, lw=1.2, label=label)
        drawn += 1
    if not drawn:
        raise CompareError(f"neither run has per-layer cos rows in {mode} mode")
    ax.set(yscale="log", xlabel="layer", ylabel="1 - cos (worst site, step, position)", title=f"{mode} mode")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def compare_runs(run_a: RunLike, run_b: RunLike, out_dir: str | Path, mode: str | None = None) -> tuple[str, Path]:
    """Markdown table (caption line + table) and ``out_dir/compare_1mcos.png`` for two runs.

    Runs are run directories or ``(df, manifest)`` pairs. ``mode=None`` picks the first common mode of free, layer, op.
    """
    (da, label_a), (db, label_b) = _load(run_a), _load(run_b)
    mode = mode or _common_mode(da, db)
    ta, tb = family_table(da[da["mode"] == mode]), family_table(db[db["mode"] == mode])
    if ta.empty and tb.empty:
        raise CompareError(f"neither run has cos / calc_diff rows in {mode} mode")
    if label_a == label_b:
        label_a, label_b = f"{label_a} [A]", f"{label_b} [B]"
    plot = _plot({f"A: {label_a}": ta, f"B: {label_b}": tb}, mode, Path(out_dir) / PLOT_NAME)
    caption = md_escape(f"{mode} mode; worst over steps and positions. A = {label_a}, B = {label_b}.")
    return f"{caption}\n\n{md_table(_side_by_side(ta, tb))}\n", plot
