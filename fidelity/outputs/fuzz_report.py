"""The fuzz report (``fidelity fuzz``): report.md with the verdict, what was searched and left out, the scripts
tried, and for a failure the original and the shrunk script, each with its failing check and first divergence."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _verdict_lines(v) -> list[str]:
    out = [f"- failing check: `{v.check}`", f"- detail: {v.detail}"]
    for r in v.oracle:
        out.append(f"- against the oracle, {r['run']}: {r['verdict']}, first divergence {r['first_divergence']}")
    if not v.oracle:
        out.append("- against the oracle: not judged")
    return out


def write_report(tmp: Path, res: Any, checkpoint: str, decoder: str,
                 scripts: dict[str, tuple[list[str], tuple[int, int]]]) -> Path:
    """report.md of a fuzz result (``fidelity.studies.fuzz_run.FuzzResult``) in ``tmp``; ``scripts``: for a failure,
    the ``original`` and ``shrunk`` script each as lines (``catalogue.describe``) and its (ops, tokens)."""
    n = len(res.tried)
    f = res.found
    head = "PASS: no script failed" if f is None else f"FAIL: {f.verdict.check}"
    lines = [f"# fidelity fuzz: {decoder}", "", f"**verdict: {head}**", "",
             f"- checkpoint: {checkpoint}", f"- seed {res.seed}, budget {res.budget_s:.0f} s, ran {res.seconds:.0f} s",
             f"- scripts tried: {n} ({res.refused} refused by the decoder; "
             f"{int(res.tried['oracle'].sum()) if n else 0} also judged against the oracle)"]
    if res.left_out:
        lines.append("- not drawn: " + "; ".join(f"{k} ({why})" for k, why in res.left_out.items()))
    for note in res.notes:
        lines.append(f"- {note}")
    if f is not None:
        (original, so), (shrunk, ss) = scripts["original"], scripts["shrunk"]
        lines += ["", "## Failure", "", f"- time to first failure: {f.seconds_to_failure:.1f} s (script {n})",
                  f"- shrunk from {so[0]} ops / {so[1]} tokens to {ss[0]} ops / {ss[1]} tokens "
                  f"({f.shrink_tried} candidates, {f.shrink_seconds:.0f} s)",
                  "- replay: `fidelity scenarios --scenario-file scenario.json` (this folder's file)", "",
                  "### Shrunk script (scenario.json)", "", *shrunk, "", *_verdict_lines(f.shrunk_verdict),
                  "", "### Original script (original.json)", "", *original, "",
                  *_verdict_lines(f.verdict)]
    if n:
        lines += ["", "## Scripts tried", "", "| script | sequences | ops | tokens | oracle | check | seconds |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.script} | {r.sequences} | {r.ops} | {r.tokens} | {'yes' if r.oracle else 'no'} | "
                  f"{r.check} | {r.seconds:.1f} |" for r in res.tried.itertuples()]
    (tmp / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp / "report.md"
