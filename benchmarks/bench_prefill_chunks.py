"""What a prompt prefilled in short chunks costs, by part, on this tree and on others' packages, alternating: the
trained default, ``--prompt-len 300 --prefill-chunk C --decode 4`` (the catalogue's ``chunks / chunk C`` runs),
three modes, each run in a fresh process.

    python benchmarks/bench_prefill_chunks.py --out DIR [--chunks 5 7] [--repeats 2] [--trees . build/old]

A tree other than ``.`` is a folder holding another commit's ``fidelity``, ``oracles`` and ``probes`` (``git archive
REV fidelity oracles probes | tar -x -C DIR``); the run starts there, so that its packages are imported. Per run:
the wall time of the command and, per prefill call (ms), the decoder, each oracle mode and the probes (the
manifest's ``seconds_by_part``). Writes ``prefill_chunks.json`` and ``prefill_chunks.md`` (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_judged_step import PARTS, fresh_run, ms_per_call

PROMPT = 300


def one_run(tree: Path, chunk: int, out: Path, run_id: str, threads: int) -> dict:
    wall, m = fresh_run(["--threads", str(threads), "--prompt-len", str(PROMPT), "--prefill-chunk", str(chunk),
                         "--decode", "4"], out, run_id, cwd=tree)
    calls = -(-PROMPT // chunk)
    per_call = ms_per_call(m, "prefill", calls)
    per_call["prefill call"] = per_call.pop("total")
    return {"wall_s": wall, "run_s": m["seconds"], "verdict": m.get("verdict"), "prefill_calls": calls,
            "ms_per_prefill_call": per_call}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunks", type=int, nargs="+", default=[5, 7])
    ap.add_argument("--trees", nargs="+", default=["."])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):  # trees alternate: drift on a shared machine hits both alike
            for chunk in args.chunks:
                for t, tree in enumerate(args.trees):
                    r = one_run(Path(tree).resolve(), chunk, Path(tmp), f"t{t}-c{chunk}-{k}", args.threads)
                    rows.append({"tree": tree, "chunk": chunk, **r})
                    print(f"{tree} chunk {chunk} repeat {k}: wall {r['wall_s']:.1f} s, "
                          f"{r['ms_per_prefill_call']['prefill call']:.1f} ms a prefill call", flush=True)
    cols = (*PARTS, "prefill call")
    lines = ["| tree | chunk | wall s | " + " | ".join(f"{p} ms" for p in cols) + " |", "|" + "---|" * (len(cols) + 3)]
    for chunk in args.chunks:
        for tree in args.trees:
            mine = [r for r in rows if r["tree"] == tree and r["chunk"] == chunk]
            med = [statistics.median(r["ms_per_prefill_call"][p] for r in mine) for p in cols]
            wall = statistics.median(r["wall_s"] for r in mine)
            lines.append(f"| {tree} | {chunk} | {wall:.1f} | " + " | ".join(f"{v:.1f}" for v in med) + " |")
    (out / "prefill_chunks.json").write_text(json.dumps({"threads": args.threads, "runs": rows}, indent=1))
    (out / "prefill_chunks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
