"""The proof of ``fidelity fuzz`` (docs/fuzz.md, issue 68): the fixed catalogue on the planted port bugs of
tests/fuzz_plants.py, and seeded fuzz searches on each plant and on the clean decoder.

    OMP_NUM_THREADS=1 python benchmarks/fuzz_proof.py catalogue
    OMP_NUM_THREADS=1 python benchmarks/fuzz_proof.py fuzz fork-of-fork-root --budget 300 --seed 0 --context 512
    OMP_NUM_THREADS=1 python benchmarks/fuzz_proof.py fuzz clean --budget 300 --seed 0 --context 512

``catalogue``: the whole catalogue (``run_scenarios``, every mode) on one decoder carrying every plant
(``AllPlanted``), and how many calls each plant changed (its ``fired`` count): a plant that fired on no call made
exactly the clean decoder's calls, so the catalogue's verdict on it alone is this one. ``fuzz``: ``run_fuzz`` with
the plant decoder (or ``clean``: the production decoder). Each writes a JSON summary and its run directory's
small files to ``--out`` (default benchmarks/results/2026-12-07-fuzz-proof).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fidelity.api import plan_checkpoint  # noqa: E402
from fidelity.studies.fuzz_run import run_fuzz  # noqa: E402
from fidelity.studies.scenarios import run_scenarios  # noqa: E402
from fidelity.studies.shrink import size  # noqa: E402
from tests.fuzz_plants import PLANTS, AllPlanted  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "2026-12-07-fuzz-proof"


def catalogue(out: Path) -> dict:
    plan = plan_checkpoint(None)
    for cls in PLANTS.values():
        cls.fired = 0
    decoder = AllPlanted(plan.open(), max_context=1024)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_scenarios(plan, None, decoder, tmp, "catalogue", progress=lambda line: print(line, flush=True))
        shutil.copy(res.out_dir / "matrix.csv", out / "catalogue-matrix.csv")
        shutil.copy(res.out_dir / "pairs.csv", out / "catalogue-pairs.csv")
    summary = {"decoder": "AllPlanted (tests/fuzz_plants.py)", "verdict": res.verdict(),
               "fired": {name: cls.fired for name, cls in PLANTS.items()}, "runs": len(res.matrix),
               "pairs": len(res.pairs), "seconds": round(time.perf_counter() - t0, 1)}
    (out / "catalogue.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def fuzz(name: str, out: Path, seed: int, budget: float, context: int, oracle_rate: float,
         shrink_s: float | None) -> dict:
    plan = plan_checkpoint(None)
    if name == "clean":
        decoder = "production"
    else:
        PLANTS[name].fired = 0
        decoder = PLANTS[name](plan.open(), max_context=context)
    tag = f"fuzz-{name}-seed{seed}"
    with tempfile.TemporaryDirectory() as tmp:
        res = run_fuzz(plan, decoder, tmp, tag, seed=seed, budget_s=budget, context=context, oracle_rate=oracle_rate,
                       shrink_s=shrink_s, progress=lambda line: print(line, flush=True))
        folder = out / tag
        folder.mkdir(parents=True, exist_ok=True)
        for f in res.out_dir.iterdir():
            if f.is_file() and f.suffix in (".md", ".csv", ".json"):
                shutil.copy(f, folder / f.name)
    tried = res.tried
    summary = {"decoder": name, "seed": seed, "budget_s": budget, "context": context, "oracle_rate": oracle_rate,
               "scripts": len(tried), "oracle_judged": int(tried["oracle"].sum()) if len(tried) else 0,
               "refused": res.refused, "seconds": round(res.seconds, 1), "found": res.found is not None}
    if name != "clean":
        summary["fired"] = PLANTS[name].fired
    if res.found is not None:
        f = res.found
        summary.update(check=f.verdict.check, detail=f.verdict.detail, note=f.verdict.note,
                       seconds_to_failure=round(f.seconds_to_failure, 1), original_size=list(size(f.original)),
                       shrunk_size=list(size(f.shrunk)), shrunk_check=f.shrunk_verdict.check,
                       shrunk_detail=f.shrunk_verdict.detail, shrink_candidates=f.shrink_tried,
                       shrink_seconds=round(f.shrink_seconds, 1))
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("catalogue", "fuzz"))
    ap.add_argument("decoder", nargs="?", choices=(*PLANTS, "clean"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds of search")
    ap.add_argument("--shrink-budget", type=float, default=None, help="seconds of shrinking (default half --budget)")
    ap.add_argument("--context", type=int, default=512, help="--max-context: positions per sequence")
    ap.add_argument("--oracle-rate", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print("$ python " + shlex.join(sys.argv), flush=True)
    if a.what == "catalogue":
        got = catalogue(a.out)
    else:
        if a.decoder is None:
            ap.error("fuzz: name a plant or clean")
        got = fuzz(a.decoder, a.out, a.seed, a.budget, a.context, a.oracle_rate, a.shrink_budget)
    print(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
