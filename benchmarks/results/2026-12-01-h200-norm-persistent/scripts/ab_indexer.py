"""Indexer FP8-MMA path A/B runs of the fifth 2026-12-01 session (calls 6 and 7 of this folder's README).

``rotation`` (call 6): the kernel before the session ("old") vs the working tree ("new"), timed with the set
rotation the benchmark used then (sets sized for bf16 keys) and with >= 3x L2 of FP4 key bytes.
``packed`` (call 7): old, new, and new with the packed bf16x2 epilogue in four launch variants; bit equality.

Run from the repo root on the GPU machine: ``git show b5a9656:fidelity/production/kernels/indexer.py >
devscratch/indexer_head.py; OUT=dir PYTHONPATH=. python3 <this file> rotation|packed``.
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "devscratch")
import bench_kernels as bk  # noqa: E402
import indexer_head as old  # noqa: E402
from fidelity.formats import quantize_fp4  # noqa: E402
from fidelity.production import ops  # noqa: E402
from fidelity.production.kernels import indexer as new  # noqa: E402

H, D = 64, 128


def make_sets(e: int, n: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(2)
    sets = []
    for _ in range(n):
        q = ops.indexer_round(torch.randn(1, H, D, device="cuda", generator=g), "fp4", rotate=True)
        packed, sc = quantize_fp4(torch.randn(e, D, device="cuda", generator=g), 32)
        w = (torch.randn(1, H, device="cuda", generator=g) * (D**-0.5 * H**-0.5)).to(torch.bfloat16)
        sets.append((q.to(torch.bfloat16), packed, sc, w))
    return sets


def timer(mod, cfg=None):
    def f(*xs):
        return mod.index_scores_fp4(*xs, mma="fp8", config=cfg)
    return f


def rotation(e: int) -> dict:
    n_bench, n_proper = bk._n_sets(e * 256, hi=32), max(3, math.ceil(3 * 60e6 / (e * 68)))
    sets = make_sets(e, max(n_bench, n_proper))
    a, b = timer(old)(*sets[0]), timer(new)(*sets[0])
    r = {"n_sets_bench": n_bench, "n_sets_proper": n_proper, "fp4_MB_per_set": e * 68 / 1e6,
         "new_equals_old_bits": bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))}
    for _ in range(3):
        for tag, mod in (("old", old), ("new", new)):
            r.setdefault(f"{tag}_bench_rotation_us", []).append(bk.time_fn(timer(mod), sets[:n_bench])["us"])
            r.setdefault(f"{tag}_proper_rotation_us", []).append(bk.time_fn(timer(mod), sets[:n_proper])["us"])
    r["old_one_set_us"] = bk.time_fn(timer(old), sets[:1], calls=12)["us"]  # all in L2
    return r


def packed(e: int) -> dict:
    sets = make_sets(e, max(3, math.ceil(3 * 60e6 / (e * 68))))
    variants = {"old": (old, None), "new": (new, None), "new_packed": (new, {"packed": True}),
                "new_packed_s2": (new, {"packed": True, "num_stages": 2}),
                "new_packed_t4": (new, {"packed": True, "tiles": 4}),
                "new_packed_t4_s2": (new, {"packed": True, "tiles": 4, "num_stages": 2})}
    ref = [timer(old)(*s) for s in sets[:3]]
    r = {"n_sets": len(sets)}
    for tag, (mod, cfg) in variants.items():
        got = [mod.index_scores_fp4(*s, mma="fp8", config=cfg, return_path=True) for s in sets[:3]]
        pairs = list(zip(ref, got, strict=True))
        r[tag + "_bits_equal_old"] = all(torch.equal(a.view(torch.int16), b[0].view(torch.int16)) for a, b in pairs)
        r[tag + "_values_equal_old"] = all(torch.equal(a, b[0]) for a, b in pairs)
        r[tag + "_fp8_ran"] = all(int(b[1].min()) == 1 for b in got)
    for _ in range(3):
        for tag, (mod, cfg) in variants.items():
            r.setdefault(tag + "_us", []).append(round(bk.time_fn(timer(mod, cfg), sets)["us"], 3))
    return r


if __name__ == "__main__":
    mode = sys.argv[1]
    out = {}
    for name, e in (("128K", 32768), ("1M", 262144)):
        out[name] = {"rotation": rotation, "packed": packed}[mode](e)
        print(name, json.dumps(out[name]), flush=True)
        torch.cuda.empty_cache()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"ab_indexer_{mode}.json"), "w"), indent=1)
