"""Long jobs that keep what they finished: ``fidelity scenarios`` and ``fidelity mutants`` killed midway (SIGKILL)
keep each finished run in their directory; ``--resume DIR`` skips those runs and gives the report an uninterrupted
job gives; a run whose inputs changed is redone and named; a folder that is not a job of the command is one line,
exit 2."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from fidelity.cli import main

SCENARIOS = ["scenarios", "--scenario", "decode-boundaries", "--mode", "free", "--preset", "tiny", "--layers", "3"]
MUTANTS = ["mutants", "--only", "window-127", "--only", "sink-dropped", "--decode", "1"]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fidelity", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _killed_midway(argv: list[str], job: Path, done: str) -> dict[str, bytes]:
    """Start ``fidelity <argv>`` writing ``job``, SIGKILL it once a run is kept there (before ``done`` is
    written); the kept records {file name: bytes}."""
    proc = subprocess.Popen([sys.executable, "-m", "fidelity", *argv, "--out", str(job.parent), "--run-id", job.name],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not list((job / "kept").glob("*.json")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    kept = {p.name: p.read_bytes() for p in (job / "kept").glob("*.json")}
    assert kept and proc.returncode == -9 and not (job / done).exists(), "the job was not killed midway"
    return kept


def _kept_names(kept: dict[str, bytes]) -> list[str]:
    return [json.loads(b)["name"] for b in kept.values()]


def _same_report(a: Path, b: Path) -> None:
    """Two scenario reports agree but for timings and the line on what a resumed job reused."""
    def text(folder: Path) -> str:
        md = (folder / "report.md").read_text()
        md = re.sub(r"\| [0-9.]+ \| runs/", "| S | runs/", md)
        md = re.sub(r"\d+ s\.", "N s.", md)
        return "\n".join(line for line in md.splitlines() if line and not line.startswith("Resumed:"))

    assert text(a) == text(b)
    drop = ["seconds"]
    pd.testing.assert_frame_equal(pd.read_csv(a / "matrix.csv").drop(columns=drop),
                                  pd.read_csv(b / "matrix.csv").drop(columns=drop))
    pd.testing.assert_frame_equal(pd.read_csv(a / "pairs.csv"), pd.read_csv(b / "pairs.csv"))


def test_a_killed_scenarios_job_resumes_without_rerunning_its_kept_runs(tmp_path):
    job = tmp_path / "stopped" / "job"
    kept = _killed_midway(SCENARIOS, job, "report.md")
    names = _kept_names(kept)
    dirs = [r["run_dir"] for r in (json.loads(b)["result"] for b in kept.values()) if "run_dir" in r]
    written = {d: (job / d / "manifest.json").stat().st_mtime_ns for d in dirs}

    res = _cli(*SCENARIOS, "--resume", str(job))
    assert res.returncode == 0, res.stderr
    for name in names:  # skipped, not run again
        assert f"{name}: kept from the stopped job" in res.stderr
        assert f"{name}: PASS (" not in res.stderr and f"{name}: FAIL (" not in res.stderr
    assert {f: (job / "kept" / f).read_bytes() for f in kept} == kept
    assert {d: (job / d / "manifest.json").stat().st_mtime_ns for d in dirs} == written
    line = f"Resumed: {len(names)} kept run{'s' if len(names) > 1 else ''} reused, 0 redone because their inputs " \
           "changed."
    assert line in res.stdout and line in (job / "report.md").read_text()

    assert main([*SCENARIOS, "--out", str(tmp_path / "whole"), "--run-id", "job"]) == 0
    _same_report(job, tmp_path / "whole" / "job")
    assert sorted(p.name for p in job.iterdir()) == sorted(p.name for p in (tmp_path / "whole" / "job").iterdir())


def _detection(folder: Path) -> tuple[pd.DataFrame, str]:
    md = (folder / "detection.md").read_text()
    return (pd.read_parquet(folder / "detection.parquet").drop(columns="seconds"),
            "\n".join(line for line in md.splitlines() if line and not line.startswith("Resumed:")))


def test_a_killed_mutants_job_resumes_and_redoes_runs_whose_inputs_changed(tmp_path, capsys):
    job = tmp_path / "stopped" / "job"
    kept = _killed_midway(MUTANTS, job, "detection.md")
    names = _kept_names(kept)

    assert main([*MUTANTS, "--resume", str(job)]) == 0
    captured = capsys.readouterr()
    runs = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(runs) == 3 and sum(line.endswith("(kept)") for line in runs) == len(names)
    assert f"Resumed: {len(names)} kept run" in captured.out

    assert main([*MUTANTS, "--out", str(tmp_path / "whole"), "--run-id", "job"]) == 0
    whole, resumed = _detection(tmp_path / "whole" / "job"), _detection(job)
    pd.testing.assert_frame_equal(resumed[0], whole[0])
    assert resumed[1] == whole[1]

    assert main([*MUTANTS[:-1], "2", "--resume", str(job)]) == 0  # other decode steps: every run redone
    out = capsys.readouterr()
    assert "(kept)" not in out.err
    assert "Resumed: 0 kept runs reused, 3 redone because their inputs changed: clean on lengths / prompt 128 " \
           "(clean) (decode_steps); window-127 on lengths / prompt 128 (caught) (decode_steps)" in out.out
    assert set(pd.read_parquet(job / "detection.parquet")["decode_steps"]) == {2}


@pytest.mark.parametrize("command", ["scenarios", "mutants"])
def test_resume_of_a_folder_that_is_not_a_job_of_the_command_is_one_line_exit_2(command, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text("{}")
    other = tmp_path / "other"
    (other / "kept").mkdir(parents=True)
    (other / "job.json").write_text(json.dumps({"command": "mutants" if command == "scenarios" else "scenarios"}))
    expected = f"fidelity: error: --resume {{}}: expected a job directory of fidelity {command} (holding its " \
               "job.json), found {}"
    for folder, found in ((run, "no job.json"), (tmp_path / "none", "no such folder"),
                          (other, f"one of fidelity {'mutants' if command == 'scenarios' else 'scenarios'}")):
        assert main([command, "--resume", str(folder)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [expected.format(folder, found)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "run"]  # nothing written
    assert main([command, "--resume", str(other), "--run-id", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == \
        ["fidelity: error: --resume: continues the job in its own directory; expected no --run-id"]


def test_ctrl_c_says_what_was_kept_and_how_to_continue(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first run: exit 130 and one line naming the kept run's folder and ``--resume``."""
    from fidelity.studies import mutant_runs

    real = mutant_runs._judge_one
    calls = []

    def stop_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mutant_runs, "_judge_one", stop_second)
    assert main([*MUTANTS, "--out", str(tmp_path), "--run-id", "job"]) == 130
    job = tmp_path / "job"
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"fidelity: interrupted; 1 finished run kept in {job}: continue with the same options and --resume {job}"
    assert len(list((job / "kept").glob("*.json"))) == 1 and not (job / "detection.md").exists()
