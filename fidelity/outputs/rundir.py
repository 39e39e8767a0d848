"""Run directories: ``<out_root>/<run-id>/`` with metrics.parquet, manifest.json, report.md, report.html, plots/.

Written atomically: everything goes into a hidden temporary directory next to the target, which is renamed into
place only when complete; a failure removes it. An existing run directory is replaced only with ``overwrite``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from fidelity.atomic_write import OutputError, check_new_dir, ensure_folder, write_dir_atomic, write_text_atomic
from fidelity.harness.judgement import Judgement, judge, run_rules
from fidelity.harness.thresholds import COLUMNS, Threshold
from fidelity.outputs.plots import make_plots
from fidelity.outputs.report import write_report

METRICS_FILE, MANIFEST_FILE, VERDICT_FILE = "metrics.parquet", "manifest.json", "verdict.json"
INT_COLUMNS, STR_COLUMNS = ("step", "position", "layer"), ("run_id", "mode", "profile", "phase", "site", "metric")
MODES = frozenset({"free", "layer", "op"})
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


class RunDirError(ValueError):
    """A run directory or metric table that cannot be written or read; the message says what and where."""


def new_run_id() -> str:
    """UTC timestamp plus a short random suffix, e.g. ``20250101T120000Z-3f9a1c``."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def check_metrics(df: pd.DataFrame, where: str = "metrics") -> pd.DataFrame:
    """The contract columns with their dtypes (extra columns kept); errors name expected vs found."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise RunDirError(f"{where}: missing columns {missing}; expected {list(COLUMNS)}, found {list(df.columns)}")
    out = df.copy()
    for col, kind in [(c, "int64") for c in INT_COLUMNS] + [("value", "float64")]:
        try:
            out[col] = out[col].astype(kind)
        except (TypeError, ValueError):
            sample = out[col].head(3).tolist()
            raise RunDirError(f"{where}: column {col!r}: expected {kind} values, found e.g. {sample}") from None
    for col in STR_COLUMNS:
        out[col] = out[col].astype(str)
    bad = sorted(set(out["mode"]) - MODES)
    if bad:
        raise RunDirError(f"{where}: column 'mode': expected values in {sorted(MODES)}, found {bad}")
    return out


def _manifest_json(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n"


def check_output(out_root: str | Path, run_id: str, overwrite: bool = False) -> Path:
    """The run directory ``out_root/run_id``, checked before any work: a valid id, ``out_root`` created and
    written to (a probe file, removed), and no existing run unless ``overwrite``. Raises OutputError saying what
    is wrong."""
    if not _RUN_ID.fullmatch(run_id):
        raise OutputError(f"--run-id: expected letters, digits, '.', '_', '+', '-' (not leading), found {run_id!r}")
    ensure_folder(out_root, f"--out {out_root}")
    return check_new_dir(Path(out_root) / run_id, overwrite, "--run-id")


def verdict_record(judgement: Judgement, manifest: dict) -> dict:
    """What ``verdict.json`` holds (stable keys, for CI): ``verdict`` PASS / FAIL, ``checked`` / ``failed`` rows,
    ``first_divergence`` (its fields, the ranks whose own tensors fail it, and the sentence) or null,
    ``failing_sites`` (each failing site with its first failing step and mode), ``decoder``, ``run_id``."""
    div = judgement.first_divergence
    first = None
    if div is not None:
        first = {"step": div.step, "phase": div.phase, "site": div.site, "metric": div.metric, "value": div.value,
                 "op": div.op, "limit": div.limit, "mode": div.mode, "position": div.position,
                 "layer": int(div.site[1:div.site.index(".")]) if div.site[:1] == "L" and "." in div.site else None,
                 "ranks_failed": list(div.ranks_failed), "ranks": div.ranks, "text": str(div)}
    fails = judgement.failures
    sites = [] if fails.empty else [
        {"site": site, "step": int(g["step"].min()), "mode": str(g.sort_values("step")["mode"].iloc[0])}
        for site, g in fails.groupby("site", sort=False)]
    return {"verdict": "PASS" if judgement.passed else "FAIL", "checked": len(judgement.judged),
            "failed": int((~judgement.judged["passed"]).sum()), "first_divergence": first, "failing_sites": sites,
            "decoder": manifest.get("decoder"), "run_id": manifest.get("run_id")}


def _fill(tmp: Path, df: pd.DataFrame, manifest: dict, judgement: Judgement) -> None:
    df.to_parquet(tmp / METRICS_FILE, index=False)
    (tmp / MANIFEST_FILE).write_text(_manifest_json(manifest), encoding="utf-8")
    (tmp / VERDICT_FILE).write_text(json.dumps(verdict_record(judgement, manifest), indent=1, default=str) + "\n",
                                    encoding="utf-8")
    plots = make_plots(df, tmp / "plots")
    write_report(tmp, df, manifest, judgement, plots=plots)


def write_run(out_root: str | Path, run_id: str, df: pd.DataFrame, manifest: dict,
              judgement: Judgement | Sequence[Threshold] | None = None, overwrite: bool = False) -> Path:
    """Write ``out_root/run_id/`` atomically and return it. ``judgement``: the run's judgement, or rules to judge it
    with; None: the rules in ``manifest`` or the defaults of its profile. The manifest stores the rules and the
    verdict."""
    target = check_output(out_root, run_id, overwrite)
    df = check_metrics(df, f"run {run_id}")
    judgement = as_judgement(df, manifest, judgement)
    # the report reads the manifest as a re-render will: from its JSON (sorted keys, lists for tuples)
    manifest = json.loads(_manifest_json({**manifest, **judgement.manifest_entries()}))
    return write_dir_atomic(target, lambda tmp: _fill(tmp, df, manifest, judgement), overwrite)


def as_judgement(df: pd.DataFrame, manifest: dict, judgement: Judgement | Sequence[Threshold] | None) -> Judgement:
    """A judgement of ``df``: ``judgement`` itself, ``df`` judged with the given rules, or with the run's rules."""
    if isinstance(judgement, Judgement):
        return judgement
    rules, klass = run_rules(manifest, df)
    return judge(df, rules if judgement is None else judgement, klass)


def update_manifest(run_dir: str | Path, manifest: dict) -> None:
    """Replace a run's manifest.json (atomically)."""
    write_text_atomic(Path(run_dir) / MANIFEST_FILE, _manifest_json(manifest))


def read_run(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """(metrics, manifest) of a run directory, with errors naming the missing or malformed piece."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: not a run directory (expected a folder holding {METRICS_FILE}, {MANIFEST_FILE})")
    for name in (METRICS_FILE, MANIFEST_FILE):
        if not (path / name).is_file():
            found = sorted(p.name for p in path.iterdir())
            raise RunDirError(f"{path}: missing {name}; expected {METRICS_FILE} and {MANIFEST_FILE}, found {found}")
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunDirError(f"{path / MANIFEST_FILE}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise RunDirError(f"{path / MANIFEST_FILE}: expected a JSON object, found {type(manifest).__name__}")
    try:
        df = pd.read_parquet(path / METRICS_FILE)
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise RunDirError(f"{path / METRICS_FILE}: cannot read parquet: {err}") from None
    return check_metrics(df, str(path / METRICS_FILE)), manifest
