"""Run plots (PNG, Agg canvas, no pyplot state). Each plot is skipped, not drawn empty, when its data is absent."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fidelity.harness.judgement import run_rules
from fidelity.harness.thresholds import COMB_SITES, MODES, Threshold, apply_thresholds, fmt_num
from fidelity.model.sites import ROW, SITE

DPI = 100
FLOOR = 1e-16  # 1 - cos of exactly equal tensors, drawn at the bottom of log axes
LEGEND_MAX = 10  # more lines than this get a colour bar instead of a legend
STEP_BINS_AT = 256  # a drift plot over more steps than this bins them (a marker per step is unreadable)
STEP_BINS = 128  # at most this many bins


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


def step_bin_width(steps: int) -> int:
    """The width of the step bins of a drift plot over ``steps`` steps: 1 (a point per step) up to
    STEP_BINS_AT steps, else the width that gives at most STEP_BINS bins."""
    return 1 if steps <= STEP_BINS_AT else math.ceil(steps / STEP_BINS)


def step_label(width: int) -> str:
    """The step axis's label: the bin width when the steps are binned."""
    if width == 1:
        return "step (0 = prefill)"
    return f"step (0 = prefill), bins of {width} steps: median (line), worst (band)"


def _binned(g: pd.DataFrame, x: str, width: int, worst: str) -> pd.DataFrame:
    """Per bin of ``width`` steps of ``g`` (from step 0): its centre ``x``, the median and the worst value
    (``worst``: 'max' or 'min')."""
    start = g[x] // width * width
    out = g.groupby(start)["value"].agg(["median", worst]).rename(columns={worst: "worst"})
    return out.assign(x=out.index + (width - 1) / 2)


def _layer_lines(fig: Figure, axes: list, frames: list[pd.DataFrame], x: str, worst: str = "max") -> int:
    """One line per layer on each axes (frames[i] on axes[i]); legend or colour bar keyed by layer. More steps
    than STEP_BINS_AT are binned (``step_bin_width``): a line of each bin's median, a band out to its worst
    value (``worst``: 'max' or 'min'). Returns the bin width (1: a point per step)."""
    layers = sorted({int(v) for f in frames for v in f["layer"].unique()})
    steps = [v for f in frames for v in (f[x].min(), f[x].max()) if len(f)]
    width = step_bin_width(int(max(steps) - min(steps) + 1)) if steps else 1
    norm = Normalize(min(layers), max(max(layers), min(layers) + 1))
    cmap = colormaps["viridis"]
    for ax, frame in zip(axes, frames, strict=True):
        for layer, g in frame.groupby("layer"):
            colour = cmap(norm(layer))
            if width == 1:
                g = g.sort_values(x)
                ax.plot(g[x], g["value"], marker="o", ms=3, lw=1, color=colour, label=f"L{layer}")
                continue
            b = _binned(g, x, width, worst)
            ax.fill_between(b["x"], b["median"], b["worst"], color=colour, alpha=0.25, lw=0)
            ax.plot(b["x"], b["median"], lw=1, color=colour, label=f"L{layer}")
    if len(layers) <= LEGEND_MAX:
        _legend(fig, axes[-1], "layer")
    else:
        fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="layer")
    return width


def _legend(fig: Figure, ax, title: str) -> None:
    """The legend of ``ax`` (an axes, or a list of them: their entries in turn) outside the axes, right of the
    figure's panels (it never covers data)."""
    pairs = [a.get_legend_handles_labels() for a in (ax if isinstance(ax, list) else [ax])]
    handles, labels = [h for hs, _ in pairs for h in hs], [lb for _, lbs in pairs for lb in lbs]
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
    width = _layer_lines(fig, axes, [data[data["mode"] == m] for m in modes], "step", "max")
    for ax, mode in zip(axes, modes, strict=True):
        ax.set(yscale="log", xlabel=step_label(width), title=f"{mode} mode")
    axes[0].set_ylabel("1 - cos (worst site in layer)")
    return fig


