"""A/B of the radix top-k (calls 2 and 3 of this folder's README), from the repository root on a CUDA machine:

    git show cab4d5e:fidelity/production/kernels/radix_topk.py > <this folder>/radix_v0.py
    OUT=<dir> python3 <this folder>/ab_topk.py   (with v1's module, a variant not kept, as radix_v1.py beside it)

v0: commit cab4d5e (tie ranks and pick slots by two scans per chunk). v1 (never committed):
only the chunk where the needed ties run out ranks its ties, one atomic slot claim per pick; its ``global_hist``
option builds the first pass's histogram with one global atomic per entry. v2: the working tree's ``radix_topk``
(v0's one atomic per chunk, v1's boundary-only tie ranking). Call 3 ran this file; call 2 ran it with
``v1.radix_topk(s, k, {"global_hist": True})`` in place of v2 (also in the profile), without the k > 512 cases.
Every variant's picks are compared with the CPU's stable sort before timing (CUDA graph replays,
``bench_kernels.time_fn``); then a per-kernel profile.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import bench_kernels as bk  # noqa: E402

HERE = Path(__file__).resolve().parent
from fidelity.production.kernels import radix_topk as v2  # noqa: E402


def _load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


v0, v1 = _load("radix_v0"), _load("radix_v1")
OUT = os.environ["OUT"]
res = []
cases = [(1, 32768, 512, False), (1, 262144, 512, False), (1, 262144, 512, True), (64, 8192, 512, False),
         (64, 8192, 512, True), (512, 32768, 512, False), (512, 32768, 512, True), (512, 262144, 512, False),
         (1, 262144, 1024, False), (1, 262144, 2048, False), (1, 262144, 4096, False)]
for rows, n, k, ties in cases:
    g = torch.Generator(device="cuda").manual_seed(5)
    sets = []
    for _ in range(bk._n_sets(rows * n * 2, hi=48)):
        x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        if ties:
            x[torch.rand(rows, n, device="cuda", generator=g) < 0.8] = 0.0
            x[torch.rand(rows, n, device="cuda", generator=g) < 0.4] = -0.0
        x[:, n - n // 8:] = float("-inf")
        sets.append((x,))
    ref = sets[0][0].float().cpu().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    variants = {"v0": lambda s, k=k: v0.radix_topk(s, k), "v1": lambda s, k=k: v1.radix_topk(s, k),
                "v2": lambda s, k=k: v2.radix_topk(s, k)}
    if k > 512:
        variants = {f"v2 sort_warps {w}": (lambda s, w=w, k=k: v2.radix_topk(s, k, {"sort_warps": w}))
                    for w in (2, 4, 8, 16)}
    for name, fn in variants.items():
        ok = bool(torch.equal(fn(sets[0][0]).cpu(), ref))
        t = bk.time_fn(fn, sets)
        res.append({"rows": rows, "n": n, "k": k, "ties": ties, "variant": name, "equal": ok, "us": t["us"],
                    "eager_us": t["eager_us"]})
        print(f"{rows:4d} x {n:6d} ties={ties!s:5s} {name:16s} equal={ok} {t['us']:9.2f} us", flush=True)
    del sets
    torch.cuda.empty_cache()
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for rows, n in ((1, 262144), (512, 32768)):
    x = torch.randn(rows, n, device="cuda").bfloat16()
    for _ in range(3):
        v2.radix_topk(x, 512)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            v2.radix_topk(x, 512)
        torch.cuda.synchronize()
    print(f"profile {rows} x {n}:")
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0):
            print(f"   {e.key[:60]:60s} {e.device_time_total / 10:9.2f} us/call x{e.count // 10}")
json.dump(res, open(f"{OUT}/ab_topk_v2.json", "w"), indent=1)
