"""Times module variants of the ws indexer beside the tree's, interleaved, on the same rotating inputs; checks each
variant's scores against the tree's first (bit equality).

    python variants.py head,path/to/variant.py "" 262144,1024        # configs: "" or e.g. "slots=4,slots=16"

Run from the repo root on the GPU machine with PYTHONPATH=. and OUT set; writes $OUT/variants.json."""

import importlib.util
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from bench_kernels import time_fn  # noqa: E402
from diag_indexer_ws import indexer_sets  # noqa: E402
from fidelity.production.kernels import indexer_ws  # noqa: E402


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mods = {p if p == "head" else os.path.basename(p)[:-3]: indexer_ws if p == "head" else load(p)
        for p in sys.argv[1].split(",")}
cfgs = [{k: int(v) for k, v in (x.split("=") for x in c.split("+"))} if c else {} for c in sys.argv[2].split(",")]
rows = []
for e in (int(x) for x in sys.argv[3].split(",")):
    sets = indexer_sets(1, e, seed=e)
    q, p, s, w = sets[0]
    ref, _ = indexer_ws.index_scores_fp4_ws(q, p, s, w)
    for name, m in mods.items():
        for kw in cfgs:
            got, _ = m.index_scores_fp4_ws(q, p, s, w, **kw)
            equal = torch.equal(got.view(torch.int16), ref.view(torch.int16))
            print(name, kw, e, "bits equal", equal, flush=True)
    for rep in range(3):
        for name, m in mods.items():
            for kw in cfgs:
                t = time_fn(lambda q, p, s, w, m=m, kw=kw: m.index_scores_fp4_ws(q, p, s, w, **kw), sets)["us"]
                rows.append({"keys": e, "mod": name, **kw, "rep": rep, "us": round(t, 3)})
                print(json.dumps(rows[-1]), flush=True)
    del sets
    torch.cuda.empty_cache()
with open(os.path.join(os.environ["OUT"], "variants.json"), "w") as f:
    json.dump(rows, f, indent=1)
