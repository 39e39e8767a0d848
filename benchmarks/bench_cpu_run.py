"""Wall time of the default ``fidelity run`` (tiny checkpoint, 1024-token prompt, 64 decode steps, three modes)
on this machine's CPU with 1 and 2 torch threads, alone and while another process keeps one core busy, and where
the run's time goes (the manifest's ``seconds_by_part``).

    python benchmarks/bench_cpu_run.py --out results/        # writes bench_cpu_run.{json,md}

Each configuration runs ``--repeats`` times in a fresh process (the first includes imports and synthesis: it is
what a user waits for); the table gives the median and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY = "while True: pass"


def one_run(threads: int, busy: bool, out: Path, run_id: str, extra: list[str]) -> dict:
    """Wall seconds of one ``fidelity run`` and its manifest's time by part."""
    hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fidelity.cli", "run", "--threads", str(threads), "--out", str(out),
                        "--run-id", run_id, *extra], check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    manifest = json.loads((out / run_id / "manifest.json").read_text())
    return {"wall_s": wall, "run_s": manifest["seconds"], "by_part": manifest["seconds_by_part"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("extra", nargs="*", help="more `fidelity run` arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (False, True):
            for threads in args.threads:
                runs = [one_run(threads, busy, Path(tmp), f"t{threads}-b{int(busy)}-{k}", args.extra)
                        for k in range(args.repeats)]
                walls = [r["wall_s"] for r in runs]
                results.append({"threads": threads, "other_core_busy": busy, "wall_s": walls,
                                "median_wall_s": statistics.median(walls), "by_part": runs[-1]["by_part"]})
                print(f"threads {threads}, other core busy {busy}: median {statistics.median(walls):.1f} s "
                      f"({min(walls):.1f}-{max(walls):.1f})", flush=True)
    info = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "extra": args.extra, "results": results}
    (out / "bench_cpu_run.json").write_text(json.dumps(info, indent=2) + "\n")
    rows = ["| torch threads | other core busy | wall, median (range) |", "|---:|---|---|"]
    rows += [f"| {r['threads']} | {'yes' if r['other_core_busy'] else 'no'} | {r['median_wall_s']:.1f} s "
             f"({min(r['wall_s']):.1f}-{max(r['wall_s']):.1f}) |" for r in results]
    parts = sorted(results[0]["by_part"].items(), key=lambda kv: -kv[1])
    rows += ["", f"Time by part, {results[0]['threads']} thread(s), alone: "
             + ", ".join(f"{k} {v:.1f} s" for k, v in parts)]
    (out / "bench_cpu_run.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
