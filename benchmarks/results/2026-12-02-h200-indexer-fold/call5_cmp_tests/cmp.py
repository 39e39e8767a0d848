"""Call 5: the kernel before the session (``scratch_old_indexer_ws.py``, 228e451's module, next to this script when
it ran), the session's ``ws`` kernel with four and two consumers, and the Triton FP8 route, on the same rotating
inputs; bits compared with the previous kernel. Run from ``benchmarks/`` (reformatted for lint after the run)."""

import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import time_fn  # noqa: E402
from diag_indexer_ws import indexer_sets  # noqa: E402
from fidelity.production.kernels import indexer as IDX  # noqa: E402
from fidelity.production.kernels import indexer_ws as NEW  # noqa: E402


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


here = os.path.dirname(os.path.abspath(__file__))
mods = {"prev": load(os.path.join(here, "scratch_old_indexer_ws.py"), "prev_ws"), "new": NEW}
out = os.environ.get("OUT", "/tmp")
rows = []
for n_q, e in ((1, 1024), (1, 32768), (1, 262144), (4, 262144)):
    sets = indexer_sets(n_q, e, seed=e)
    ref = mods["prev"].index_scores_fp4_ws(*sets[0])[0]
    variants = [("prev", "prev", {}), ("new", "new", {}), ("triton fp8", None, {})]
    if n_q == 1:
        variants.append(("new c2", "new", {"consumers": 2}))
    for tag, mod, kw in variants:
        if mod is None:
            def fn(q, p, s, w):
                return (IDX.index_scores_fp4(q, p, s, w, mma="fp8"),)
        else:
            def fn(q, p, s, w, m=mods[mod], kw=kw):
                return m.index_scores_fp4_ws(q, p, s, w, **kw)
        eq = bool(torch.equal(fn(*sets[0])[0].view(torch.int16), ref.view(torch.int16)))
        us = [round(time_fn(fn, sets)["us"], 3) for _ in range(3)]
        r = {"tag": tag, "n_q": n_q, "keys": e, "us": us, "bits_eq_prev": eq, "sets": len(sets),
             "floor_us": round((e * 68 + e * 2 * n_q) / 4.26e6, 3)}
        print(json.dumps(r), flush=True)
        rows.append(r)
    del sets
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(out, "cmp.json"), "w"), indent=1)
