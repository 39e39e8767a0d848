"""Thresholds, first divergence, reports, plots, run directories and run comparison on synthetic metric tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fidelity.atomic_write import OutputError
from fidelity.harness.thresholds import (
    Threshold,
    ThresholdError,
    default_thresholds,
    evaluate,
    first_divergence,
    load_thresholds,
    thresholds_for,
)
from fidelity.outputs import rundir
from fidelity.outputs.compare import compare_runs
from fidelity.outputs.plots import make_plots
from fidelity.outputs.report import md_table, write_report
from fidelity.outputs.rundir import RunDirError, new_run_id, read_run, write_run

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

LAYERS, STEPS = 4, 6
PNG = b"\x89PNG\r\n\x1a\n"


def _similarity(err: float) -> dict[str, float]:
    return {"cos": 1 - err, "calc_diff": err, "rel_l2": np.sqrt(2 * err), "nonfinite_mismatch": 0, "test_nonfinite": 0}


def _layer_metrics(layer: int, mode: str) -> dict[str, dict[str, float]]:
    err = 1e-5 * (layer + 1) * (3 if mode == "free" else 1)
    sites = {f"L{layer}.{s}": _similarity(err) for s in ("attn.q", "attn.out", "moe.out", "residual")}
    sites[f"L{layer}.residual"].update({f"rms_stream{k}": 1.0 + layer + 0.1 * k for k in range(4)})
    sites[f"L{layer}.residual"]["rms_max"] = 1.3 + layer
    comb = {"row_dev": 3e-3, "col_dev": 1e-7, "min_value": 1e-4, "negative_count": 0, "orientation_err": 1e-6,
            "transposed_err": 0.3, "orientation_flip": 0}
    sites[f"L{layer}.mhc_attn.comb"] = dict(comb)
    sites[f"L{layer}.mhc_ffn.comb"] = dict(comb)
    sites[f"L{layer}.indexer.scores"] = {"nonfinite_mismatch": 0, "test_nonfinite": 12}
    sites[f"L{layer}.indexer.topk"] = {"recall": 0.98, "near_tie_miss": 1, "true_miss": 0, "first_true_miss_query": -1,
                                       "rank_disp_mean": 0.5, "rank_disp_max": 3}
    sites[f"L{layer}.attn.visible"] = {"missing": 0, "extra": 0, "first_query": -1, "first_kv": -1, "first_kind": -1}
    return sites


def make_df(run_id: str = "clean", profile: str = "reference", modes: tuple[str, ...] = ("op", "free")) -> pd.DataFrame:
    rows = []
    for mode in modes:
        for step in range(STEPS):
            base = {"run_id": run_id, "mode": mode, "profile": profile, "step": step,
                    "phase": "prefill" if step == 0 else "decode", "position": -1}
            sites = {"logits": _similarity(1e-5), "tokens": {"agree": 1, "ref_margin": 3.0, "test_margin": 2.9},
                     "memory": {"allocated": 1 << 20, "reserved": 2 << 20}}
            for layer in range(LAYERS):
                sites.update(_layer_metrics(layer, mode))
            for site, metrics in sites.items():
                layer = int(site[1:].split(".")[0]) if site.startswith("L") else -1
                rows += [{**base, "layer": layer, "site": site, "metric": m, "value": float(v)}
                         for m, v in metrics.items()]
    return pd.DataFrame(rows)


def plant(df: pd.DataFrame, step: int, site: str, metric: str, value: float, mode: str = "free") -> pd.DataFrame:
    sel = (df["step"] == step) & (df["site"] == site) & (df["metric"] == metric) & (df["mode"] == mode)
    assert sel.sum() == 1, (step, site, metric, mode)
    out = df.copy()
    out.loc[sel, "value"] = value
    return out


@pytest.fixture(scope="module")
def clean() -> pd.DataFrame:
    return make_df()


@pytest.fixture(scope="module")
def failing(clean: pd.DataFrame) -> pd.DataFrame:
    df = clean.assign(run_id="failing")
    df = plant(df, 3, "L2.attn.out", "cos", 0.95, mode="op")
    df = plant(df, 3, "L2.attn.out", "calc_diff", 0.05, mode="op")
    df = plant(df, 3, "L2.moe.out", "cos", 0.97, mode="op")  # later site, same layer and step
    df = plant(df, 3, "L3.attn.out", "cos", 0.96, mode="op")  # later layer, same step
    df = plant(df, 4, "L0.attn.out", "cos", 0.90, mode="op")  # earlier layer, later step
    df = plant(df, 5, "L1.mhc_ffn.comb", "orientation_flip", 1, mode="op")  # a transposed comb
    df = plant(df, 5, "L1.mhc_ffn.comb", "orientation_err", 0.3, mode="op")
    for metric, value in {"missing": 2, "first_query": 5, "first_kv": 17, "first_kind": 1}.items():
        df = plant(df, 5, "L3.attn.visible", metric, value, mode="op")
    return df


@pytest.fixture(scope="module")
def nan_df(clean: pd.DataFrame) -> pd.DataFrame:
    df = plant(clean.assign(run_id="nan"), 2, "L1.attn.q", "nonfinite_mismatch", 3, mode="op")
    return plant(df, 2, "L1.attn.q", "cos", np.nan, mode="op")


def test_clean_run_passes(clean):
    assert evaluate(clean).empty
    assert first_divergence(evaluate(clean)) is None


def test_first_divergence_is_the_earliest_site_that_fails_locally_at_its_first_step(failing):
    failures = evaluate(failing)
    div = first_divergence(failures)
    # layer 0 (step 4) comes before layer 2 (step 3) in data-flow order: a local failure there is not inherited
    assert (div.step, div.site, div.metric, div.mode) == (4, "L0.attn.out", "cos", "op")
    assert str(div) == "step 4 (decode), L0.attn.out cos 0.9 < 0.99 (op mode)"
    assert set(failures["site"]) == {"L2.attn.out", "L2.moe.out", "L3.attn.out", "L0.attn.out", "L1.mhc_ffn.comb",
                                     "L3.attn.visible"}
    assert failures["site"].tolist()[-2:] == ["L3.attn.visible", "L3.attn.out"]  # data-flow order within a layer
    flip = failures[failures["metric"] == "orientation_flip"]
    assert flip["threshold"].tolist() == ["<= 0"]


def test_an_orientation_flip_fails_in_op_mode_only(clean):
    """In free mode a near-permutation comb mixed from drifted streams can land nearer the oracle's transpose (seen
    on clean 512-step runs of the trained default): only op mode, where both combs come from the same streams,
    judges the flip."""
    free = plant(clean.assign(run_id="drift"), 5, "L1.mhc_ffn.comb", "orientation_flip", 1, mode="free")
    assert evaluate(free).empty
    op = plant(clean.assign(run_id="bug"), 5, "L1.mhc_ffn.comb", "orientation_flip", 1, mode="op")
    assert evaluate(op)["metric"].tolist() == ["orientation_flip"]


def test_nan_is_a_failure_and_an_anomaly(nan_df, tmp_path):
    div = first_divergence(evaluate(nan_df))
    assert (div.step, div.site, div.metric, div.mode) == (2, "L1.attn.q", "nonfinite_mismatch", "op")
    assert str(div) == "step 2 (decode), L1.attn.q nonfinite_mismatch 3 > 0 (op mode)"
    md_path, _ = write_report(tmp_path, nan_df, {"profile": "reference"}, plots=[])
    assert "first non-finite: step 2 (decode), L1.attn.q" in md_path.read_text()


def test_profile_defaults():
    cos = {p: next(t.value for t in default_thresholds(p) if t.metric == "cos") for p in ("bf16", "fp8-kv", "fp32")}
    assert cos["bf16"] == 0.999 and cos["fp8-kv"] == 0.99 and cos["fp32"] > 0.999999
    assert any(t.metric == "miss_gap" and not t.modes for t in default_thresholds("fp64"))
    assert any(t.metric == "recall" and t.op == ">=" for t in default_thresholds("reference"))


def test_token_flip_counts_only_above_the_margin(clean):
    low = clean
    for mode in ("op", "free"):
        low = plant(plant(low, 2, "tokens", "agree", 0, mode), 2, "tokens", "ref_margin", 0.3, mode)
    assert evaluate(low).empty
    high = plant(plant(clean, 4, "tokens", "agree", 0), 4, "tokens", "ref_margin", 5.0)
    div = first_divergence(evaluate(high))
    assert (div.site, div.metric, div.step) == ("tokens", "token_flip_with_margin", 4)


def test_toml_overrides_defaults(failing, tmp_path):
    path = tmp_path / "thresholds.toml"
    path.write_text(
        "['L\\d+\\.attn\\.out']\n"
        'cos = ">=0.94"\n'
        'calc_diff = "<= 0.1"\n'
        "['L\\d+\\.moe\\.out']\n"
        'cos = "off"\n'
    )
    rules = load_thresholds(path)
    assert rules[0] == Threshold(r"L\d+\.attn\.out", "cos", ">=", 0.94, "thresholds.toml")
    div = first_divergence(evaluate(failing, thresholds_for("reference", path)))
    assert str(div) == "step 4 (decode), L0.attn.out cos 0.9 < 0.94 (op mode)"  # step 3 passes now, moe cos off


@pytest.mark.parametrize("text, expected", [
    ("['L3\\.attn\\.out']\ncos = 0.9\n", "key 'L3\\\\.attn\\\\.out'.cos: expected a string"),
    ("['L3\\.attn\\.out']\ncos = \n", "not valid TOML"),
    ("['L3\\.attn\\.out']\ncosine = \">=0.9\"\n", "unknown metric"),
    ("[L3.attn.out]\ncos = \">=0.9\"\n", "quote the site regex"),
    ("['L3(']\ncos = \">=0.9\"\n", "invalid"),
    ("['x']\ncos = \"=0.9\"\n", "found str '=0.9'"),
])
def test_bad_toml_names_file_key_and_found(tmp_path, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ThresholdError) as err:
        load_thresholds(path)
    assert str(path) in str(err.value) and expected in str(err.value)


def test_plots_are_png_and_skipped_without_data(clean, tmp_path):
    paths = make_plots(clean, tmp_path / "plots")
    names = {p.name for p in paths}
    assert names == {"cos_over_steps.png", "heatmap_1mcos.png", "residual_norms.png", "sinkhorn.png", "recall.png"}
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 2000
    only_tokens = clean[clean["site"] == "tokens"]
    assert make_plots(only_tokens, tmp_path / "none") == []
    assert not (tmp_path / "none").exists()


@pytest.fixture(scope="module")
def written(failing, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    manifest = {"profile": "reference", "seed": 1, "command_line": ["fidelity", "run", "--profile", "reference"],
                "device": "cpu <script>alert(1)</script>", "git_revision": "abc", "config": {"n_layers": LAYERS}}
    return write_run(root, "failing-run", failing, manifest), manifest


def test_report_contents(written):
    path, _ = written
    md, page = (path / "report.md").read_text(), (path / "report.html").read_text()
    assert "FAIL:" in md and "first divergence: step 4 (decode), L0.attn.out cos 0.9 < 0.99 (op mode)" in md
    for title in ("Per-layer error", "Sinkhorn", "Indexer recall", "Visible range", "Anomalies", "Token agreement",
                  "Memory flatness", "Thresholds"):
        assert f"## {title}" in md and f"<h2>{title}" in page
    assert "| site | cos local | cos inherited | calc_diff local | calc_diff inherited |" in md
    assert "| L2.attn.out | 0.95 | 0.99991 | 0.05 | 9e-05 |" in md
    assert "| L3.attn.visible | op | 2 | 0 | step 5, query 5, kv 17, kind 1 |" in md
    assert "| L1.mhc_ffn.comb | op | 0.003 | 1e-07 | 0.0001 | 0 | 0.3 | 0.3 | 1 |" in md
    assert md.count("![") == 5 and "(plots/heatmap_1mcos.png)" in md
    assert page.count("data:image/png;base64,") == 5 and page.count("<table>") >= 8
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "http://" not in page and "https://" not in page and "<link" not in page
    assert "\\<script>" in md and "| command_line | fidelity run --profile reference |" in md


def test_report_names_the_kernels_where_they_fell_back_to_the_emulation_and_the_kernel_routes(clean, tmp_path):
    manifest = {"implementations": {"sparse_attention": "triton", "rms_norm": "triton", "gate": "cpu"},
                "kernel_fallbacks": {"sparse_attention": {"injected fault sink-dropped": 12}},
                "topk_routes": {"radix": 30, "sort": 2}, "attention_routes": {"ws": 40, "triton": 3},
                "index_routes": {"ws": 20, "fp8": 4}}
    md = write_report(tmp_path, clean, manifest)[0].read_text()
    assert "| kernels | rms_norm, sparse_attention |" in md
    assert "| kernel fallbacks (emulation ran) | sparse_attention: injected fault sink-dropped (12 calls) |" in md
    assert "| indexer top-k routes | radix (30 calls), sort (2 calls) |" in md
    assert "| sparse attention routes | triton (3 calls), ws (40 calls) |" in md
    assert "| indexer scoring routes | fp8 (4 calls), ws (20 calls) |" in md
    md = write_report(tmp_path / "cpu", clean, {"implementations": {"gate": "cpu"}, "kernel_fallbacks": {}})[0]
    assert "| kernels |" not in md.read_text() and "| kernel fallbacks" not in md.read_text()
    assert "| indexer top-k routes |" not in md.read_text() and "| sparse attention routes |" not in md.read_text()
    assert "| indexer scoring routes |" not in md.read_text()


def test_report_pass_verdict(clean, tmp_path):
    md_path, html_path = write_report(tmp_path, clean, {"profile": "reference"})
    assert "PASS: all" in md_path.read_text() and 'class="pass"' in html_path.read_text()


def test_read_run_round_trip(written, failing):
    path, manifest = written
    df, got = read_run(path)
    pd.testing.assert_frame_equal(df, rundir.check_metrics(failing))
    assert {k: got[k] for k in manifest} == manifest and got["thresholds"][0]["metric"] == "rows_missing"
    assert sorted(p.name for p in (path / "plots").iterdir()) == sorted(
        ["cos_over_steps.png", "heatmap_1mcos.png", "residual_norms.png", "sinkhorn.png", "recall.png"])
    assert [p.name for p in path.parent.iterdir()] == ["failing-run"]


def test_write_run_is_atomic(clean, tmp_path, monkeypatch):
    def broken(df, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "half.png").write_bytes(PNG)
        raise RuntimeError("plot failed")

    monkeypatch.setattr(rundir, "make_plots", broken)
    with pytest.raises(RuntimeError, match="plot failed"):
        write_run(tmp_path, "r1", clean, {})
    assert list(tmp_path.iterdir()) == []


def test_write_run_refuses_to_clobber(clean, tmp_path):
    small = clean[clean["site"] == "tokens"]
    first = write_run(tmp_path, "r1", small, {"n": 1})
    with pytest.raises(OutputError, match="exists; pass --overwrite to replace it"):
        write_run(tmp_path, "r1", small, {"n": 2})
    write_run(tmp_path, "r1", small, {"n": 3}, overwrite=True)
    assert read_run(first)[1]["n"] == 3 and [p.name for p in tmp_path.iterdir()] == ["r1"]
    with pytest.raises(OutputError, match="--run-id: expected letters"):
        write_run(tmp_path, "../x", small, {})


def test_read_run_errors(clean, tmp_path):
    with pytest.raises(RunDirError, match="not a run directory"):
        read_run(tmp_path / "nope")
    (tmp_path / "r").mkdir()
    clean.drop(columns=["site"]).to_parquet(tmp_path / "r" / "metrics.parquet")
    with pytest.raises(RunDirError, match="missing manifest.json"):
        read_run(tmp_path / "r")
    (tmp_path / "r" / "manifest.json").write_text(json.dumps({}))
    with pytest.raises(RunDirError, match=r"missing columns \['site'\]; expected \[.*\], found"):
        read_run(tmp_path / "r")


def test_new_run_id_is_unique_and_sortable():
    a, b = new_run_id(), new_run_id()
    assert a != b and len(a) == len("20250101T120000Z-abcdef") and a[:8].isdigit()


def test_compare_runs(written, tmp_path):
    bf16 = make_df("bf16-run", "bf16")
    table, plot = compare_runs([written[0], (bf16, {"profile": "bf16", "run_id": "bf16-run"})], tmp_path / "c")
    assert "| layer | family | cos reference | cos bf16 | calc_diff reference | calc_diff bf16 |" in table
    assert "| L2 | attn |" in table and "| - | logits |" in table and "free mode" in table
    assert plot.read_bytes().startswith(PNG)


def test_md_table_escapes_pipes():
    text = md_table(pd.DataFrame({"a|b": ["x|y"], "n": [1.5]}))
    assert text.splitlines() == ["| a\\|b | n |", "|---|---:|", "| x\\|y | 1.5 |"]
