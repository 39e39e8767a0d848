"""Drift plots at long decode (fidelity/outputs/plots.py): over more than STEP_BINS_AT steps the per-layer lines are
binned (a median line and a band out to the worst value per bin, the bin width in the axis label); up to it, a
marker per step as before. Both on the metrics of a real run of 280 decode steps."""

import math

import pandas as pd
import pytest

import fidelity
from fidelity.api import plan_checkpoint
from fidelity.outputs.plots import STEP_BINS, STEP_BINS_AT, one_minus_cos, plot_cos_over_steps, step_label

DECODE = 280


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    plan = plan_checkpoint(None, preset="tiny", layers=2)
    res = fidelity.run("production", plan, prompt=8, decode_steps=DECODE, modes=("free",),
                       out=tmp_path_factory.mktemp("runs"), run_id="long")
    return pd.read_parquet(res.run_dir / "metrics.parquet"), res.run_dir


def test_more_steps_than_fit_are_binned_to_a_median_line_and_a_worst_band(long_run):
    df, run_dir = long_run
    assert (run_dir / "plots" / "cos_over_steps.png").is_file()
    steps = DECODE + 1  # the prefill is step 0
    assert steps > STEP_BINS_AT
    width = math.ceil(steps / STEP_BINS)
    ax = plot_cos_over_steps(df).axes[0]
    assert ax.get_xlabel() == step_label(width) and f"bins of {width} steps" in ax.get_xlabel()
    lines = [line for line in ax.lines if line.get_label().startswith("L")]
    assert [line.get_label() for line in lines] == ["L0", "L1"]
    for line in lines:
        assert len(line.get_xdata()) == math.ceil(steps / width) and line.get_marker() in ("None", None, "")
        assert list(line.get_xdata()[:2]) == [(width - 1) / 2, width + (width - 1) / 2]  # bin centres
    data = one_minus_cos(df)
    for layer, band in enumerate(ax.collections):  # each band reaches its layer's worst 1 - cos, no further
        worst = float(data[data["layer"] == layer]["value"].max())
        assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(worst)
        assert max(lines[layer].get_ydata()) <= worst


def test_up_to_the_threshold_each_step_keeps_its_marker(long_run):
    df, _ = long_run
    short = df[df["step"] <= 200]
    ax = plot_cos_over_steps(short).axes[0]
    assert ax.get_xlabel() == "step (0 = prefill)" and not ax.collections
    lines = [line for line in ax.lines if line.get_label().startswith("L")]
    assert len(lines) == 2 and all(len(line.get_xdata()) == 201 and line.get_marker() == "o" for line in lines)
