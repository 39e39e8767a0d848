"""The clean decoder's spread at the sites: what ``site_checks.BOUNDS`` is set from (docs/fuzz.md "Checks at the
sites").

    OMP_NUM_THREADS=1 python benchmarks/site_spread.py --seed 1 --budget 540 --context 512 --out DIR1
    python benchmarks/site_spread.py --merge DIR1 DIR2 --out DIR

Draws ``fidelity fuzz``'s scripts (seeded) and judges each against the production decoder itself, sites compared,
for ``--budget`` seconds, never stopping at a failure; writes ``pairs.csv.gz`` (a row per pair and site: the pair's
kind, whether equal bits were promised, the site's statistics and its check), ``spread.csv`` (per site template
and promise: the worst cosine, relative L2, recall and moved share over every pair, and how many pairs broke a
structure rule or a bit promise: on a clean decoder those are false alarms), ``bysite.csv`` and ``bounds.txt``
(twice each template's worst deviation, what ``site_checks.BOUNDS`` holds). ``--merge`` summarises several runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fidelity.api import plan_checkpoint  # noqa: E402
from fidelity.decoders.production.decoder import ProductionDecoder  # noqa: E402
from fidelity.model.sites import site_template  # noqa: E402
from fidelity.studies.fuzz import Space  # noqa: E402
from fidelity.studies.fuzz_judge import Verdict, judge_self  # noqa: E402
from fidelity.studies.fuzz_run import search  # noqa: E402


def summarise(frames: list[pd.DataFrame], out: Path) -> None:
    """``spread.csv`` (per site template and promise), ``bysite.csv`` (per site, bounds-judged pairs) and
    ``bounds.txt``: twice the clean worst deviation of each template (1 - cos, relative L2, 1 - recall, moved share)."""
    df = pd.concat(frames)
    agg = {c: f for c, f in (("cos_min", "min"), ("rel_l2_max", "max"), ("recall_min", "min"),
                            ("moved_share", "max"), ("unequal_rows", "max")) if c in df}
    spread = df.groupby(["template", "bitwise"]).agg(**{c: (c, f) for c, f in agg.items()}, pairs=("script", "size"))
    broke = df[df["check"].isin(["structure", "bits"])].groupby(["template", "bitwise"]).size()
    spread["structure_or_bits_breaks"] = broke.reindex(spread.index).fillna(0).astype(int)
    spread.to_csv(out / "spread.csv")
    bounds = df[~df["bitwise"]]
    bounds.groupby("site").agg(**{c: (c, f) for c, f in agg.items()}, pairs=("script", "size")).to_csv(
        out / "bysite.csv")
    worst = bounds.groupby("template").agg(**{c: (c, f) for c, f in agg.items()})
    lines = [f"{t}: cos_min {1 - 2 * (1 - r.cos_min):.3f}, rel_l2_max {2 * r.rel_l2_max:.3f}, recall_min "
             f"{max(0.0, 1 - 2 * (1 - r.recall_min)):.3f}, moved_max {min(1.0, 2 * r.moved_share):.3f}"
             for t, r in worst.iterrows()]
    (out / "bounds.txt").write_text("\n".join(lines) + "\n")
    print(spread.to_string())
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=float, default=600)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", type=Path, nargs="+", help="summarise these runs' pairs.csv.gz into --out (no search)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.merge:
        summarise([pd.read_csv(d / "pairs.csv.gz") for d in a.merge], a.out)
        return
    torch.set_num_threads(1)
    plan = plan_checkpoint(None)
    ckpt = plan.open()

    def fresh(n: int) -> ProductionDecoder:
        return ProductionDecoder(ckpt, max_context=max(n, a.context))

    space = Space.of(fresh(a.context), a.context)
    ids = plan.prompt(space.longest)
    rows: list[dict] = []

    def judge_one(script, oracle: bool) -> Verdict:
        v = judge_self(script, ids, fresh)
        n = 1 + max((r["script"] for r in rows), default=0)
        for p in v.pairs:
            for site, stats in p.get("site_stats", {}).items():
                rows.append({"script": n, "pair": p["pair"], "bitwise": p["bitwise promised"] != "no", "site": site,
                             "template": site_template(site), "positions": p["positions"],
                             "failed_here": p["site"] == site, "check": p["site_check"] if p["site"] == site else "",
                             **stats})
        return Verdict(refused=v.refused)  # never a failure: the search runs its whole budget

    t0 = time.perf_counter()
    tried, *_ = search(space, a.seed, a.budget, judge_one, 0.0, lambda line: print(line, flush=True))
    df = pd.DataFrame(rows)
    df.to_csv(a.out / "pairs.csv.gz", index=False)
    summarise([df], a.out)
    print(f"{len(tried)} scripts, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
