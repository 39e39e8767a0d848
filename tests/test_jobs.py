"""``fidelity scenarios --jobs N`` and ``fidelity mutants --jobs N``: the runs in N worker processes give the report
one process gives (the same verdicts, metrics, pairs, run directories and detection matrix); a planted fault reaches
every worker; a worker count that is not one, or a decoder no worker can open, is one line, exit 2."""

import os
import subprocess
import sys

import pandas as pd
import pytest

from fidelity.api import InputError, plan_checkpoint
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.studies.scenarios import run_scenarios
from tests.test_resume import MUTANTS, SCENARIOS, _same_report


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fidelity", *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_scenarios_in_two_worker_processes_report_what_one_process_reports(tmp_path):
    one, two = tmp_path / "one" / "job", tmp_path / "two" / "job"
    for folder, jobs in ((one, "1"), (two, "2")):
        res = _cli(*SCENARIOS, "--out", str(folder.parent), "--run-id", folder.name, "--jobs", jobs)
        assert res.returncode == 0, res.stderr
    assert "done in 2 worker processes]" in res.stderr and "worker processes of 1 thread" in res.stdout
    _same_report(one, two)
    for run_dir in pd.read_csv(one / "matrix.csv")["run_dir"]:
        a, b = pd.read_parquet(one / run_dir / "metrics.parquet"), pd.read_parquet(two / run_dir / "metrics.parquet")
        keep = ["step", "phase", "mode", "site", "metric", "position", "value"]
        pd.testing.assert_frame_equal(a[a.site != "memory"][keep].reset_index(drop=True),
                                      b[b.site != "memory"][keep].reset_index(drop=True))
    assert not (two / "traces").exists()


def test_a_fault_planted_in_the_job_is_planted_in_every_worker(tmp_path):
    res = _cli(*SCENARIOS, "--inject", "window-127", "--out", str(tmp_path), "--run-id", "job", "--jobs", "2",
               "--gate")
    assert res.returncode == 1, res.stderr
    matrix = pd.read_csv(tmp_path / "job" / "matrix.csv")
    assert (matrix["verdict"] != "PASS").all(), matrix[["run", "verdict"]]


def test_the_mutant_gate_in_two_worker_processes_gives_the_one_process_matrix(tmp_path):
    tables = {}
    for jobs in ("1", "2"):
        res = _cli(*MUTANTS, "--out", str(tmp_path), "--run-id", f"jobs-{jobs}", "--jobs", jobs)
        assert res.returncode == 0, res.stderr
        tables[jobs] = pd.read_parquet(tmp_path / f"jobs-{jobs}" / "detection.parquet").drop(columns="seconds")
    assert "(2 worker processes)" in res.stderr and "gate: PASS" in res.stdout
    pd.testing.assert_frame_equal(tables["1"], tables["2"])
    assert set(tables["2"]["mutant"]) == {"clean", "window-127", "sink-dropped"}


@pytest.mark.parametrize("command", [SCENARIOS, MUTANTS])
@pytest.mark.parametrize("jobs", ["0", "65", "two", "1.5"])
def test_a_jobs_count_that_is_not_a_worker_count_is_one_line_exit_2(command, jobs, tmp_path):
    res = _cli(*command, "--out", str(tmp_path), "--jobs", jobs)
    assert res.returncode == 2
    assert res.stderr.strip() == f"fidelity: error: --jobs: expected an integer from 1 to 64, found {jobs!r}"
    assert not any(tmp_path.iterdir())


def test_a_decoder_object_cannot_be_opened_by_workers_and_is_refused_before_any_run(tmp_path):
    plan = plan_checkpoint(None, preset="tiny", layers=2)
    decoder = ProductionDecoder(plan.open(), max_context=256)
    with pytest.raises(InputError, match=r"--jobs 2: each worker process opens the decoder by name .* "
                                         r"ProductionDecoder object: run it with jobs=1"):
        run_scenarios(plan, ["decode-boundaries"], decoder, tmp_path, jobs=2)
    assert not any(tmp_path.iterdir())