def loop_onset_step(df: pd.DataFrame) -> int | None:
    """The call (step) that picked the first token of the stream's loop, None without a loop."""
    rows = df[(df["site"] == ROW.repetition.name) & (df["metric"] == "loop_onset")]
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
    """RMS of each of production's mHC streams leaving each layer (max over steps and positions), and where the rows
    hold both models' RMS over every stream a second panel: the oracle's (solid) beside the decoder's (dashed) per
    layer, in the prefill (its largest chunk) and at the last decode step; log scale."""
    sel = df[df["site"].str.fullmatch(SITE.residual.regex)]
    sel, mode = _one_mode(_finite(sel[sel["layer"] >= 0]))
    streams = sel[sel["metric"].str.fullmatch(r"rms_stream\d+|rms_max")]
    both = sel[sel["metric"].isin(["rms", "ref_rms"])]
    panels = [p for p, rows in (("streams", streams), ("models", both)) if not rows.empty]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "streams":
            for metric, g in streams.groupby("metric"):
                worst = g.groupby("layer")["value"].max()
                style = {"lw": 2.5, "color": "black"} if metric == "rms_max" else {"lw": 1}
                ax.plot(worst.index, worst.to_numpy(), marker="o", ms=3, label=str(metric), **style)
            ax.set_title(f"production's residual stream norms ({mode} mode rows)", fontsize=10)
            ax.set_ylabel("RMS (max over steps)")
        else:
            _oracle_beside_decoder(ax, both)
            ax.set_title(f"RMS over every stream, oracle vs decoder ({mode} mode rows)", fontsize=10)
        ax.set(yscale="log", xlabel="layer")
    _legend(fig, axes, "series")
    return fig


def _oracle_beside_decoder(ax, rows: pd.DataFrame) -> None:
    """Per layer ``ref_rms`` (oracle, solid) and ``rms`` (decoder, dashed): the prefill's largest chunk, the last
    decode step."""
    last = int(rows["step"].max())
    calls = {"prefill": rows[rows["phase"] == "prefill"],
             f"last decode step ({last})": rows[(rows["phase"] == "decode") & (rows["step"] == last)]}
    for (call, g), colour in zip(calls.items(), ("tab:purple", "tab:brown"), strict=True):  # not the streams'
        for metric, who, ls, marker in (("ref_rms", "oracle", "-", "o"), ("rms", "decoder", "--", "x")):
            by_layer = g[g["metric"] == metric].groupby("layer")["value"].max()
            if len(by_layer):
                ax.plot(by_layer.index, by_layer.to_numpy(), ls=ls, marker=marker, ms=4, lw=1, color=colour,
                        label=f"{who}, {call}")


SINKHORN_METRICS = ("row_dev_excess", "col_dev", "row_dev")  # the sums' deviations a rule may judge
MIXER_STYLES = {"mhc_attn.comb": {"ls": "-", "marker": "o", "ms": 5, "color": "tab:blue"},
                "mhc_ffn.comb": {"ls": "--", "marker": "s", "ms": 3, "color": "tab:orange"}}


def judged_sinkhorn(df: pd.DataFrame, rules: Sequence[Threshold]) -> pd.DataFrame:
    """The comb rows a '<=' rule of ``rules`` judges for a Sinkhorn deviation metric, with the rule's ``limit``
    (rows of the modes and sites the rules leave unjudged are left out)."""
    sel = df[df["site"].str.fullmatch(COMB_SITES) & df["metric"].isin(SINKHORN_METRICS) & (df["layer"] >= 0)]
    judged = apply_thresholds(_finite(sel), rules)
    return judged[judged["op"] == "<="]


def plot_sinkhorn(df: pd.DataFrame, rules: Sequence[Threshold] | None = None) -> Figure | None:
    """What the rules judge of production's Sinkhorn combs, against their limits: a panel per judged deviation
    metric (by default row_dev_excess in op and layer mode, col_dev in every mode), the worst value per layer over
    the judged steps and modes for each mHC mixer (attention solid, FFN dashed, so that neither hides the other).
    ``rules``: the run's (None: the defaults of the rows' profile)."""
    judged = judged_sinkhorn(df, run_rules({}, df)[0] if rules is None else rules)
    if judged.empty:
        return None
    metrics = [m for m in SINKHORN_METRICS if m in set(judged["metric"])]
    fig, axes = _figure(len(metrics))
    for ax, metric in zip(axes, metrics, strict=True):
        rows = judged[judged["metric"] == metric]
        family = rows["site"].str.replace(r"^L\d+\.", "", regex=True)
        for fam, g in rows.assign(family=family).groupby("family"):
            worst = g.groupby("layer")["value"].max()
            ax.plot(worst.index, worst.to_numpy(), lw=1, label=fam, **MIXER_STYLES.get(fam, {}))
        limit = _limit_line(ax, rows)
        modes = ", ".join(m for m in MODES if m in set(rows["mode"]))
        ax.set(xlabel="layer", title=f"{metric} {limit} ({modes} mode)")
    _symlog_axis(axes[0], judged)
    axes[0].set_ylabel("worst over judged steps")
    fig.suptitle("Sinkhorn deviations of production's comb as judged", fontsize=10)
    _legend(fig, axes[-1], "mixer")
    return fig


