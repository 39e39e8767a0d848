"""The mutant catalogue against the oracle-free checks, with and without the sites (docs/fuzz.md "Checks at the
sites"): which planted port bugs a self-consistency pair catches by its logits, and which only at the sites.

    OMP_NUM_THREADS=1 python benchmarks/site_pairs_mutants.py --out DIR [--only NAME ...] [--no-clean]

Per mutant (planted as a fault, under its profile), the scripted scenarios of the catalogue (``batch``, ``prefix``,
``verify``, whose checks compare the sites) and the catalogue's chunked runs played as scripts (``chunks``: each
chunked prefill and its decode steps against the whole prompt, derived as a fuzz script is) are judged against the
decoder itself; the table counts
the pairs failing by their logits and the pairs failing at all, and names the first site that breaks. Writes
``mutants.csv`` and ``mutants.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fidelity.api import open_decoder, plan_checkpoint  # noqa: E402
from fidelity.decoders.faults import inject  # noqa: E402
from fidelity.outputs.report import md_table  # noqa: E402
from fidelity.studies.catalogue import CATALOGUE, Feed, Run, Scenario, Script  # noqa: E402
from fidelity.studies.derive import derive  # noqa: E402
from fidelity.studies.mutants import BY_NAME  # noqa: E402
from fidelity.studies.mutants import CATALOGUE as MUTANTS  # noqa: E402
from fidelity.studies.scenarios import self_consistency  # noqa: E402


def as_script(run: Run) -> Script:
    """A catalogue run as a one-sequence script: its prefill chunks, then its decode steps one call each."""
    ops = tuple(Feed(((0, n),)) for n in run.chunks or (run.prompt_len,))
    return Script(run.label, ((0, run.stream or ((0, run.positions),)),),
                  ops + tuple(Feed(((0, 1),)) for _ in range(run.decode_steps)))


def scenarios() -> list[Scenario]:
    """The scripted scenarios (their checks compare the sites) and each chunked run's derived checks."""
    out = [CATALOGUE[n] for n in ("batch", "prefix", "verify")]
    out += [derive(as_script(r), f"chunks / {r.label}") for r in CATALOGUE["chunks"].runs if r.chunks]
    return out


def judge(plan, ckpt, ids, name: str | None) -> dict:
    m = BY_NAME[name] if name else None
    profile = m.options.get("profile", "reference") if m else "reference"
    capacity = m.options.get("max_context", 0) if m else 0

    def fresh(n: int):
        return open_decoder("production", ckpt, profile, max(n, capacity))

    t0 = time.perf_counter()
    pairs = []
    with inject(*((name,) if name else ())):
        for s in scenarios():
            pairs += self_consistency(s, ids, fresh)
    logits = [p for p in pairs if not p["logits_passed"]]
    sites = [p for p in pairs if not p["passed"]]
    first = sites[0] if sites else None
    return {"mutant": name or "none (clean)", "profile": profile, "pairs": len(pairs),
            "failing by logits": len(logits), "failing with the sites": len(sites),
            "first failing pair": f"{first['scenario']}: {first['pair']} {first['b']}" if first else "-",
            "its first site": f"{first['site']} ({first['site_check']})" if first and first["site"] else "-",
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--only", action="append", help="mutant name (repeatable; default: every mutant)")
    ap.add_argument("--no-clean", action="store_true", help="leave out the clean decoder's row (judged first)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    plan = plan_checkpoint(None)
    ckpt = plan.open()
    ids = plan.prompt(1024)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in ([] if a.no_clean else [None]) + (a.only or [m.name for m in MUTANTS]):
        rows.append(judge(plan, ckpt, ids, name))
        print(rows[-1], flush=True)
        table = pd.DataFrame(rows)
        table.to_csv(a.out / "mutants.csv", index=False)
        (a.out / "mutants.md").write_text(md_table(table) + "\n")


if __name__ == "__main__":
    main()
