"""A run from start to verdict: runner -> metrics table -> judgement -> run directory (``fidelity run``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fidelity.judgement import Judgement, csa_layers, judge, run_rules
from fidelity.production.profiles import get_profile
from fidelity.rundir import check_output, new_run_id, read_run, write_run
from fidelity.runner import Runner, RunSpec
from fidelity.thresholds import COLUMNS, Divergence, profile_class, thresholds_for


@dataclass
class JobResult:
    run_dir: Path
    judgement: Judgement
    manifest: dict

    @property
    def failures(self) -> pd.DataFrame:
        return self.judgement.failures

    @property
    def first_divergence(self) -> Divergence | None:
        return self.judgement.first_divergence

    @property
    def passed(self) -> bool:
        return self.judgement.passed


def tidy(df: pd.DataFrame, run_id: str, profile: str) -> pd.DataFrame:
    """The runner's rows in the long format of ``thresholds.COLUMNS``."""
    df = df.assign(run_id=run_id, profile=profile)
    df["position"] = df["position"].fillna(-1).astype("int64")
    for col in ("step", "layer"):
        df[col] = df[col].astype("int64")
    df["value"] = df["value"].astype("float64")
    return df[list(COLUMNS)]


def run_job(checkpoint, spec: RunSpec, out_root: str | Path = "runs", run_id: str | None = None,
            thresholds_path: str | Path | None = None, overwrite: bool = False, progress=None) -> JobResult:
    """Run ``spec``, judge it once and write the run directory. Thresholds, the profile and the output place are
    checked before the long work."""
    profile = get_profile(spec.profile)
    rules = thresholds_for(profile, thresholds_path, csa_layers(checkpoint.config))
    run_id = run_id or new_run_id()
    check_output(out_root, run_id, overwrite)
    df, manifest = Runner(checkpoint, spec, progress).run()
    manifest["run_id"] = run_id
    df = tidy(df, run_id, profile.name)
    judgement = judge(df, rules, profile_class(profile))
    run_dir = write_run(out_root, run_id, df, manifest, judgement, overwrite=overwrite)
    return JobResult(run_dir, judgement, manifest)


def judge_run(run_dir: str | Path, thresholds_path: str | Path | None = None) -> JobResult:
    """Judge an existing run with the rules it was judged with (plus those of ``thresholds_path``)."""
    df, manifest = read_run(run_dir)
    rules, klass = run_rules(manifest, df, thresholds_path)
    return JobResult(Path(run_dir), judge(df, rules, klass), manifest)
