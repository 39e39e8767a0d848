"""Where one decode step of a V4-Flash CSA layer spends its GPU time, kernel by kernel, each kernel attributed to the
decoder line that launched it, beside the bytes each part must read in the release formats (its memory floor).

    python benchmarks/layer_step_breakdown.py --out DIR [--context 131072] [--steps 4] [--profile reference]
                                              [--depth 3] [--emulate OP,...]

The layer, its caches and its position are ``bench_layer_decode.py``'s (Flash widths, 16 routed experts stored,
6 run per token). The graph decode step runs twice: once launch by launch (``GraphDecodeSession`` with graphs off:
the same kernels in the same order) under ``torch.profiler`` with Python stacks, so each kernel is joined to its
launch and the launch to the decoder frames open around it (``kernel_sites.py``: torch's event tree does not link
Triton's ``cuLaunchKernelEx`` launches to ``record_function`` ranges, the trace's timestamps do); then as CUDA-graph
replays, profiled for the kernels' durations in the replay (matched one to one with the first run's kernels by
order and name; the first run's durations are used where they do not match, and the JSON says which). Reported:
the graphed step by CUDA events (median of 12), the replay's span, kernels and GPU busy time per step, and a table
of launch sites (the innermost ``--depth`` decoder frames) by device time. The floor of a part is the bytes it
must read at the copy bandwidth measured in the same call: its weights as the release stores them (FP8 with
128x128 scales, FP4 with 1x32 scales, bf16, fp32), the KV rows it attends (window + top-k, 584 B per row in the FP8
layout) and the indexer keys at the context (FP4 + scales). Writes DIR/layer_breakdown.json (with every kernel of
one step: name, device us, launch frames), DIR/trace_eager.json and DIR/trace_graph.json (chrome traces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_sites  # noqa: E402
from bench_layer_decode import WARMUP, filled_session, layer_config  # noqa: E402

from fidelity.decoders.production import ProductionModel, registry, sublayer  # noqa: E402
from fidelity.decoders.production import model as production_model  # noqa: E402
from fidelity.decoders.production.attention import Attention  # noqa: E402
from fidelity.decoders.production.compressor import Compressor  # noqa: E402
from fidelity.decoders.production.graph_decode import GraphDecode  # noqa: E402
from fidelity.decoders.production.indexer import Indexer  # noqa: E402
from fidelity.decoders.production.layer import Layer  # noqa: E402
from fidelity.decoders.production.mhc import Mhc  # noqa: E402
from fidelity.decoders.production.model import ProductionSession  # noqa: E402
from fidelity.decoders.production.moe import MoE  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402
from fidelity.model.weights import expected_tensors, stored_nbytes  # noqa: E402

PARTS = ("block", "mhc_pre", "norm", "attention", "kv_path", "index_decode", "index_query", "compress",
         "attend_decode", "moe", "route", "shared_expert")
# part -> the methods of the layer objects (and of the graph decode policy) that run it
METHODS = {"block": ((Layer, "__call__"),), "mhc_pre": ((Mhc, "pre"),), "norm": ((sublayer.SubLayer, "norm"),),
           "attention": ((Attention, "__call__"),), "kv_path": ((Attention, "kv_path"),),
           "index_decode": ((Indexer, "decode"), (GraphDecode, "index_picks")), "index_query": ((Indexer, "query"),),
           "compress": ((Compressor, "__call__"),), "attend_decode": ((Attention, "decode"), (GraphDecode, "attend")),
           "moe": ((MoE, "__call__"),), "route": ((MoE, "route"),), "shared_expert": ((MoE, "shared_expert"),),
           "index_prefill": ((Indexer, "prefill"),), "attend_prefill": ((Attention, "prefill"),),
           "head": ((ProductionSession, "head"),)}
FP8_KV_ROW = 584  # bytes per KV row in the FP8 cache layout
# weight groups of a layer: name fragment -> part that reads it
WEIGHT_PARTS = (("attn.indexer.", "index_decode"), ("attn.compressor.", "compress"), ("attn.", "attention"),
                ("ffn.shared_experts.", "shared_expert"), ("ffn.gate.", "route"), ("ffn.experts.", "moe"),
                ("hc_", "mhc_pre"), ("_norm.", "norm"))


def _ranged(name: str, fn):
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return call


def instrument(parts: tuple[str, ...] = PARTS) -> None:
    """Profiler ranges around the layer objects' methods of ``parts`` (``part:<part>``, ``METHODS``) and every
    registered op (``op:<name>``)."""
    for part in parts:
        for owner, method in METHODS[part]:
            setattr(owner, method, _ranged(f"part:{part}", getattr(owner, method)))
    implementation = registry.implementation

    def ranged_implementation(name, device=None):
        return _ranged(f"op:{name}", implementation(name, device))

    sublayer.implementation = ranged_implementation  # the name the layer objects' ``op`` looks up
    production_model.implementation = ranged_implementation  # the session's (the head)


def _kernel_us(event) -> float:
    """Device microseconds of the kernels launched inside the CPU range ``event`` (its children included)."""
    return sum(k.duration for k in event.kernels) + sum(_kernel_us(c) for c in event.cpu_children)


def range_times(events, steps: int) -> tuple[dict[str, dict[str, float]], float]:
    """({range: {us_per_step, calls_per_step}}, kernel us per step) from the profiler's event tree: a range's time
    is that of the kernels launched inside it, whatever the GPU did in between (the GPU-side annotation spans
    also cover idle time behind host syncs, so they are not used)."""
    ranges: dict[str, dict[str, float]] = {}
    for e in events:
        if e.name.startswith(("part:", "op:")) and e.device_type == torch.autograd.DeviceType.CPU:
            r = ranges.setdefault(e.name, {"us_per_step": 0.0, "calls_per_step": 0.0, "host_us_per_step": 0.0})
            r["us_per_step"] += _kernel_us(e) / steps
            r["host_us_per_step"] += e.cpu_time_total / steps
            r["calls_per_step"] += 1 / steps
    total = sum(k.duration for e in events for k in e.kernels) / steps
    return ranges, total


def floor_bytes(cfg, context: int) -> dict[str, float]:
    """Bytes each part must read for one decode token in the release formats (routed experts: the 6 a token
    runs; the attention: window + top-k KV rows; the indexer: every key at ``context``)."""
    out: dict[str, float] = defaultdict(float)
    per_expert = 0.0
    for name, spec in expected_tensors(cfg).items():
        if not name.startswith("layers.0."):
            continue
        size = stored_nbytes(spec)
        part = next((p for frag, p in WEIGHT_PARTS if frag in name), "other")
        if part == "moe":
            per_expert += size / cfg.n_routed_experts
        else:
            out[part] += size
    out["moe"] = per_expert * cfg.n_activated_experts
    out["attend_decode"] = (cfg.window_size + cfg.index_topk) * FP8_KV_ROW
    out["index_decode"] += context // 4 * cfg.index_head_dim * (0.5 + 1 / 32)
    return dict(out)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (median of 10)."""
    a = torch.empty(1 << 28, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() * 4 / sorted(times)[len(times) // 2]


def _profiled(session, steps: int, stack: bool, trace: Path) -> list[dict]:
    """Kernels of ``steps`` decode steps in start order, attributed to their launch sites (``kernel_sites``)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        for tok in range(steps):
            session.step(tok + 10)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    return kernel_sites.attributed(kernel_sites.load_trace(trace))


def graphed_step_us(session, steps: int) -> float:
    """Median wall time of a graph replay step (CUDA events around each step)."""
    times = []
    for tok in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        session.step(tok + 20)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", default="reference")
    ap.add_argument("--depth", type=int, default=3, help="frames per launch site")
    ap.add_argument("--emulate", default="", help="ops to run on their emulation (comma-separated)")
    a = ap.parse_args()
    with registry.forcing(dict.fromkeys(filter(None, a.emulate.split(",")), "cpu")):
        return _breakdown(a)


def _breakdown(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = layer_config(a.context, "flash")
    model = ProductionModel(synthesize(cfg, seed=0, lazy=True), a.profile, max_context=a.context + 256, device="cuda")
    for name in model.ckpt.names():  # every weight generated and dequantized before the profile, not in it
        model.w(name)
    eager = filled_session(model, a.context, seed=0, graph=True)
    eager.decode.graphs = False  # the graph step's kernels, launched one by one so that each has its Python stack
    for tok in range(WARMUP):
        eager.step(tok)
    sites = _profiled(eager, a.steps, True, out / "trace_eager.json")
    graph = filled_session(model, a.context, seed=0, graph=True)
    for tok in range(WARMUP):
        graph.step(tok)
    wall = graphed_step_us(graph, 12)
    replayed = _profiled(graph, a.steps, False, out / "trace_graph.json")
    matched = len(replayed) == len(sites)
    for k, g in zip(sites, replayed, strict=False):
        k["graph_us"] = g["us"] if matched and k["name"] == g["name"] else None
    matched = matched and all(k["graph_us"] is not None for k in sites)
    timed = [{**k, "us": k["graph_us"]} for k in sites] if matched else sites
    span = (replayed[-1]["ts"] + replayed[-1]["us"] - replayed[0]["ts"]) / a.steps if replayed else 0.0
    bandwidth = copy_bandwidth("cuda")
    floors = floor_bytes(cfg, a.context)
    rows = kernel_sites.by_site(timed, a.steps, a.depth)
    busy = sum(k["us"] for k in timed) / a.steps
    result = {"config": {"context": a.context, "profile": a.profile, "emulated": a.emulate, "steps": a.steps,
                         "dim": cfg.dim, "routed_experts_stored": cfg.n_routed_experts,
                         "activated": cfg.n_activated_experts},
              "device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bandwidth,
              "graphed_step_us": wall, "graph_span_us_per_step": span, "kernels_per_step": len(sites) / a.steps,
              "times_from": "graph replay" if matched else "eager launches (graph kernels did not match one to one)",
              "gpu_busy_us_per_step": busy, "sites": rows, "floor_bytes": floors,
              "floor_us": {k: v / bandwidth * 1e6 for k, v in floors.items()},
              "kernels": [{k: v for k, v in r.items() if k != "ts"} for r in timed[: len(timed) // a.steps]]}
    (out / "layer_breakdown.json").write_text(json.dumps(result, indent=1))
    print(f"graphed step {wall:.1f} us (replay span {span:.1f} us), {len(sites) / a.steps:.0f} kernels per step, "
          f"GPU busy {busy:.1f} us ({result['times_from']}); copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor of "
          f"the step {sum(floors.values()) / bandwidth * 1e6:.1f} us ({sum(floors.values()) / 1e6:.1f} MB)")
    print("| launch site | us / step | kernels / step | kernels |\n|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['site']} | {r['us_per_step']:.1f} | {r['calls_per_step']:.0f} | {', '.join(r['kernels'][:3])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
