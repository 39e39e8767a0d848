"""Run plots (PNG, Agg canvas, no pyplot state). Each plot is skipped, not drawn empty, when its data is absent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fidelity.harness.thresholds import MODES, SINKHORN_DEV

DPI = 100
FLOOR = 1e-16  # 1 - cos of exactly equal tensors, drawn at the bottom of log axes
LEGEND_MAX = 10  # more lines than this get a colour bar instead of a legend


def _finite(df: pd.DataFrame) -> pd.DataFrame:
    return df[np.isfinite(df["value"].astype(float))]


def _rows(df: pd.DataFrame, metric: str, site_regex: str = r"L\d+\..+") -> pd.DataFrame:
    sel = df[(df["metric"] == metric) & df["site"].str.fullmatch(site_regex) & (df["layer"] >= 0)]
    return _finite(sel)


def one_minus_cos(df: pd.DataFrame) -> pd.DataFrame:
    """Worst (largest) ``1 - cos`` over a layer's sites and positions: columns mode, layer, step, value."""
    cos = _rows(df, "cos")
    worst = cos.groupby(["mode", "layer", "step"], as_index=False)["value"].min()
    return worst.assign(value=(1 - worst["value"]).clip(lower=FLOOR))


def _modes(df: pd.DataFrame) -> list[str]:
    present = list(df["mode"].unique())
    return [m for m in MODES if m in present] + sorted(m for m in present if m not in MODES)


def _figure(ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(min(5.0 * ncols, 15.0) + 2.0, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, ncols, squeeze=False, sharey=True)[0])
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _layer_lines(fig: Figure, axes: list, frames: list[pd.DataFrame], x: str) -> None:
    """One line per layer on each axes (frames[i] on axes[i]); legend or colour bar keyed by layer."""
    layers = sorted({int(v) for f in frames for v in f["layer"].unique()})
    norm = Normalize(min(layers), max(max(layers), min(layers) + 1))
    cmap = colormaps["viridis"]
    for ax, frame in zip(axes, frames, strict=True):
        for layer, g in frame.groupby("layer"):
            g = g.sort_values(x)
            ax.plot(g[x], g["value"], marker="o", ms=3, lw=1, color=cmap(norm(layer)), label=f"L{layer}")
    if len(layers) <= LEGEND_MAX:
        _legend(fig, axes[-1], "layer")
    else:
        fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="layer")


def _legend(fig: Figure, ax, title: str) -> None:
    """The legend of ``ax`` outside the axes, right of the figure's panels (it never covers data)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, title=title, title_fontsize=7)


def _one_mode(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows of one mode for plots of production's own values (the same in every mode up to the rows compared):
    free, else layer, else op."""
    present = set(df["mode"])
    mode = next((m for m in ("free", "layer", "op") if m in present), sorted(present)[0] if present else "")
    return df[df["mode"] == mode], mode


def plot_cos_over_steps(df: pd.DataFrame) -> Figure | None:
    """Per-layer worst ``1 - cos`` (log) over steps, one panel per mode."""
    data = one_minus_cos(df)
    if data.empty:
        return None
    modes = _modes(data)
    fig, axes = _figure(len(modes))
    onset = loop_onset_step(df)
    for ax in axes if onset is not None else []:  # drawn first, so that the legend lists it
        ax.axvline(onset, color="0.4", ls="--", lw=1, label="loop starts")
    _layer_lines(fig, axes, [data[data["mode"] == m] for m in modes], "step")
    for ax, mode in zip(axes, modes, strict=True):
        ax.set(yscale="log", xlabel="step (0 = prefill)", title=f"{mode} mode")
    axes[0].set_ylabel("1 - cos (worst site in layer)")
    return fig


def loop_onset_step(df: pd.DataFrame) -> int | None:
    """The call (step) that picked the first token of the stream's loop, None without a loop."""
    rows = df[(df["site"] == "repetition") & (df["metric"] == "loop_onset")]
    if rows.empty or rows["value"].iloc[-1] < 0:
        return None
    last_prefill = int(df.loc[df["phase"] == "prefill", "step"].max())  # its logits pick decode token 0
    return last_prefill + int(rows["value"].iloc[-1])


def plot_heatmap(df: pd.DataFrame) -> Figure | None:
    """Layer x step heatmap of worst ``1 - cos`` on a log colour scale, one panel per mode."""
    data = one_minus_cos(df)
    if data.empty:
        return None
    modes = _modes(data)
    fig, axes = _figure(len(modes))
    lo, hi = float(data["value"].min()), float(data["value"].max())
    norm = LogNorm(lo, hi if hi > lo else lo * 10)
    for ax, mode in zip(axes, modes, strict=True):
        grid = data[data["mode"] == mode].pivot_table(index="layer", columns="step", values="value")
        image = ax.imshow(np.ma.masked_invalid(grid.to_numpy()), aspect="auto", origin="lower", norm=norm,
                          interpolation="nearest", cmap="magma")
        _ticks(ax.set_xticks, list(grid.columns))
        _ticks(ax.set_yticks, list(grid.index))
        ax.set(xlabel="step (0 = prefill)", title=f"{mode} mode")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="1 - cos")
    return fig


