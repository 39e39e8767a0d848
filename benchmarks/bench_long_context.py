"""Long-context fidelity runs: ``fidelity run`` at 8K / 128K / 1M tokens, each in a fresh process, with its wall
time, peak host memory, peak GPU memory and the values checked (from the run's manifest).

    python benchmarks/bench_long_context.py --out results/ --device cuda --contexts 8192 131072 1048576

Every run uses layer and op modes on ``--sample-queries`` prefill queries, the oracle on the run's device, prefill
chunks of ``--chunk`` tokens and ``--decode`` decode steps; the run directories stay under ``--out/runs``. Each row
prints the decoder's prefill seconds (``prefill_decoder_s``) and their mean per chunk (``decoder_s_per_chunk``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def one(context: int, args, out: Path) -> dict:
    run_id = f"{args.preset}-{context}"
    cmd = [sys.executable, "-m", "fidelity.cli", "run", "--preset", args.preset, "--prompt-len", str(context),
           "--decode", str(args.decode), "--mode", "layer", "--mode", "op", "--sample-queries", str(args.queries),
           "--prefill-chunk", str(args.chunk), "--device", args.device, "--out", str(out / "runs"), "--run-id", run_id,
           "--overwrite", *args.extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    (out / f"{run_id}.log").write_text(proc.stdout + proc.stderr[-4000:])
    row = {"preset": args.preset, "context": context, "rc": proc.returncode, "wall_s": round(wall, 1)}
    manifest_path = out / "runs" / run_id / "manifest.json"
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        peaks = m.get("memory_peaks", {})
        row.update(verdict="PASS" if m["verdict"]["passed"] else "FAIL", checked=m["verdict"]["checked"],
                   first_divergence=m["verdict"]["first_divergence"], run_s=m["seconds"],
                   host_peak_gib=round(max(p["host_rss_peak_bytes"] for p in peaks.values()) / 2**30, 2),
                   gpu_peak_gib=round(max(p.get("gpu_reserved_peak_bytes", 0) for p in peaks.values()) / 2**30, 2),
                   by_part=m.get("seconds_by_part"))
        chunks = -(-context // args.chunk)
        decoder = (m.get("seconds_by_part") or {}).get("prefill decoder")
        if decoder is not None:  # the decoder's own prefill time (no probes, no oracle), per chunk
            row.update(prefill_decoder_s=round(decoder, 1), decoder_s_per_chunk=round(decoder / chunks, 3))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072, 1048576])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("extra", nargs="*", help="more `fidelity run` arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for context in args.contexts:
        rows.append(one(context, args, out))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "by_part"}), flush=True)
        (out / "bench_long_context.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
