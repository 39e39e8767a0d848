"""Indexer recall ablation: indexer shape, context, Hadamard, trained vs random weights (docs/recall.md).

    OMP_NUM_THREADS=1 python benchmarks/recall_ablation.py --contexts 4096 16384 --long 65536 --out DIR
    python benchmarks/recall_ablation.py --variants trained-4x64 random-64x128 --contexts 4096 --queries 64

Every variant (``fidelity.studies.recall_ablation.VARIANTS``: the trained default, random weights at its shape,
at 4x128 and 64x64, and at DeepSeek-V4's 64x128 on the default's 6-layer model) runs the recall study
(``fidelity.studies.recall``) on the same corpus token ids at each of ``--contexts``; ``--long`` contexts run for
``--long-variants`` only (the cheap 4-head ones). Writes to ``--out``: ablation.md (the table), ablation.csv
(k 512 / 1024, one row per variant, context and k), summary_pooled.csv and summary.csv (every precision and k,
layers pooled / per layer), misses.csv, ablation.json (runs, times, tables) and README.md (command, date,
machine, tree, times, tables).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from recall_study import machine  # noqa: E402

from fidelity.model.default import default_checkpoint  # noqa: E402
from fidelity.model.load import load_checkpoint  # noqa: E402
from fidelity.outputs.report import md_table  # noqa: E402
from fidelity.studies import recall, recall_ablation  # noqa: E402

OUT = Path(__file__).parent / "results" / "2026-12-07-recall-ablation"


def tree() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fmt(df):
    return md_table(df.round(4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--variants", nargs="+", default=list(recall_ablation.DEFAULT_VARIANTS),
                    choices=list(recall_ablation.VARIANTS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--long", type=int, nargs="*", default=[], help="contexts for --long-variants only")
    ap.add_argument("--long-variants", nargs="+", default=["trained-4x64", "random-4x64"],
                    choices=list(recall_ablation.VARIANTS))
    ap.add_argument("--topk", type=int, nargs="+", default=list(recall.DEFAULT_TOPKS))
    ap.add_argument("--precisions", nargs="+", default=list(recall_ablation.DEFAULT_PRECISIONS))
    ap.add_argument("--queries", type=int, default=256, help="sampled query positions per context")
    ap.add_argument("--chunk", type=int, default=4096, help="oracle prefill chunk (tokens)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random variants' weights")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trained = load_checkpoint(default_checkpoint())
    plan = [(v, [*args.contexts, *(args.long if v in args.long_variants else [])]) for v in args.variants]
    t0 = time.perf_counter()
    result = recall_ablation.run_ablation(
        trained, plan, args.topk, args.precisions, args.queries, args.chunk, args.seed,
        progress=lambda s: print(f"[{time.perf_counter() - t0:7.1f} s] {s}", flush=True))
    wall = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = recall_ablation.tables(result)
    table = recall_ablation.ablation_table(t["pooled"], t["misses"])
    small = recall_ablation.ablation_table(t["pooled"], t["misses"], ks=(32, 128))
    layer = t["per_layer"][(t["per_layer"]["precision"] == "fp4") & t["per_layer"]["k"].isin([512, 1024])]
    layer = layer[["variant", "context", "layer", "k", "selective", "recall", "recall_min", "recall_bf16",
                   "dense_share"]]
    table.to_csv(out / "ablation.csv", index=False)
    t["pooled"].to_csv(out / "summary_pooled.csv", index=False)
    t["per_layer"].to_csv(out / "summary.csv", index=False)
    t["misses"].to_csv(out / "misses.csv", index=False)
    (out / "ablation.md").write_text(fmt(table) + "\n")
    (out / "ablation.json").write_text(json.dumps({
        **result.meta, "wall_s": round(wall, 1), "ablation": table.to_dict("records"),
        "pooled": t["pooled"].to_dict("records"), "misses": t["misses"].to_dict("records")}, indent=1,
        default=float))
    runs = "\n".join(f"- {m['variant']} ({m['about']}; indexer {m['indexer']}, index_topk {m['index_topk']}), "
                     f"{m['context']} tokens: checkpoint {m['build_s']:.1f} s, oracle prefill {m['prefill_s']:.1f} "
                     f"s, scoring {m['study_s']:.1f} s" for m in result.meta["runs"])
    text = result.meta["runs"][0]["text"]
    (out / "README.md").write_text(f"""# Indexer recall ablation ({datetime.date.today().isoformat()})

Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python {shlex.join(sys.argv)}`

Machine: {machine('cpu')}. Tree: {tree()}. Wall time {wall:.1f} s in all.

Token ids: the same for every variant at a context ({text}). Random weights: `synthesize(config, seed=
{args.seed})`. Precisions {', '.join(args.precisions)}; top-k {', '.join(map(str, args.topk))}; {args.queries}
query positions per context, CSA layers pooled. Definitions: `fidelity/studies/recall.py`, `docs/recall.md`.

{runs}

Recall against the exact fp32 selection (columns named by precision), k = 512 and 1024 (`queries`: selective
queries, more visible entries than k; at 4K no query sees more than 1024 entries):

{fmt(table)}

k = 32 and 128:

{fmt(small)}

FP4 per layer (layer 2's inputs do not depend on any variant's index_topk; layer 4's do):

{fmt(layer)}

Files: ablation.md, ablation.csv, summary_pooled.csv, summary.csv, misses.csv, ablation.json.
""")
    print(fmt(table))
    print(f"wrote {out} in {wall:.1f} s")


if __name__ == "__main__":
    main()
