"""Where one prefill chunk of the production decoder spends its time: wall time, GPU busy time, device time per
session part and registered op, and the top kernels and host ops.

    python benchmarks/prefill_chunk_breakdown.py --out DIR [--preset flash --layers 4] [--context 16384]
        [--chunk 8192] [--profile reference]

The model is the preset's slice generated on the GPU (as ``fidelity run --preset flash --layers 4 --device cuda``
builds it). The decoder prefills ``--context`` tokens in ``--chunk``-token chunks unprofiled (which also generates
every weight it reads), then one more chunk under ``torch.profiler`` with ranges around the layer objects' parts
and the ops (``layer_step_breakdown.instrument``). No recorder: this is the decoder's own time, without the probes.
Writes DIR/prefill_breakdown.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from layer_step_breakdown import instrument, range_times  # noqa: E402

from fidelity.decoders.production import ProductionModel  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402

PREFILL_PARTS = ("block", "mhc_pre", "norm", "attention", "kv_path", "index_prefill", "index_query", "compress",
                 "attend_prefill", "moe", "route", "shared_expert", "head")


def top_table(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:n]
    return [{"name": e.key[:90], "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--profile", default="reference")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = False  # as a run sets it (oracle numerics)
    cfg = ModelConfig.preset(a.preset).first_layers(a.layers)
    model = ProductionModel(synthesize(cfg, seed=0, lazy=True, device=a.device), a.profile,
                            max_context=a.context + a.chunk + 64, device=a.device)
    ids = torch.randint(0, cfg.vocab_size, (a.context + a.chunk,), generator=torch.Generator().manual_seed(0))
    session = model.session()
    warm = []
    for s in range(0, a.context, a.chunk):
        t0 = time.perf_counter()
        session.prefill(ids[s : s + a.chunk])
        sync()
        warm.append(round(time.perf_counter() - t0, 3))
    instrument(PREFILL_PARTS)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        session.prefill(ids[a.context :])
        sync()
        wall = time.perf_counter() - t0
    ranges, kernels_us = range_times(prof.events(), 1)
    result = {"config": {"preset": a.preset, "layers": a.layers, "context": a.context, "chunk": a.chunk,
                         "profile": a.profile}, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "unprofiled_chunk_s": warm, "profiled_chunk_wall_s": wall, "gpu_busy_s": kernels_us / 1e6,
              "ranges_ms": {k: {"ms": v["us_per_step"] / 1e3, "host_ms": v["host_us_per_step"] / 1e3,
                                 "calls": v["calls_per_step"]} for k, v in ranges.items()},
              "top_device": top_table(prof, "self_device_time_total", 25),
              "top_cpu": top_table(prof, "self_cpu_time_total", 25)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_breakdown.json").write_text(json.dumps(result, indent=1))
    print(f"unprofiled chunks (s): {warm}; profiled chunk: wall {wall:.3f} s, GPU busy {kernels_us / 1e6:.3f} s")
    print("| range | device ms | host ms (inclusive) | calls |\n|---|---:|---:|---:|")
    for key, v in sorted(ranges.items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"| {key} | {v['us_per_step'] / 1e3:.1f} | {v['host_us_per_step'] / 1e3:.1f} "
              f"| {v['calls_per_step']:.0f} |")
    for title, rows in (("device", result["top_device"]), ("host", result["top_cpu"])):
        print(f"\ntop by self {title} time\n| op / kernel | calls | self device ms | self cpu ms |\n"
              "|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['name']} | {r['calls']} | {r['self_device_ms']:.1f} | {r['self_cpu_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
