"""What one judged decode step costs, by part: the default ``fidelity run`` (the trained default checkpoint, its
1221-token prompt, three modes) with decode calls judged one at a time (``--oracle-block 1``) and in blocks (the
default), same machine, same session; each configuration in a fresh process.

    python benchmarks/bench_judged_step.py --out DIR [--decode 64] [--blocks 1 64] [--device cuda] [--repeats 2]

Per configuration: the wall time of the command, the run's own seconds, and per decode step (ms) the decoder, each
oracle mode and the probes (the manifest's ``seconds_by_part`` over the decode steps run), the median of the repeats.
Writes ``judged_step.json`` and ``judged_step.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = ("decoder", "oracle free", "oracle layer", "oracle op", "probes")


def fresh_run(run_args: list[str], out: Path, run_id: str, cwd: Path | None = None) -> tuple[float, dict]:
    """``fidelity run *run_args`` in a fresh process (started in ``cwd``, whose packages it then imports) writing
    ``out/run_id`` -> (wall seconds, its manifest)."""
    cmd = [sys.executable, "-m", "fidelity.cli", "run", *run_args, "--out", str(out), "--run-id", run_id]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - t0
    return wall, json.loads((out / run_id / "manifest.json").read_text())


def ms_per_call(manifest: dict, phase: str, calls: int) -> dict[str, float]:
    """Milliseconds per call of ``phase`` by part (``PARTS``, from ``seconds_by_part``) and their sum, ``total``."""
    by = manifest["seconds_by_part"]
    per_call = {p: 1000 * by.get(f"{phase} {p}", 0.0) / max(1, calls) for p in PARTS}
    return {**per_call, "total": sum(per_call.values())}


def one_run(block: int, args: argparse.Namespace, out: Path, run_id: str) -> dict:
    wall, m = fresh_run(["--threads", str(args.threads), "--decode", str(args.decode), "--oracle-block", str(block),
                         "--device", args.device, *args.extra], out, run_id)
    steps = max(1, m["decode_steps"])
    per_step = ms_per_call(m, "decode", steps)
    per_step["judged step"] = per_step.pop("total")
    return {"wall_s": wall, "run_s": m["seconds"], "verdict": m.get("verdict"), "ms_per_decode_step": per_step,
            "prefill_s": sum(v for k, v in m["seconds_by_part"].items() if k.startswith("prefill")),
            "decode_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="more `fidelity run` arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):  # configurations interleaved: drift on a shared machine hits both alike
            for block in args.blocks:
                r = one_run(block, args, Path(tmp), f"b{block}-{k}")
                rows.append({"oracle_block": block, **r})
                print(f"block {block} repeat {k}: wall {r['wall_s']:.1f} s, judged step "
                      f"{r['ms_per_decode_step']['judged step']:.1f} ms", flush=True)
    summary = []
    for block in args.blocks:
        mine = [r for r in rows if r["oracle_block"] == block]
        med = {p: statistics.median(r["ms_per_decode_step"][p] for r in mine) for p in (*PARTS, "judged step")}
        summary.append({"oracle_block": block, "median_wall_s": statistics.median(r["wall_s"] for r in mine),
                        "median_ms_per_decode_step": med})
    (out / "judged_step.json").write_text(json.dumps({"device": args.device, "threads": args.threads,
                                                      "decode": args.decode, "runs": rows, "summary": summary},
                                                     indent=1))
    head = "| --oracle-block | wall s | " + " | ".join(f"{p} ms" for p in (*PARTS, "judged step")) + " |"
    lines = [head, "|" + "---|" * (len(PARTS) + 3)]
    for s in summary:
        cells = " | ".join(f"{s['median_ms_per_decode_step'][p]:.1f}" for p in (*PARTS, "judged step"))
        lines.append(f"| {s['oracle_block']} | {s['median_wall_s']:.1f} | {cells} |")
    (out / "judged_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
