"""The side-by-side runner, run directories and the ``fidelity`` CLI on the tiny default."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from fidelity import cli
from fidelity.harness.runner import RunError, Runner, RunSpec, sampled_rows
from fidelity.job import run_job
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt
from fidelity.model.synthesize import synthesize


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


def _spec(**kw) -> RunSpec:
    return RunSpec(prompt=default_prompt(4096, kw.pop("prompt_len", 200)), decode_steps=kw.pop("decode", 3), **kw)


@pytest.mark.parametrize("mode", ["free", "layer", "op"])
def test_runner_compares_every_layer_in_each_mode(tiny, mode):
    df, manifest = Runner(tiny, _spec(modes=(mode,))).run()
    assert set(df["mode"]) == {mode}
    assert sorted(df["step"].unique()) == [0, 1, 2, 3]
    layers = set(df.loc[df["site"].str.match(r"L\d+\.attn\.core"), "layer"])
    assert layers == set(range(6))
    cos = df[(df["metric"] == "cos") & (df["site"] == "L0.attn.q") & (df["position"] == -1)]["value"]
    assert len(cos) == 4 and (cos > 0.99).all()
    assert manifest["decode_steps"] == 3 and manifest["implementations"]["sparse_attention"] == "cpu"
    assert manifest["kernel_fallbacks"] == {}  # on the CPU no kernel is selected, so none can fall back
    assert set(manifest["topk_routes"]) == {"keys"} and manifest["topk_routes"]["keys"] > 0  # the CPU's route


def test_op_mode_is_tighter_than_layer_mode_and_layer_tighter_than_free(tiny):
    df, _ = Runner(tiny, _spec(decode=0, prompt_len=300)).run()
    sel = df[(df["metric"] == "calc_diff") & (df["site"] == "L4.attn.core") & (df["position"] == -1)]
    err = sel.set_index("mode")["value"]
    assert err["op"] < err["layer"] < err["free"]


def test_sampled_queries_cover_the_last_position_and_match_full_evaluation(tiny):
    rows = sampled_rows(200, 16)
    assert len(rows) == 16 and int(rows[-1]) == 199 and bool((rows.diff() > 0).all())
    df, _ = Runner(tiny, _spec(decode=0, modes=("layer",), sample_queries=16)).run()
    full, _ = Runner(tiny, _spec(decode=0, modes=("layer",))).run()
    key = (df["site"] == "L1.attn.core") & (df["metric"] == "cos") & (df["position"] == -1)
    key_full = (full["site"] == "L1.attn.core") & (full["metric"] == "cos") & (full["position"] == -1)
    assert abs(float(df[key]["value"].iloc[0]) - float(full[key_full]["value"].iloc[0])) < 1e-3


def test_run_spec_problems_are_reported_together(tiny):
    with pytest.raises(RunError) as err:
        Runner(tiny, _spec(modes=("free", "sideways"), sample_queries=8, max_context=100))
    text = str(err.value)
    assert "mode: expected some of" in text and "sample_queries: applies to layer and op modes only" in text
    assert "exceeds max_context 100" in text


def test_run_directory_holds_metrics_manifest_report_and_plots(tiny, tmp_path):
    res = run_job(tiny, _spec(decode=4), tmp_path, run_id="r1")
    files = {p.name for p in res.run_dir.iterdir()}
    assert {"metrics.parquet", "manifest.json", "report.md", "report.html", "plots"} <= files
    df = pd.read_parquet(res.run_dir / "metrics.parquet")
    assert list(df.columns[:10]) == ["run_id", "mode", "profile", "step", "phase", "position", "layer", "site",
                                     "metric", "value"]
    manifest = json.loads((res.run_dir / "manifest.json").read_text())
    assert manifest["profile"]["name"] == "reference" and len(manifest["checkpoint"]["hash"]) == 16
    pngs = list((res.run_dir / "plots").glob("*.png"))
    assert len(pngs) >= 4 and all(p.stat().st_size > 1000 for p in pngs)
    md = (res.run_dir / "report.md").read_text()
    assert "## Verdict" in md and "local vs inherited" in md
    assert res.passed, res.failures.head().to_string()


def test_clean_reference_decoder_raises_no_alarm_with_default_thresholds(tiny, tmp_path):
    res = run_job(tiny, _spec(decode=6, prompt_len=300), tmp_path, run_id="clean")
    assert res.passed, f"first divergence: {res.first_divergence}"


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fidelity.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``fidelity ARGS`` in this process: (exit code, stdout, stderr); an uncaught exception fails the test."""
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_gate_exit_codes(tmp_path, capsys):
    base = ["run", "--prompt-len", "150", "--decode", "2", "--mode", "op", "--out", str(tmp_path)]
    rc, out, err = _main(capsys, *base, "--run-id", "a", "--gate")
    assert rc == 0, err
    assert "verdict: PASS" in out and "report:" in out
    strict = tmp_path / "strict.toml"
    strict.write_text("['logits|L\\d+\\.attn\\.q']\ncos = \">=0.9999999\"\n")
    rc, out, _ = _main(capsys, *base, "--run-id", "b", "--gate", "--thresholds", str(strict))
    assert rc == 1 and "verdict: FAIL" in out and "first divergence: step 0" in out
    rc, out, _ = _main(capsys, "report", str(tmp_path / "a"), "--thresholds", str(strict), "--gate")
    assert rc == 1 and "FAIL" in out


def test_the_installed_command_ends_a_bad_input_in_one_line_without_a_traceback(tmp_path):
    res = _cli("run", "--profile", "fp7", "--out", str(tmp_path))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "fidelity: error: profile: expected one of ['bf16', 'fp32-residual', 'fp4-indexer-packed', 'fp8-fmha', "
        "'fp8-fmha-nope', 'fp8-indexer', 'fp8-kv-storage', 'fused-norm', 'no-hadamard', 'paged-kv', 'reference'] (or a "
        ".toml/.json file), found 'fp7'"]


