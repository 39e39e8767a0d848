"""The mutant gate's report (``fidelity mutants``): detection.md and detection.html read like a run's report (the
gate's verdict first, then the detection matrix, '-' where a probe stayed silent), detection.parquet beside them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fidelity.atomic_write import write_dir_atomic
from fidelity.outputs.report import Section, render_html, render_markdown
from fidelity.outputs.rundir import check_output, new_run_id


def write_matrix(matrix: pd.DataFrame, table: pd.DataFrame, failures: list[str], out_dir: str | Path,
                 run_id: str | None = None, overwrite: bool = False) -> Path:
    """detection.parquet (``matrix``: a row per run and probe), detection.md and detection.html (the gate's verdict
    from ``failures`` first, then ``table``: the matrix a row per run) under ``out_dir/<run_id>/`` (default id
    ``mutants-<UTC time>-<random>``), written atomically; an existing directory is replaced only with
    ``overwrite``."""
    target = check_output(out_dir, run_id or f"mutants-{new_run_id()}", overwrite)
    return write_dir_atomic(target, lambda tmp: fill_matrix(tmp, matrix, table, failures, target.name), overwrite)


def fill_matrix(folder: Path, matrix: pd.DataFrame, table: pd.DataFrame, failures: list[str], name: str,
                resumed: str = "") -> None:
    """The matrix's files (``write_matrix``) into ``folder``, titled after the job directory ``name``;
    ``resumed``: what a resumed job reused and redid, a line under the verdict ('' for none)."""
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    mutants = table.loc[table["mutant"] != "clean", "mutant"].nunique()
    head = f"gate: {verdict}" if failures else \
        f"gate: PASS: the clean decoder stays silent and each of the {mutants} mutants is caught where it was planted"
    sections = [Section("Verdict", [head, *([resumed] if resumed else [])], css="fail" if failures else "pass"),
                Section("Detection matrix", ["First detection step and site per probe; '-': the probe stayed "
                                             "silent."], table, na="-")]
    title = f"dsv4-fidelity mutant detection matrix: {name}"
    matrix.to_parquet(folder / "detection.parquet", index=False)
    (folder / "detection.md").write_text(render_markdown(title, sections, folder), encoding="utf-8")
    (folder / "detection.html").write_text(render_html(title, sections), encoding="utf-8")
