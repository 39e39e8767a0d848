"""Does the scenario catalogue find each planted port bug without being told where? ``fidelity scenarios`` with one
fault of the mutant catalogue planted at a time (``run_scenarios(..., faults=(name,))``, under the mutant's profile
where it names one), on the trained default (or ``--checkpoint``): per mutant the verdict, how many runs and pairs
fail, the first failing run with its first divergence, and whether the mutant's own scenario run is among the
failures.

    python benchmarks/scenarios_find_mutants.py --out benchmarks/results/<date>-scenarios-find-mutants \
        [--only NAME ...] [--mode op ...]

Writes ``find.csv`` and ``find.md`` (one row per mutant) to ``--out`` and each report under ``--out/reports/``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from fidelity.api import plan_checkpoint
from fidelity.outputs.report import md_table
from fidelity.studies.mutants import BY_NAME, CATALOGUE
from fidelity.studies.scenarios import run_scenarios


def find(plan, name: str, out: Path, modes: tuple[str, ...]) -> dict:
    """One mutant planted through the whole catalogue: a summary row."""
    m = BY_NAME[name]
    t0 = time.perf_counter()
    profile = m.options.get("profile", "reference")  # a fault of a cache layout needs the layout's profile
    res = run_scenarios(plan, None, out=out / "reports", run_id=name, modes=modes, overwrite=True, faults=(name,),
                        profile=profile)
    runs = res.matrix[res.matrix["verdict"] != "PASS"]
    pairs = res.pairs[~res.pairs["passed"]] if len(res.pairs) else res.pairs
    first = runs.iloc[0] if len(runs) else None
    own = f"{m.scenario} / {m.run}"
    return {"mutant": name, "profile": profile, "verdict": "FAIL" if not res.passed else "PASS",
            "runs failing": f"{len(runs)}/{len(res.matrix)}", "pairs failing": f"{len(pairs)}/{len(res.pairs)}",
            "first failing run": f"{first['scenario']} / {first['run']}" if first is not None else "-",
            "its first divergence": first["first_divergence"] if first is not None else "-",
            "own run fails": bool(((runs["scenario"] + " / " + runs["run"]) == own).any()),
            "own run": own, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--checkpoint", help="checkpoint directory (default: the trained default)")
    ap.add_argument("--only", action="append", help="mutant name (repeatable; default: the whole catalogue)")
    ap.add_argument("--mode", action="append", choices=("free", "layer", "op"), help="default: all three")
    args = ap.parse_args()
    plan = plan_checkpoint(args.checkpoint)
    plan.open()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or [m.name for m in CATALOGUE]:
        rows.append(find(plan, name, args.out, tuple(args.mode or ("free", "layer", "op"))))
        print(rows[-1], flush=True)
        table = pd.DataFrame(rows)
        table.to_csv(args.out / "find.csv", index=False)
        (args.out / "find.md").write_text(f"# The scenario catalogue against each planted fault\n\n"
                                          f"checkpoint: {plan.what}\n\n{md_table(table)}\n", encoding="utf-8")


if __name__ == "__main__":
    main()
