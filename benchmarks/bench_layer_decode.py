"""One decode step of a V4-Flash-shaped CSA layer at a long context: the production model with the Triton kernels
vs the same model with every op on its torch emulation, both on the GPU, from identical cache states.

    python benchmarks/bench_layer_decode.py --out DIR [--context 131072] [--steps 12] [--device cuda]
                                            [--profile reference] [--paths triton,triton+graph]

The layer has Flash widths (dim 4096, 64 heads x 512, q/o LoRA 1024, 8 output groups, window 128, CSA ratio 4
with a 64 x 128 indexer and top-512, mHC 4 streams, 6 routed + 1 shared experts of 2048) and the reference
profile (``--profile fp4-indexer-packed``: the indexer keys stay packed FP4 and are scored by
``index_scores_fp4``). What is smaller than a release checkpoint, and does not change the per-token work of a
decode step: 16 routed experts instead of 256 (a token still runs 6), a 1024-token vocabulary (the LM head is not
part of a layer), no hash layer. The caches are filled with random rows in their storage formats (window ring buffer,
compressed KV, FP4-simulated indexer keys) and the session is placed at ``--context`` tokens; each timed step
then writes, compresses (every 4th step), scores all compressed keys, selects, gathers and attends.

Four paths: ``cpu`` (every op on its torch emulation) and ``triton`` (the kernels) run the eager
``ProductionSession``, whose step issues host syncs of its own (expert routing, sizes that follow the position);
``triton+graph`` and ``cpu+graph`` run ``GraphDecodeSession``: the same numerics with fixed shapes and the
position on the device, captured once in a CUDA graph and replayed (the first warm-up step runs eagerly, then
the capture). A path whose capture fails is recorded with its error. Wall time per step
(``torch.cuda.synchronize`` before and after), median of ``--steps``; every path is checked against the
emulation (logits cosine per step) and the graph path against the eager kernels (fraction of equal logits). A
torch.profiler pass over each path counts kernel (and graph) launches and lists where host and GPU time go.
Writes DIR/bench_layer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import ProductionModel, ops, registry  # noqa: E402
from fidelity.decoders.production.graph_decode import GraphDecodeSession  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402


def layer_config(context: int, preset: str) -> ModelConfig:
    cfg = ModelConfig.preset(preset)
    return cfg.replace(n_layers=1, n_hash_layers=0, n_mtp_layers=0, compress_ratios=(4,),
                       vocab_size=1024, n_routed_experts=min(16, cfg.n_routed_experts),
                       max_seq_len=context + 256)


def filled_session(model: ProductionModel, context: int, seed: int, graph: bool = False):
    """A session at position ``context`` whose caches hold random rows in their storage formats (``graph``: a
    ``GraphDecodeSession``, CUDA-graph replays on CUDA)."""
    s = GraphDecodeSession(model) if graph else model.session()
    cfg, dev = model.cfg, model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for cache in s.layers:
        n_comp = context // 4
        rows = torch.randn(cache.window + n_comp, cfg.head_dim, device=dev, generator=g).to(torch.bfloat16)
        cache.kv.write(slice(0, len(rows)), ops.kv_round(rows, cfg.rope_head_dim, model.profile.kv_nope))
        keys = torch.randn(n_comp, cfg.index_head_dim, device=dev, generator=g)
        cache.keys.write(slice(0, n_comp), ops.indexer_round(keys, model.profile.indexer_qk, rotate=True)
                         .to(torch.bfloat16))
        for carry in (cache.carry, cache.index_carry):
            carry.kv.normal_(generator=g)
            carry.score.normal_(generator=g)
    s.pos = context
    s.calls = 1
    return s


WARMUP = 4  # steps before timing: compilation, first weight loads, one full compression cycle


def run(model, context, steps, impl, ops_with_kernels, seed=0, graph=False):
    with registry.forcing(dict.fromkeys(ops_with_kernels, impl)):
        return _timed_steps(model, context, steps, seed, graph)


def _timed_steps(model, context, steps, seed, graph):
    s = filled_session(model, context, seed, graph)
    tokens = torch.randint(0, model.cfg.vocab_size, (steps + WARMUP,),
                           generator=torch.Generator().manual_seed(seed))
    times, logits = [], []
    for i, tok in enumerate(tokens.tolist()):
        torch.cuda.synchronize() if model.device.type == "cuda" else None
        t0 = time.perf_counter()
        out = s.step(tok)
        torch.cuda.synchronize() if model.device.type == "cuda" else None
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e6)
            logits.append(out.float().cpu())
    return times, torch.stack(logits), registry.implementations_used(), getattr(s, "replays", 0)


def profile_path(model, context, ops_with_kernels, impl, steps=4, graph=False) -> dict:
    """torch.profiler over ``steps`` decode steps: kernel launches per step, GPU time per step, and the ops with
    the most host (self CPU) and device time."""
    from torch.profiler import ProfilerActivity, profile

    with registry.forcing(dict.fromkeys(ops_with_kernels, impl)):
        s = filled_session(model, context, 1, graph)
        for tok in range(WARMUP):
            s.step(tok)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for tok in range(steps):
                s.step(tok + 10)
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC", "cudaGraphLaunch"))

    def dev(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    gpu = sorted((e for e in events if dev(e) > 0), key=lambda e: -dev(e))
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)
    return {"launches_per_step": launches / steps,
            "gpu_busy_us_per_step": sum(dev(e) for e in events) / steps,
            "gpu_top": [{"name": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": dev(e) / steps}
                        for e in gpu[:15]],
            "cpu_top": [{"name": e.key[:90], "calls_per_step": e.count / steps,
                         "self_cpu_us_per_step": e.self_cpu_time_total / steps} for e in cpu[:15]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="reference")
    ap.add_argument("--paths", default="cpu,triton,triton+graph,cpu+graph",
                    help="comma-separated subset of the four paths to time (cpu = every op emulated)")
    a = ap.parse_args()
    cfg = layer_config(a.context, a.preset)
    t0 = time.time()
    model = ProductionModel(synthesize(cfg, seed=0, lazy=True), a.profile, max_context=a.context + 256,
                            device=a.device)
    ops_with_kernels = sorted(op for op, impls in registry.REGISTRY.items() if "triton" in impls)
    print(f"ops with kernels: {ops_with_kernels}", flush=True)
    result = {"config": {"preset": a.preset, "profile": a.profile, "context": a.context, "dim": cfg.dim,
                         "heads": cfg.n_heads, "routed_experts_stored": cfg.n_routed_experts,
                         "activated": cfg.n_activated_experts, "vocab": cfg.vocab_size},
              "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"}
    paths = {}
    variants = [("cpu", False), ("triton", False), ("triton", True), ("cpu", True)] if ops_with_kernels else \
        [("cpu", False)]
    wanted = set(a.paths.split(","))
    variants = [(impl, graph) for impl, graph in variants if impl + ("+graph" if graph else "") in wanted]
    for impl, graph in variants:
        name = impl + ("+graph" if graph else "")
        try:
            times, logits, used, replays = run(model, a.context, a.steps, impl, ops_with_kernels, graph=graph)
        except Exception as e:  # a graph capture that fails is a result to record, not a reason to lose the rest
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
            print(f"{name:12s}: FAILED {result[name]['error'][:300]}", flush=True)
            continue
        paths[name] = logits
        result[name] = {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times),
                        "steps_us": times, "implementations": used, "graph_replays": replays}
        print(f"{name:12s}: median {statistics.median(times):9.0f} us per decode step "
              f"(min {min(times):.0f}, max {max(times):.0f}, graph replays {replays})  [{time.time() - t0:.0f}s]",
              flush=True)
    for name in [n for n in paths if n != "cpu" and "cpu" in paths]:
        cos = torch.nn.functional.cosine_similarity(paths["cpu"].double(), paths[name].double(), dim=-1)
        result[name]["logits_cos_vs_emulation"] = cos.tolist()
        result[name]["speedup_vs_emulation"] = result["cpu"]["median_us"] / result[name]["median_us"]
        print(f"{name:12s}: {result[name]['speedup_vs_emulation']:.2f}x vs emulation; logits cos per step min "
              f"{cos.min():.6f}")
    if "triton" in paths and "triton+graph" in paths:
        same = paths["triton"] == paths["triton+graph"]
        result["triton+graph"]["logits_equal_frac_vs_triton_eager"] = same.float().mean().item()
        print(f"triton+graph logits equal to triton eager: {same.float().mean().item():.6f}")
    if "triton" in paths:
        result["speedup"] = result["triton"].get("speedup_vs_emulation")
        if a.device == "cuda":
            for name in [n for n in ("cpu", "triton", "triton+graph") if n in paths]:
                impl, graph = name.split("+")[0], name.endswith("+graph")
                p = result[name]["profile"] = profile_path(model, a.context, ops_with_kernels, impl, graph=graph)
                print(f"[{name}] launches/step {p['launches_per_step']:.0f}, GPU busy {p['gpu_busy_us_per_step']:.0f} "
                      "us/step; top host (self CPU) ops:")
                for r in p["cpu_top"][:10]:
                    print(f"   {r['self_cpu_us_per_step']:9.1f} us/step x{r['calls_per_step']:<6.0f} {r['name']}")
                print(f"[{name}] top GPU kernels:")
                for r in p["gpu_top"][:8]:
                    print(f"   {r['us_per_step']:9.1f} us/step x{r['calls_per_step']:<6.0f} {r['name']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_layer.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