def _ticks(setter: Callable, labels: list) -> None:
    stride = max(1, len(labels) // 12)
    positions = list(range(0, len(labels), stride))
    setter(positions, [str(labels[i]) for i in positions])


def plot_residual_norms(df: pd.DataFrame) -> Figure | None:
    """RMS of each of production's mHC streams leaving each layer (max over steps and positions), log scale."""
    sel = df[df["site"].str.fullmatch(r"L\d+\.residual") & df["metric"].str.fullmatch(r"rms_stream\d+|rms_max")]
    sel, mode = _one_mode(_finite(sel[sel["layer"] >= 0]))
    if sel.empty:
        return None
    fig, (ax,) = _figure()
    for metric, g in sel.groupby("metric"):
        worst = g.groupby("layer")["value"].max()
        style = {"lw": 2.5, "color": "black"} if metric == "rms_max" else {"lw": 1}
        ax.plot(worst.index, worst.to_numpy(), marker="o", ms=3, label=str(metric), **style)
    ax.set(yscale="log", xlabel="layer", ylabel="RMS (max over steps)")
    ax.set_title(f"production's residual stream norms ({mode} mode rows)", fontsize=10)
    _legend(fig, ax, "stream")
    return fig


def plot_sinkhorn(df: pd.DataFrame) -> Figure | None:
    """Worst Sinkhorn row/column deviation from 1 of production's comb per layer, both mHC mixers (attention
    solid, FFN dashed, so that neither hides the other), with the threshold line."""
    sel = df[df["site"].str.fullmatch(r"L\d+\.mhc_(attn|ffn)\.comb") & df["metric"].isin(["row_dev", "col_dev"])]
    sel, mode = _one_mode(_finite(sel[sel["layer"] >= 0]))
    if sel.empty:
        return None
    fig, (ax,) = _figure()
    family = sel["site"].str.replace(r"^L\d+\.", "", regex=True)
    styles = {"mhc_attn.comb": {"ls": "-", "marker": "o", "ms": 5},
              "mhc_ffn.comb": {"ls": "--", "marker": "s", "ms": 3}}
    colours = {"row_dev": "tab:orange", "col_dev": "tab:blue"}
    for (fam, metric), g in sel.assign(family=family).groupby(["family", "metric"]):
        worst = g.groupby("layer")["value"].max().clip(lower=FLOOR)
        ax.plot(worst.index, worst.to_numpy(), lw=1, color=colours.get(metric), label=f"{fam} {metric}",
                **styles.get(fam, {}))
    ax.axhline(SINKHORN_DEV, color="red", ls=":", lw=1, label="threshold")
    ax.set(yscale="log", xlabel="layer", ylabel="max |sum - 1|")
    ax.set_title(f"Sinkhorn deviation of production's comb ({mode} mode rows)", fontsize=10)
    _legend(fig, ax, "mixer, sums")
    return fig


def plot_recall(df: pd.DataFrame) -> Figure | None:
    """Indexer recall@k (worst position) over steps per layer, one panel per mode."""
    data = _rows(df, "recall", r"L\d+\.indexer\.topk")
    if data.empty:
        return None
    data = data.groupby(["mode", "layer", "step"], as_index=False)["value"].min()
    modes = _modes(data)
    fig, axes = _figure(len(modes))
    _layer_lines(fig, axes, [data[data["mode"] == m] for m in modes], "step")
    for ax, mode in zip(axes, modes, strict=True):
        ax.set(xlabel="step (0 = prefill)", title=f"{mode} mode", ylim=(min(0.9, data["value"].min()) - 0.02, 1.01))
    axes[0].set_ylabel("recall@k (worst position)")
    return fig


PLOTS: dict[str, Callable[[pd.DataFrame], Figure | None]] = {
    "cos_over_steps.png": plot_cos_over_steps,
    "heatmap_1mcos.png": plot_heatmap,
    "residual_norms.png": plot_residual_norms,
    "sinkhorn.png": plot_sinkhorn,
    "recall.png": plot_recall,
}


def make_plots(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Write every plot that has data to ``out_dir``; returns the written paths (possibly none)."""
    out_dir = Path(out_dir)
    written = []
    for name, build in PLOTS.items():
        fig = build(df)
        if fig is None:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_dir / name, dpi=DPI)
        written.append(out_dir / name)
    return written