@pytest.mark.parametrize("args, message", [
    (["run", "--profile", "fp7"], "profile: expected one of"),
    (["run", "--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["run", "--prompt-len", "100", "--decode", "5", "--max-context", "64"], "exceeds --max-context 64"),
    (["run", "--mode", "free", "--sample-queries", "4", "--prompt-len", "20", "--decode", "0"],
     "sample_queries: applies to layer and op modes only"),
    (["report", "/nonexistent/run"], "not a run directory"),
    (["mutants", "--only", "no-such-bug"], "unknown name(s) ['no-such-bug']"),
    (["memory", "--context", "0"], "context"),
])
def test_cli_bad_inputs_end_in_one_line_and_exit_2(args, message, tmp_path, capsys):
    rc, _, err = _main(capsys, *args, "--out", str(tmp_path)) if args[0] in ("run", "mutants") else \
        _main(capsys, *args)
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert lines and lines[0].startswith("fidelity: error:") and message in err  # a checkpoint lists its problems


def test_compare_writes_its_table_and_plot_next_to_the_runs_not_into_the_working_directory(tiny, tmp_path):
    a = run_job(tiny, _spec(decode=1, prompt_len=150, modes=("layer",)), tmp_path, run_id="ref").run_dir
    b = run_job(tiny, _spec(decode=2, prompt_len=150, modes=("layer",), profile="bf16"), tmp_path,
                run_id="bf16").run_dir
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    res = _cli("compare", str(a), str(b), cwd=cwd)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # no matplotlib layout warning
    out = tmp_path / "compare-ref-vs-bf16"
    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "compare_1mcos.png"] and not any(cwd.iterdir())
    assert "| layer | family | cos reference | cos bf16 |" in res.stdout and f"plot: {out / 'compare_1mcos.png'}" \
        in res.stdout
    assert "The runs decoded different numbers of steps (reference: 1, bf16: 2)" in res.stdout
    again = _cli("compare", str(a), str(b), cwd=cwd)
    assert again.returncode == 2 and "exists; pass --overwrite to replace it" in again.stderr


def test_memory_command_prints_flash_totals_at_1m_context():
    res = _cli("memory", "--preset", "flash", "--context", "1048576")
    assert res.returncode == 0 and "GiB" in res.stdout


def test_oracle_session_layer_mode_runs_on_given_inputs(tiny):
    """forward_layers: each layer consumes the given input streams (here: the oracle's own, so it must
    reproduce the ordinary forward exactly)."""
    from fidelity.model.sites import Recorder
    from oracles import OracleModel

    oracle = OracleModel(tiny)
    ids = default_prompt(4096, 50)
    rec = Recorder([r"L\d+\.residual", "embed"])
    ref = oracle.logits(ids, rec)
    del ref
    layered = Recorder([r"L\d+\.residual"])
    s = oracle.session(layered)

    def inputs(i: int) -> torch.Tensor:
        return rec.get("embed").unsqueeze(1).repeat(1, 4, 1) if i == 0 else rec.get(f"L{i - 1}.residual")

    s.forward_layers(ids, inputs)
    for i in range(6):
        assert torch.equal(layered.get(f"L{i}.residual"), rec.get(f"L{i}.residual"))


def test_the_runner_synchronizes_only_the_cuda_devices_its_two_models_use():
    from fidelity.harness.runner import run_devices

    assert run_devices("cpu", torch.device("cpu")) == ()
    assert run_devices("cuda:1", torch.device("cuda", 1), "cuda:0", "cpu") == (torch.device("cuda", 0),
                                                                               torch.device("cuda", 1))



def test_sampled_runs_record_the_compared_only_sites_at_the_sampled_rows_with_the_same_metrics(tiny, monkeypatch):
    """With sampled queries the decoder's q, attention output and index scores are recorded at those rows alone
    (``SAMPLED_ROWS_ONLY``), and without free mode its logits too (``SAMPLED_LOGITS``: the production head multiplies
    those rows and the call's last alone); every metric but the run's own memory is what recording all rows gives."""
    from fidelity.harness import runner as runner_module

    kept: dict[str, list[tuple[int, int]]] = {}  # site -> (sampled rows, rows recorded) per prefill call

    class Spy(runner_module.Recorder):
        def __call__(self, site, tensor, **kw):
            super().__call__(site, tensor, **kw)
            if site in ("L2.attn.q", "logits") and self.rows is not None:
                kept.setdefault(site, []).append((len(self.rows), self.records[site][-1][1].shape[0]))

    monkeypatch.setattr(runner_module, "Recorder", Spy)
    spec = _spec(decode=1, prompt_len=300, modes=("layer", "op"), sample_queries=8, prefill_chunk=150)
    runner = Runner(tiny, spec)
    thin, _ = runner.run()
    for site in ("L2.attn.q", "logits"):
        assert len(kept[site]) == 2 and all(n == m for n, m in kept[site]), (site, kept)
    assert runner.dec.last_logits_only is False  # set for the runner's calls only: a later prefill gets every row
    monkeypatch.setattr(runner_module, "SAMPLED_ROWS_ONLY", frozenset())
    monkeypatch.setattr(runner_module, "SAMPLED_LOGITS", frozenset())
    whole, _ = Runner(tiny, spec).run()
    cols = ["step", "mode", "site", "layer", "position", "metric"]
    thin, whole = (f[f["site"] != "memory"].sort_values(cols).reset_index(drop=True) for f in (thin, whole))
    pd.testing.assert_frame_equal(thin, whole)  # the memory rows differ: fewer bytes recorded
