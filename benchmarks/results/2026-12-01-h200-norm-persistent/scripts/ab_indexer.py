"""A/B: indexer FP8-MMA path, HEAD kernel vs working tree, with the bench's rotation and with >= 3x L2 of FP4 bytes."""
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
    n_bench = bk._n_sets(e * 256, hi=32)
    n_proper = max(3, math.ceil(3 * 60e6 / (e * 68)))
    sets = []
    for _ in range(max(n_bench, n_proper)):
        q = ops.indexer_round(torch.randn(1, h, d, device="cuda", generator=g), "fp4", rotate=True).to(torch.bfloat16)
        packed, sc = quantize_fp4(torch.randn(e, d, device="cuda", generator=g), 32)
        w = (torch.randn(1, h, device="cuda", generator=g) * (d**-0.5 * h**-0.5)).to(torch.bfloat16)
        sets.append((q, packed, sc, w))
    a, b = old.index_scores_fp4(*sets[0], mma="fp8"), new.index_scores_fp4(*sets[0], mma="fp8")
    r = {"n_sets_bench": n_bench, "n_sets_proper": n_proper, "fp4_MB_per_set": e * 68 / 1e6,
         "new_equals_old_bits": bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))}
    for _ in range(3):
        for tag, mod in (("old", old), ("new", new)):
            def f(*xs, mod=mod):
                return mod.index_scores_fp4(*xs, mma="fp8")
            r.setdefault(f"{tag}_bench_rotation_us", []).append(bk.time_fn(f, sets[:n_bench])["us"])
            r.setdefault(f"{tag}_proper_rotation_us", []).append(bk.time_fn(f, sets[:n_proper])["us"])
    # bf16-MMA FP4 path and the 1-set (L2-resident) case for reference
    r["old_one_set_us"] = bk.time_fn(lambda *xs: old.index_scores_fp4(*xs, mma="fp8"), sets[:1], calls=12)["us"]
    print(name, json.dumps(r), flush=True)
    out[name] = r
    del sets
    torch.cuda.empty_cache()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ab_indexer.json", "w"), indent=1)
