"""A run from start to verdict: runner -> metrics table -> run directory -> thresholds (``fidelity run``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fidelity.rundir import new_run_id, read_run, write_run
from fidelity.runner import Runner, RunSpec
from fidelity.thresholds import COLUMNS, Divergence, evaluate, first_divergence, thresholds_for


@dataclass
class JobResult:
    run_dir: Path
    failures: pd.DataFrame
    divergence: Divergence | None
    manifest: dict

    @property
    def passed(self) -> bool:
        return self.failures.empty


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
    csa = [i for i, k in enumerate(checkpoint.config.layer_kinds) if k == "csa"]
    thresholds = thresholds_for(spec.profile, thresholds_path, csa)  # parse errors before the long work
    run_id = run_id or new_run_id()
    df, manifest = Runner(checkpoint, spec, progress).run()
    manifest["run_id"] = run_id
    df = tidy(df, run_id, spec.profile)
    run_dir = write_run(out_root, run_id, df, manifest, thresholds, overwrite=overwrite)
    failures = evaluate(df, thresholds)
    return JobResult(run_dir, failures, first_divergence(failures), manifest)


def judge_run(run_dir: str | Path, thresholds_path: str | Path | None = None) -> JobResult:
    """Re-judge an existing run (e.g. with another thresholds file)."""
    df, manifest = read_run(run_dir)
    profile = str(df["profile"].iloc[0]) if len(df) else "reference"
    kinds = manifest.get("config", {}).get("compress_ratios", [])
    csa = [i for i, r in enumerate(kinds[: manifest.get("config", {}).get("n_layers", len(kinds))]) if r == 4]
    failures = evaluate(df, thresholds_for(profile, thresholds_path, csa))
    return JobResult(Path(run_dir), failures, first_divergence(failures), manifest)
