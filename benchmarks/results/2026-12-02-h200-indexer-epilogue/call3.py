"""Call 3 (repo root, GPU machine; kernel code of c1f5cf0): the consumer-count rule re-measured on this kernel (one
query, 2 vs 4 consumers, 3.9 to 15.5 tiles per CTA) and slots 4 / 6 / 8 at 1M context."""
import json
import os
import sys

sys.path.insert(0, "benchmarks")
from bench_kernels import time_fn  # noqa: E402
from diag_indexer_ws import indexer_sets  # noqa: E402
from fidelity.production.kernels import indexer_ws  # noqa: E402

rows = []
for e in (65536, 131072, 196608, 262144):
    sets = indexer_sets(1, e, seed=e)
    variants = [{"consumers": 2}, {"consumers": 4}]
    if e == 262144:
        variants += [{"slots": 6}, {"slots": 8}]
    for kw in variants:
        t = [round(time_fn(lambda q, p, s, w, kw=kw: indexer_ws.index_scores_fp4_ws(q, p, s, w, **kw), sets)["us"], 3)
             for _ in range(3)]
        rows.append({"keys": e, "tiles_per_cta": round(e / 128 / 132, 1), **kw, "us": t})
        print(json.dumps(rows[-1]), flush=True)
    del sets
json.dump(rows, open(os.path.join(os.environ["OUT"], "consumers.json"), "w"), indent=1)
