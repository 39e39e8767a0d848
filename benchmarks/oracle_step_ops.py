"""Where a free-mode oracle decode step's ops come from: the aten ops of one ``OracleSession.forward`` of one token,
counted by the ``oracles/`` function that issued them (the innermost frame in ``oracles/``).

    python benchmarks/oracle_step_ops.py --out DIR [--prompt 1221] [--dtype fp32]

The trained default checkpoint, its prompt prefilled, then one decode token counted. Each op is a Python dispatch on
the CPU and a kernel launch on a GPU, so a step costs about its op count times a few microseconds on either. Writes
``oracle_step_ops.json`` and ``oracle_step_ops.md``.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fidelity.api import plan_checkpoint
from fidelity.harness.oracle_run import ORACLE_DTYPES
from oracles import OracleModel


class OpsByFunction(TorchDispatchMode):
    """Counts aten ops by the innermost ``oracles/`` frame on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack(limit=16) if "/oracles/" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "other"
        self.counts[where] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=1221)
    ap.add_argument("--dtype", choices=sorted(ORACLE_DTYPES), default="fp32")
    args = ap.parse_args()
    plan = plan_checkpoint(None)
    ids = plan.prompt(args.prompt + 1)
    session = OracleModel(plan.open(), ORACLE_DTYPES[args.dtype]).session()
    with torch.no_grad():
        session.forward(ids[:-1])
        with OpsByFunction() as ops:
            session.forward(ids[-1:])
    total = sum(ops.counts.values())
    rows = ops.counts.most_common()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle_step_ops.json").write_text(json.dumps({"prompt": args.prompt, "dtype": args.dtype, "total": total,
                                                           "by_function": dict(rows)}, indent=1))
    lines = [f"One free-mode oracle decode step after a {args.prompt}-token prompt ({args.dtype}): {total} aten ops.",
             "", "| oracles function | ops | share |", "|---|---:|---:|"]
    lines += [f"| `{k}` | {v} | {v / total:.1%} |" for k, v in rows]
    (out / "oracle_step_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:14]))


if __name__ == "__main__":
    main()
