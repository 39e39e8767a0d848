"""What bounds a judged decode step: the torch ops each part issues per decode step, beside the time it takes.

    python benchmarks/judged_step_ops.py --out DIR [--decode 16] [--blocks 1 64] [--device cpu]

Runs the default ``fidelity run`` in process (the trained default checkpoint, its prompt, three modes) twice per
``--oracle-block``: once under a ``TorchDispatchMode`` that counts every aten op by the run's timed part
(``Runner._timed``: decoder, oracle free / layer / op, probes), once plain for the time by part. A part whose time
is its ops times a few microseconds each is bound by issuing ops (Python and dispatch on the CPU, launches on a
GPU), not by arithmetic. Writes ``judged_step_ops.json`` and ``judged_step_ops.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fidelity
from fidelity.api import plan_checkpoint
from fidelity.harness import runner as runner_module

PARTS = ("decoder", "oracle free", "oracle layer", "oracle op", "probes")


class OpCounter(TorchDispatchMode):
    """Counts aten ops under the part named in ``part``."""

    def __init__(self) -> None:
        super().__init__()
        self.part = "other"
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.part] += 1
        return func(*args, **(kwargs or {}))


def run_once(block: int, decode: int, device: str, out: Path, counter: OpCounter | None) -> dict:
    original = runner_module.Runner._timed

    @contextmanager
    def timed(self, phase, part):
        if counter is None:
            with original(self, phase, part):
                yield
            return
        before, counter.part = counter.part, f"{phase} {part}"
        try:
            yield
        finally:
            counter.part = before

    runner_module.Runner._timed = timed
    try:
        plan = plan_checkpoint(None)
        if counter is None:
            res = fidelity.run("production", plan, decode_steps=decode, out=out, run_id=f"t{block}", device=device,
                               oracle_block=block, overwrite=True)
        else:
            with counter:
                res = fidelity.run("production", plan, decode_steps=decode, out=out, run_id=f"c{block}",
                                   device=device, oracle_block=block, overwrite=True)
    finally:
        runner_module.Runner._timed = original
    return res.manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for block in args.blocks:
            counter = OpCounter()
            m = run_once(block, args.decode, args.device, Path(tmp), counter)
            steps = max(1, m["decode_steps"])
            timed = run_once(block, args.decode, args.device, Path(tmp), None)["seconds_by_part"]
            for part in PARTS:
                ops = counter.counts[f"decode {part}"] / steps
                ms = 1000 * timed.get(f"decode {part}", 0.0) / steps
                rows.append({"oracle_block": block, "part": part, "ops_per_step": ops, "ms_per_step": ms,
                             "us_per_op": 1000 * ms / ops if ops else None})
                print(rows[-1], flush=True)
    (out / "judged_step_ops.json").write_text(json.dumps({"device": args.device, "decode": args.decode,
                                                          "rows": rows}, indent=1))
    lines = ["| --oracle-block | part | aten ops / step | ms / step | us / op |", "|---|---|---|---|---|"]
    for r in rows:
        per_op = f"{r['us_per_op']:.1f}" if r["us_per_op"] else "-"
        lines.append(f"| {r['oracle_block']} | {r['part']} | {r['ops_per_step']:.0f} | {r['ms_per_step']:.1f} | "
                     f"{per_op} |")
    (out / "judged_step_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
