"""A/B of a warp-specialized Gluon kernel against an earlier revision of its module, on an sm_90 GPU. Meant for
changes that should keep every bit: the outputs of both revisions are compared first (bf16 bits, and the ``used``
flags of the indexer), then both are timed, interleaved, on the same rotating inputs (>= 3x L2).

    git show REV:fidelity/decoders/production/kernels/sparse_attention_ws.py > /tmp/old_attention_ws.py
    python3 benchmarks/ab_ws_revision.py attention --old /tmp/old_attention_ws.py --out DIR
    git show REV:fidelity/decoders/production/kernels/indexer_ws.py > /tmp/old_indexer_ws.py
    python3 benchmarks/ab_ws_revision.py indexer --old /tmp/old_indexer_ws.py --out DIR

Writes DIR/ab_<kernel>.json; exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_indexer_ws import indexer_sets  # noqa: E402
from kernel_sections.attention import decode_sets  # noqa: E402
from kernel_sections.common import _n_sets, time_fn  # noqa: E402

from fidelity.decoders.production.kernels import indexer_ws, sparse_attention_ws  # noqa: E402

SCALE = 512**-0.5


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _attention_cases(g: torch.Generator):
    """(label, q, kv, idx, sink): random, 30% masked with an all-masked row, sums above 2^126 (zero logits, sinks
    ~88), large logits; 64 and 128 heads, 1 to 18 blocks."""
    for heads, topk in ((64, 640), (128, 1152), (64, 65), (128, 1)):
        q = (torch.randn(8, heads, 512, device="cuda", generator=g) * 2).to(torch.bfloat16)
        kv = torch.randn(4000, 512, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randint(0, 4000, (8, topk), device="cuda", generator=g).to(torch.int32)
        sink = torch.randn(heads, device="cuda", generator=g)
        masked = idx.clone()
        masked[torch.rand(idx.shape, device="cuda", generator=g) < 0.3] = -1
        masked[3] = -1
        some = sink.clone()
        some[::7] = 87.9
        tag = f"H={heads} topk={topk}"
        yield f"random {tag}", q, kv, idx, sink
        yield f"30% masked + all-masked row {tag}", q, kv, masked, sink
        yield f"l above 2^126 {tag}", torch.zeros_like(q), kv, idx, 87.4 + torch.rand(heads, device="cuda", generator=g)
        yield f"some heads' l above 2^126 {tag}", torch.zeros_like(q), kv, idx, some
        yield f"large logits {tag}", q * 30, kv, idx, sink


def ab_attention(old, reps: int) -> dict:
    res = {"bits": [], "times": []}
    cases = list(_attention_cases(torch.Generator(device="cuda").manual_seed(5)))
    shapes = (("Flash decode b64", 64, 64, 512), ("Pro decode b64", 64, 128, 1024), ("Flash decode b1", 1, 64, 512))
    timed = []
    for shape, batch, heads, topk in shapes:
        sets, _ = decode_sets(batch, heads, topk, _n_sets(batch * (128 + topk) * 1024), 8192, False)
        args = [(s["q"], s["cache"], s["idx"], s["sink"]) for s in sets]
        cases += [(shape, *a) for a in args[:2]]
        timed.append((shape, heads, args))
    for label, q, kv, idx, sink in cases:
        for c in (1, 2):
            if q.shape[1] % (32 * c) == 0:
                a = old.sparse_attention_ws(q, kv, idx, sink, SCALE, consumers=c)
                b = sparse_attention_ws.sparse_attention_ws(q, kv, idx, sink, SCALE, consumers=c)
                res["bits"].append({"case": label, "consumers": c, "equal": _same_bits(a, b)})
    for rep in range(reps):
        for shape, heads, args in timed:
            for c in (1, 2) if heads == 128 else (1,):
                for name, mod in (("old", old), ("new", sparse_attention_ws)):
                    t = time_fn(lambda *xs, m=mod, c=c: m.sparse_attention_ws(*xs, SCALE, consumers=c), args)
                    res["times"].append({"shape": shape, "consumers": c, "kernel": name, "rep": rep, "us": t["us"]})
                    print(f"{shape}, {c} consumer(s), {name}, repeat {rep}: {t['us']:.3f} us", flush=True)
    return res


def ab_indexer(old, reps: int) -> dict:
    res = {"bits": [], "times": []}
    for n_q, e in ((1, 262144), (1, 32768), (4, 262144), (2, 1000), (3, 129)):
        sets = indexer_sets(n_q, e, seed=e + n_q)
        for k, (q, p, s, w) in enumerate(sets[:2]):
            if k == 1:
                q = q.clone()
                q[0, 0, 0] = 0.3  # not FP4-simulated: query 0 takes the bf16 path
            for causal in (False, True):
                pos = torch.randint(0, 4 * e, (n_q,), device="cuda", dtype=torch.int32) if causal else None
                a, used_a = old.index_scores_fp4_ws(q, p, s, w, pos)
                b, used_b = indexer_ws.index_scores_fp4_ws(q, p, s, w, pos)
                res["bits"].append({"n_q": n_q, "keys": e, "causal": causal, "set": k, "used": used_b.tolist(),
                                    "equal": _same_bits(a, b) and bool(torch.equal(used_a, used_b))})
        for rep in range(reps if e >= 32768 else 0):
            for name, mod in (("old", old), ("new", indexer_ws)):
                t = time_fn(lambda q, p, s, w, m=mod: m.index_scores_fp4_ws(q, p, s, w), sets)
                res["times"].append({"n_q": n_q, "keys": e, "kernel": name, "rep": rep, "us": t["us"]})
                print(f"{n_q} queries, {e} keys, {name}, repeat {rep}: {t['us']:.3f} us", flush=True)
        del sets
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=("attention", "indexer"))
    ap.add_argument("--old", required=True, help="the earlier revision's module file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    old = _load(args.old, f"old_{args.kernel}_ws")
    res = (ab_attention if args.kernel == "attention" else ab_indexer)(old, args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ab_{args.kernel}.json").write_text(json.dumps(res, indent=1))
    differ = [r for r in res["bits"] if not r["equal"]]
    print(f"outputs compared: {len(res['bits'])}, differing: {len(differ)}")
    for r in differ:
        print("DIFFERS:", r)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
