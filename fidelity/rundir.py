"""Run directories: ``<out_root>/<run-id>/`` with metrics.parquet, manifest.json, report.md, report.html, plots/.

Written atomically: everything goes into a hidden temporary directory next to the target, which is renamed into
place only when complete; a failure removes it. An existing run directory is replaced only with ``overwrite``.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from fidelity.plots import make_plots
from fidelity.report import write_report
from fidelity.thresholds import COLUMNS, Threshold, default_thresholds

METRICS_FILE, MANIFEST_FILE = "metrics.parquet", "manifest.json"
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


def _manifest_json(manifest: dict, df: pd.DataFrame, thresholds: Sequence[Threshold] | None) -> str:
    """The manifest plus the rules that judged the run (unless it already records them)."""
    data = dict(manifest)
    profiles = df["profile"].unique()
    if thresholds is None and len(profiles) == 1:
        thresholds = default_thresholds(str(profiles[0]))
    if thresholds is not None and "thresholds" not in data:
        data["thresholds"] = [t.to_dict() for t in thresholds]
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def _fill(tmp: Path, df: pd.DataFrame, manifest: dict, thresholds: Sequence[Threshold] | None) -> None:
    df.to_parquet(tmp / METRICS_FILE, index=False)
    (tmp / MANIFEST_FILE).write_text(_manifest_json(manifest, df, thresholds), encoding="utf-8")
    plots = make_plots(df, tmp / "plots")
    write_report(tmp, df, manifest, thresholds, plots=plots)


def write_run(out_root: str | Path, run_id: str, df: pd.DataFrame, manifest: dict,
              thresholds: Sequence[Threshold] | None = None, overwrite: bool = False) -> Path:
    """Write ``out_root/run_id/`` atomically and return it. ``thresholds=None``: defaults of the run's profile."""
    if not _RUN_ID.fullmatch(run_id):
        raise RunDirError(f"run id: expected letters, digits, '.', '_', '+', '-' (not leading), found {run_id!r}")
    out_root, df = Path(out_root), check_metrics(df, f"run {run_id}")
    target = out_root / run_id
    if target.exists() and not overwrite:
        raise RunDirError(f"{target}: run directory exists; pass overwrite=True to replace it")
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{run_id}.partial-", dir=out_root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a run directory is an ordinary folder
        _fill(tmp, df, manifest, thresholds)
        _swap_in(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _swap_in(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target``; an existing target is moved aside first and removed after success."""
    if not target.exists():
        tmp.rename(target)
        return
    if not overwrite:
        raise RunDirError(f"{target}: run directory appeared while writing; not replaced")
    old = target.with_name(f".{target.name}.old-{secrets.token_hex(3)}")
    target.rename(old)
    try:
        tmp.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
