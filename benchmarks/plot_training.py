"""Loss curve of the default checkpoint's training: one or more ``training.json`` logs (stages run one after
the other, each continuing from the previous checkpoint) on one tokens-seen axis.

    python benchmarks/plot_training.py STAGE1/training.json STAGE2/training.json --out loss.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    offset = 0.0
    for k, path in enumerate(a.logs):
        log = json.loads(open(path).read())
        per_step = log["settings"]["seq_len"] / 1e6
        steps = log["steps"]
        x = [offset + r["step"] * per_step for r in steps]
        lm = [r["lm"] for r in steps]
        smooth = [sum(lm[max(0, i - 9) : i + 1]) / len(lm[max(0, i - 9) : i + 1]) for i in range(len(lm))]
        ax.plot(x, lm, color=f"C{k}", alpha=0.25, lw=0.8)
        ax.plot(x, smooth, color=f"C{k}", lw=1.5, label=f"stage {k + 1}: training loss (10-point mean)")
        ev = log["evals"]
        ax.plot([offset + e["step"] * per_step for e in ev], [e["held_out_nll"] for e in ev], "o", color=f"C{k}",
                ms=4, label=f"stage {k + 1}: held-out NLL, first {ev[0]['docs'] if ev else 0} documents")
        offset += log["settings"]["steps"] * per_step
        final = log["final"]["held_out_nll"]
        ax.plot([offset], [final], "*", color=f"C{k}", ms=11,
                label=f"stage {k + 1}: held-out NLL, all {log['final']['held_out_docs']} documents ({final:.3f})")
    ax.axhline(2.5, color="k", ls=":", lw=1, label="target 2.5 nats/token")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("nats / token")
    ax.set_ylim(0, 9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
