"""Call 6: two against four consumer warpgroups for one query, and ``ws`` against the Triton FP8 route for 2 and 4
queries, on rotating inputs. Run from ``benchmarks/`` (reformatted for lint after the run)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import time_fn  # noqa: E402
from diag_indexer_ws import indexer_sets  # noqa: E402
from fidelity.production.kernels import indexer as IDX  # noqa: E402
from fidelity.production.kernels import indexer_ws as NEW  # noqa: E402

out = os.environ.get("OUT", "/tmp")
rows = []
cases = [(1, 65536, ("c2", "c4")), (1, 131072, ("c2", "c4")), (1, 196608, ("c2", "c4")),
         (2, 262144, ("ws", "fp8")), (2, 65536, ("ws", "fp8")), (4, 131072, ("ws", "fp8"))]
for n_q, e, tags in cases:
    sets = indexer_sets(n_q, e, seed=e + n_q)
    for tag in tags:
        if tag == "fp8":
            def fn(q, p, s, w):
                return IDX.index_scores_fp4(q, p, s, w, mma="fp8")
        else:
            def fn(q, p, s, w, kw={"consumers": int(tag[1])} if tag[0] == "c" else {}):  # noqa: B006
                return NEW.index_scores_fp4_ws(q, p, s, w, **kw)
        us = [round(time_fn(fn, sets)["us"], 3) for _ in range(2)]
        r = {"tag": tag, "n_q": n_q, "keys": e, "us": us, "sets": len(sets)}
        print(json.dumps(r), flush=True)
        rows.append(r)
    del sets
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(out, "cmp2.json"), "w"), indent=1)
