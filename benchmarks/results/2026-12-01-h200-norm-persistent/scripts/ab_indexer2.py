"""A/B: indexer FP8-MMA path: HEAD kernel, working tree default, working tree with the packed bf16x2 epilogue."""
# Run from the repo root with PYTHONPATH=. after `git show b5a9656:fidelity/production/kernels/indexer.py >
# devscratch/indexer_head.py` (the kernel before this session's changes).
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

out = {}
h, d = 64, 128
for name, e in (("128K", 32768), ("1M", 262144)):
    g = torch.Generator(device="cuda").manual_seed(2)
    n = max(3, math.ceil(3 * 60e6 / (e * 68)))
    sets = []
    for _ in range(n):
        q = ops.indexer_round(torch.randn(1, h, d, device="cuda", generator=g), "fp4", rotate=True).to(torch.bfloat16)
        packed, sc = quantize_fp4(torch.randn(e, d, device="cuda", generator=g), 32)
        w = (torch.randn(1, h, device="cuda", generator=g) * (d**-0.5 * h**-0.5)).to(torch.bfloat16)
        sets.append((q, packed, sc, w))
    ref = [old.index_scores_fp4(*s, mma="fp8") for s in sets[:3]]
    variants = {"old": (old, None), "new": (new, None), "new_packed": (new, {"packed": True}),
                "new_packed_s2": (new, {"packed": True, "num_stages": 2}),
                "new_packed_t4": (new, {"packed": True, "tiles": 4}),
                "new_packed_t4_s2": (new, {"packed": True, "tiles": 4, "num_stages": 2})}
    r = {"n_sets": n}
    for tag, (mod, cfg) in variants.items():
        got = [mod.index_scores_fp4(*s, mma="fp8", config=cfg, return_path=True) for s in sets[:3]]
        pairs = list(zip(ref, got, strict=True))
        r[tag + "_bits_equal_old"] = all(torch.equal(a.view(torch.int16), b[0].view(torch.int16)) for a, b in pairs)
        r[tag + "_values_equal_old"] = all(torch.equal(a, b[0]) for a, b in pairs)
        r[tag + "_fp8_ran"] = all(int(b[1].min()) == 1 for b in got)
    for _ in range(3):
        for tag, (mod, cfg) in variants.items():
            def f(*xs, mod=mod, cfg=cfg):
                return mod.index_scores_fp4(*xs, mma="fp8", config=cfg)
            r.setdefault(tag + "_us", []).append(round(bk.time_fn(f, sets)["us"], 3))
    print(name, json.dumps(r), flush=True)
    out[name] = r
    del sets
    torch.cuda.empty_cache()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ab_indexer2.json", "w"), indent=1)
