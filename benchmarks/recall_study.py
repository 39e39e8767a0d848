"""Indexer recall study on the trained default at real selection sizes and which entries it misses.

    OMP_NUM_THREADS=1 python benchmarks/recall_study.py --contexts 16384 65536 --threads 1
    python benchmarks/recall_study.py --device cuda --contexts 16384 65536 262144 --out DIR

One chunked FP32 oracle prefill per context gives each CSA layer's exact indexer and attention inputs at
``--queries`` positions spread over the context; every indexer precision then scores the same inputs through the
production decoder's ops, and every top-k is taken from those scores (``fidelity.studies.recall``: definitions). Writes
recall.json, summary.csv (per layer), summary_pooled.csv, misses.csv, queries.csv.gz, recall.png, misses.png and
a README.md with the command, date, machine, wall times and the table to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from fidelity.model.default import default_checkpoint
from fidelity.model.load import load_checkpoint
from fidelity.outputs.recall_report import format_table, write_study
from fidelity.studies import recall

OUT = Path(__file__).parent / "results" / "2026-12-05-recall-study"


def machine(device: str) -> str:
    """The CPU (model name, cores) and the device in words."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {torch.get_num_threads()} torch thread(s) of {len(os.sched_getaffinity(0))} cores available"
    if device.startswith("cuda") and torch.cuda.is_available():
        text += f"; {torch.cuda.get_device_name(torch.device(device))}"
    return text + f"; torch {torch.__version__}, Python {platform.python_version()}"


def readme(args, result: recall.StudyResult, tables: dict, wall: float, paths: dict[str, Path]) -> str:
    pooled, missed = tables["pooled"], tables["misses"]
    times = "\n".join(f"- {m['context']} tokens ({m['text']}): oracle prefill {m['prefill_s']:.1f} s, scoring "
                      f"{m['study_s']:.1f} s, {m['queries']} queries x layers {m['layers']}"
                      for m in result.meta["contexts"])
    cols = ["context", "precision", "k", "misses_per_query", "near_tie_share", "miss_mass", "near_tie_mass",
            "median_margin", "in_window_share"]
    from fidelity.outputs.report import md_table

    return f"""# Indexer recall study ({datetime.date.today().isoformat()})

Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python {shlex.join(sys.argv)}`

Machine: {machine(args.device)}; device `{args.device}`.

Checkpoint: the trained default (`fidelity/data/default`, index_topk {result.meta['index_topk']}); precisions
{', '.join(result.meta['precisions'])}; top-k {', '.join(map(str, result.meta['topks']))}.

Wall time: {wall:.1f} s in all.
{times}

Recall is over the selective queries (more visible entries than k); `queries` counts them (per layer, pooled over
the CSA layers). Definitions: `fidelity/studies/recall.py` and `docs/recall.md`.

{format_table(pooled)}

Misses (over selective queries; margin in units of the query's largest exact score; `miss_mass` is the share of
the exact selection's attention mass the misses carry, mean per query; near-tie: margin <= {recall.NEAR_TIE}):

{md_table(missed[cols].round(4))}

Files: {', '.join(p.name for p in paths.values())}.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--checkpoint", help="checkpoint folder (default: the trained default)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--topk", type=int, nargs="+", default=list(recall.DEFAULT_TOPKS))
    ap.add_argument("--precisions", nargs="+", default=list(recall.DEFAULT_PRECISIONS))
    ap.add_argument("--queries", type=int, default=256, help="sampled query positions per context")
    ap.add_argument("--chunk", type=int, default=4096, help="oracle prefill chunk (tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint or default_checkpoint())
    t0 = time.perf_counter()
    result = recall.run_study(ckpt, args.contexts, args.topk, args.precisions, args.queries, args.chunk, args.device,
                              progress=lambda s: print(f"[{time.perf_counter() - t0:7.1f} s] {s}", flush=True))
    wall = time.perf_counter() - t0
    out = Path(args.out)
    tables = recall.summaries(result)
    paths = write_study(result, tables, recall.__doc__, out)
    (out / "README.md").write_text(readme(args, result, tables, wall, paths))
    print(format_table(tables["pooled"]))
    print(f"wrote {out} in {wall:.1f} s")


if __name__ == "__main__":
    main()
