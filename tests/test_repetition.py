"""The repetition probe: where a stream falls into a loop, how often its n-grams repeat, the longest repeated span;
on a real run of the default checkpoint, in the report beside the cosine, and in an N-way comparison."""

from __future__ import annotations

import fidelity
from fidelity.outputs.compare import compare_runs
from fidelity.outputs.plots import loop_onset_step
from fidelity.outputs.rundir import read_run
from probes.repetition import repetition


def test_a_periodic_tail_is_found_with_its_onset_and_period():
    stream = [9, 8, 7, 6, 5] + [1, 2, 3] * 8
    r = repetition(stream, n=3)
    assert (r["loop_onset"], r["loop_period"]) == (5, 3)
    assert r["longest_repeat"] == 21  # the tail against itself shifted by one period
    assert r["ngram_seen"].tolist() == [0] * 10 + [1] * 19  # first repeat: (2, 3, 1) at step 10 (seen at 7)
    assert abs(r["repeat_rate"] - 19 / 27) < 1e-12


def test_a_stream_without_a_loop_and_a_short_periodic_tail_have_no_onset():
    assert repetition(list(range(100)))["loop_onset"] == -1
    r = repetition(list(range(40)) + [7] * 10)  # period 1 but only 11 tokens long (< 16)
    assert (r["loop_onset"], r["loop_period"]) == (-1, 0) and r["longest_repeat"] == 9
    assert repetition([])["repeat_rate"] == 0.0


def test_overlapping_occurrences_count_as_a_repeat():
    assert repetition([1, 2, 1, 2, 1])["longest_repeat"] == 3  # "1 2 1" at 0 and at 2


def test_a_run_reports_where_its_stream_loops_beside_the_cosine(tmp_path):
    res = fidelity.run("production", None, 600, 80, ("free",), tmp_path, run_id="long")
    expected = repetition(res.manifest["generated"])
    df, _ = read_run(res.run_dir)
    rows = df[df["site"] == "repetition"]
    run_level = rows[rows["metric"] != "ngram_seen"].set_index("metric")["value"]
    assert run_level["loop_onset"] == expected["loop_onset"] and run_level["loop_period"] == expected["loop_period"]
    assert (rows["metric"] == "ngram_seen").sum() == 80
    report = (res.run_dir / "report.md").read_text()
    assert "## Repetition" in report and "4-gram repeat rate" in report
    assert expected["loop_onset"] >= 0  # the trained default's greedy stream loops within 80 tokens of this prompt
    # (from decode step 24, period 2, after the default text's first 600 tokens)
    assert loop_onset_step(df) == expected["loop_onset"]  # the prefill (call 0) picks decode token 0
    assert "free logits cos, worst before onset" in report


def test_compare_tables_each_run_in_one_row(tmp_path):
    runs = [fidelity.run("production", None, 200, 24, ("free", "layer"), tmp_path, run_id=p, profile=p).run_dir
            for p in ("reference", "fp32-residual", "bf16")]
    text, plot = compare_runs(runs, tmp_path / "cmp")
    header = text.splitlines()[0]
    for column in ("run", "verdict", "free logits cos min", "layer recall min", "token agreement", "loop onset",
                   "4-gram repeat rate", "peak memory (decode)", "cache growth"):
        assert f" {column} |" in header, column
    assert [ln.split(" | ")[0] for ln in text.splitlines()[2:5]] == ["| reference", "| fp32-residual", "| bf16"]
    assert plot.is_file()
