"""``fidelity compare`` on scenario reports (fidelity/outputs/compare.py): two real reports of one small scenario,
the clean production decoder and one with a planted chunk-boundary bug, compared side by side show the runs and
pairs that changed verdict and the runs only one report has; a run inside a report compares as a plain run; bad
inputs (one folder, mixed kinds, a folder that is neither, a report without pairs.csv) end in one line, exit 2."""

import shutil

import pandas as pd
import pytest

from fidelity.api import plan_checkpoint
from fidelity.cli import main
from fidelity.outputs.compare import CompareError, compare_runs
from fidelity.studies.catalogue import Pair, Run, Scenario
from fidelity.studies.scenarios import run_scenarios
from tests.test_scenarios import LocalPositions

WHOLE, CHUNKED, SHORT = Run("whole", 40, 1, param=("chunk", 40)), Run("chunks 7,33", 40, 1, (7, 33), ("chunk", 7)), \
    Run("prompt 20", 20, 1, param=("prompt_len", 20))
PAIRS = (Pair("chunked==whole", "whole", "chunks 7,33"),)
CLEAN, BUG = "production (reference)", "production (local positions)"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """(clean, bug): the clean decoder on whole, chunks 7,33 and prompt 20; the planted bug (each prefill chunk at
    positions from 0) on whole and chunks 7,33 only."""
    plan = plan_checkpoint(None)
    plan.open()
    root = tmp_path_factory.mktemp("reports")
    clean = run_scenarios(plan, [Scenario("tiny", "t", (WHOLE, CHUNKED, SHORT), PAIRS)], out=root, run_id="clean",
                          modes=("op",))
    bug = LocalPositions(plan.ckpt, max_context=64)
    bug.label = BUG
    planted = run_scenarios(plan, [Scenario("tiny", "t", (WHOLE, CHUNKED), PAIRS)], bug, out=root, run_id="bug",
                            modes=("op",))
    assert clean.passed and not planted.passed  # what the comparison must show
    return clean, planted


def test_compare_of_two_scenario_reports_shows_what_changed_verdict(reports, tmp_path, capsys):
    clean, bug = reports
    out = tmp_path / "cmp"
    assert main(["compare", str(clean.out_dir), str(bug.out_dir), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "compare_pairs.csv", "compare_runs.csv",
                                                      "compare_worst_local_cos.png"]
    assert f"Changed verdict: tiny/chunks 7,33 ({CLEAN} PASS, {BUG} FAIL); tiny/chunked==whole chunks 7,33 vs whole " \
           f"({CLEAN} PASS, {BUG} FAIL)." in text
    assert f"In some reports only: tiny/prompt 20 (only in {CLEAN})." in text
    table, plot = text.split("\nplot: ")
    assert (out / "compare.md").read_text().endswith(table) and plot == f"{out / 'compare_worst_local_cos.png'}\n"
    runs = pd.read_csv(out / "compare_runs.csv", keep_default_na=False).set_index("run")
    want = bug.matrix.set_index("run")
    assert runs.loc["chunks 7,33", f"verdict {CLEAN}"] == "PASS" and runs.loc["chunks 7,33", f"verdict {BUG}"] == "FAIL"
    assert runs.loc["chunks 7,33", f"first_divergence {BUG}"] == want.loc["chunks 7,33", "first_divergence"] != "none"
    assert runs.loc["chunks 7,33", f"self_consistency {BUG}"] == "FAIL"
    assert float(runs.loc["chunks 7,33", f"worst_local_cos {BUG}"]) == pytest.approx(
        want.loc["chunks 7,33", "worst_local_cos"])
    assert runs.loc["prompt 20", f"verdict {BUG}"] == "-" and runs.loc["prompt 20", "only in"] == CLEAN
    assert runs.loc["whole", f"verdict {BUG}"] == "PASS" and runs.loc["whole", "only in"] == ""
    pairs = pd.read_csv(out / "compare_pairs.csv").iloc[0]
    assert pairs[f"passed {CLEAN}"] and not pairs[f"passed {BUG}"]
    assert pairs[f"cos_min {BUG}"] == pytest.approx(bug.pairs.iloc[0]["cos_min"])
    assert pairs[f"cos_min {BUG}"] < pairs[f"cos_min {CLEAN}"] and pairs[f"rel_l2 {BUG}"] > pairs[f"rel_l2 {CLEAN}"]


def test_compare_of_the_same_report_twice_changes_nothing(reports, tmp_path):
    clean, _ = reports
    text, plot = compare_runs([clean.out_dir, clean.out_dir], tmp_path / "same")
    assert "Changed verdict: none." in text and "In some reports only: none." in text
    assert r"| clean \[1\] | " in text and plot.is_file()  # the same folder twice: labelled by position


def test_a_run_inside_a_scenario_report_compares_as_a_plain_run(reports, tmp_path):
    a, b = (r.out_dir / "runs" / "tiny-chunks-7-33" for r in reports)
    text, plot = compare_runs([a, b], tmp_path / "plain")
    rows = [ln for ln in text.splitlines() if ln.startswith("| reference")]
    assert [ln.split(" | ")[1] for ln in rows] == ["PASS", "FAIL"]  # the summary's verdict column
    assert "| layer | family |" in text and plot.name == "compare_1mcos.png" and plot.is_file()


def _error(capsys, *args) -> list[str]:
    assert main(["compare", *map(str, args)]) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_bad_inputs_end_in_one_line_and_exit_2(reports, tmp_path, capsys):
    clean, bug = reports
    run = bug.out_dir / "runs" / "tiny-whole"
    assert _error(capsys, clean.out_dir) == [
        "fidelity: error: compare: expected at least two runs or two scenario reports, found 1"]
    assert _error(capsys, clean.out_dir, run) == [
        f"fidelity: error: compare: cannot mix scenario report directories ({clean.out_dir}) with run directories "
        f"({run}); compare reports with reports, or runs with runs (a report's runs are in its runs/ folder)"]
    empty = tmp_path / "empty"
    (empty / "plots").mkdir(parents=True)
    assert _error(capsys, clean.out_dir, empty) == [
        f"fidelity: error: {empty}: expected a run directory (metrics.parquet, manifest.json) or a scenario report "
        "directory (matrix.csv), found ['plots']"]
    assert _error(capsys, tmp_path / "nope", clean.out_dir) == [
        f"fidelity: error: {tmp_path / 'nope'}: not a folder; expected a run directory (metrics.parquet, "
        "manifest.json) or a scenario report directory (matrix.csv)"]
    broken = tmp_path / "broken"
    shutil.copytree(bug.out_dir, broken)
    (broken / "pairs.csv").unlink()
    [line] = _error(capsys, clean.out_dir, broken, "--out", tmp_path / "never")
    assert line.startswith(f"fidelity: error: {broken}: missing pairs.csv; a scenario report holds matrix.csv and "
                           "pairs.csv, found [")
    matrix = pd.read_csv(bug.out_dir / "matrix.csv").drop(columns="verdict")
    matrix.to_csv(broken / "matrix.csv", index=False)
    shutil.copy(bug.out_dir / "pairs.csv", broken / "pairs.csv")
    [line] = _error(capsys, clean.out_dir, broken, "--out", tmp_path / "never")
    assert line.startswith(f"fidelity: error: {broken / 'matrix.csv'}: missing columns ['verdict']; expected [")
    assert not (tmp_path / "never").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(CompareError, match="mode 'op' applies to run directories"):
        compare_runs([clean.out_dir, bug.out_dir], tmp_path / "m", mode="op")