def _symlog_axis(ax, judged: pd.DataFrame) -> None:
    """A symlog y axis (0 and the negative row excesses of a row nearer 1 than the oracle's stay visible), log
    over the four decades below the largest limit, reaching past the limits and the values."""
    top = max(float(judged["limit"].max()), float(judged["value"].max()))
    linthresh = max(top * 1e-4, 1e-12)
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.set_ylim(min(float(judged["value"].min()) * 3, -linthresh), top * 3)


def _limit_line(ax, rows: pd.DataFrame) -> str:
    """Draw the rules' limit for ``rows`` (a horizontal line, or a line over the layers where it differs by layer);
    returns it as text ('<= 0.01')."""
    limit = rows.groupby("layer")["limit"].min()
    if limit.nunique() == 1:
        ax.axhline(float(limit.iloc[0]), color="red", ls=":", lw=1, label="limit")
    else:
        ax.plot(limit.index, limit.to_numpy(), color="red", ls=":", lw=1, drawstyle="steps-mid", label="limit")
    return "<= " + "/".join(fmt_num(v) for v in sorted(set(limit)))


def plot_recall(df: pd.DataFrame) -> Figure | None:
    """Indexer recall@k (worst position) over steps per layer, one panel per mode."""
    data = _rows(df, "recall", SITE.indexer_topk.regex)
    if data.empty:
        return None
    data = data.groupby(["mode", "layer", "step"], as_index=False)["value"].min()
    modes = _modes(data)
    fig, axes = _figure(len(modes))
    width = _layer_lines(fig, axes, [data[data["mode"] == m] for m in modes], "step", "min")
    for ax, mode in zip(axes, modes, strict=True):
        ax.set(xlabel=step_label(width), title=f"{mode} mode", ylim=(min(0.9, data["value"].min()) - 0.02, 1.01))
    axes[0].set_ylabel("recall@k (worst position)")
    return fig


Plot = Callable[[pd.DataFrame, Sequence[Threshold] | None], Figure | None]
# every plot gets the run's rows and rules; only the Sinkhorn plot draws what the rules judge
PLOTS: dict[str, Plot] = {
    "cos_over_steps.png": lambda df, _rules: plot_cos_over_steps(df),
    "heatmap_1mcos.png": lambda df, _rules: plot_heatmap(df),
    "residual_norms.png": lambda df, _rules: plot_residual_norms(df),
    "sinkhorn.png": plot_sinkhorn,
    "recall.png": lambda df, _rules: plot_recall(df),
}


def run_dir_rules(df: pd.DataFrame, out_dir: Path) -> list[Threshold]:
    """The rules stored in the manifest.json of the run directory holding ``out_dir`` (its parent), else the
    defaults of the rows' profile."""
    path = out_dir.parent / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return run_rules(manifest if isinstance(manifest, dict) else {}, df)[0]


def existing_plots(out_dir: str | Path) -> list[Path] | None:
    """The plots a run directory's ``out_dir`` holds, in the report's order; None when it holds none (a re-render
    reuses them: they depend only on the rows and the stored rules)."""
    out_dir = Path(out_dir)
    found = [out_dir / name for name in PLOTS if (out_dir / name).is_file()]
    return found or None


def make_plots(df: pd.DataFrame, out_dir: str | Path, rules: Sequence[Threshold] | None = None) -> list[Path]:
    """Write every plot that has data to ``out_dir``; returns the written paths (possibly none). ``rules``: those
    that judged the run (None: :func:`run_dir_rules`)."""
    out_dir = Path(out_dir)
    rules = run_dir_rules(df, out_dir) if rules is None else rules
    written = []
    for name, build in PLOTS.items():
        fig = build(df, rules)
        if fig is None:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_dir / name, dpi=DPI)
        written.append(out_dir / name)
    return written
