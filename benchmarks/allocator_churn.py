"""What each production decode step does to the allocator, eager vs graph decode, over many steps.

    python benchmarks/allocator_churn.py --out DIR [--steps 1000] [--prompt 300] [--device cuda]
                                         [--checkpoint DIR] [--profile reference]

The default checkpoint (or ``--checkpoint``), a ``--prompt``-token prefill, then ``--steps`` greedy decode steps
on each session kind: ``eager`` (``ProductionSession``) and ``graph`` (``GraphDecodeSession``: CUDA-graph replays
on CUDA, fixed shapes on the CPU). Per step, around the step call only (``probes.memory``): allocator block
requests, releases and device mallocs (CUDA), the bytes kept beyond the returned logits, the reserved bytes;
and the tensor bytes the session holds. Steps after the first ``WARMUP_DECODE_CALLS`` are summarised against the
gates of ``fidelity run`` (no device malloc; reserved, retained and held growth within the band). Writes
DIR/allocator_churn.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import fidelity
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.graph_decode import GraphDecodeSession
from fidelity.harness.thresholds import MEMORY_GROWTH_BAND
from fidelity.model.default import prompt_for
from fidelity.model.load import load_checkpoint
from probes.memory import WARMUP_DECODE_CALLS, held_bytes, measured_call


def measure(session, prompt: torch.Tensor, steps: int, device: str) -> dict:
    """Per-step allocator deltas of ``steps`` greedy decode steps after prefilling ``prompt``."""
    logits = session.prefill(prompt.to(device))[-1]
    per_step, t0 = [], time.perf_counter()
    for _ in range(steps):
        token = int(logits.argmax())
        logits, delta = measured_call(lambda: session.step(token), device)  # noqa: B023 (called at once)
        delta["held_bytes"] = held_bytes(session)
        per_step.append(delta)
    seconds = time.perf_counter() - t0
    gated = per_step[WARMUP_DECODE_CALLS:]
    out = {"steps": steps, "seconds": seconds, "warmup_calls": WARMUP_DECODE_CALLS,
           "held_growth": gated[-1]["held_bytes"] - per_step[WARMUP_DECODE_CALLS - 1]["held_bytes"]}
    for key in ("alloc_calls", "free_calls", "device_mallocs"):
        if key in gated[0]:
            values = [d[key] for d in gated]
            out[key] = {"min": min(values), "mean": statistics.fmean(values), "max": max(values),
                        "first_steps": [d[key] for d in per_step[:WARMUP_DECODE_CALLS + 2]]}
    for key in ("reserved_delta", "retained_delta", "host_retained_delta"):
        if key in gated[0]:
            out[key.replace("_delta", "_growth")] = sum(d[key] for d in gated)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--device", default="cuda")
    p.add_argument("--checkpoint", default=str(fidelity.default_checkpoint()))
    p.add_argument("--profile", default="reference")
    a = p.parse_args()
    ckpt = load_checkpoint(a.checkpoint)
    prompt = prompt_for(ckpt, a.prompt, 0)
    model = ProductionModel(ckpt, a.profile, a.prompt + a.steps, a.device)
    result = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "command": " ".join(sys.argv), "band_bytes": MEMORY_GROWTH_BAND,
              "sessions": {}}
    for kind, make in (("eager", model.session), ("graph", lambda: GraphDecodeSession(model))):
        result["sessions"][kind] = measure(make(), prompt, a.steps, a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allocator_churn.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = ["| session | steps | alloc calls / step (min, mean, max) | device mallocs after warm-up | reserved growth "
             "| retained growth | held growth |", "|---|---:|---|---:|---:|---:|---:|"]
    for kind, r in result["sessions"].items():
        calls = r.get("alloc_calls")
        mallocs = r.get("device_mallocs")
        lines.append(
            f"| {kind} | {r['steps']} | " + (f"{calls['min']}, {calls['mean']:.1f}, {calls['max']}" if calls else "-")
            + f" | {mallocs['max'] if mallocs else '-'} | {r.get('reserved_growth', '-')} | "
            f"{r.get('retained_growth', r.get('host_retained_growth', '-'))} | {r['held_growth']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
