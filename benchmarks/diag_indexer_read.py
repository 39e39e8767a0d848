"""What the FP4 indexer's decode call cannot beat on this GPU, timed the way ``kernel_sections.common.time_fn`` times it
(CUDA-graph replays, rotating inputs >= 3x L2): an empty kernel (the per-call cost of a launch inside a graph), and
a bare read of the keys, a Triton kernel that streams the packed FP4 codes and scale bytes (68 B per key) and writes
one bf16 per key per query (an XOR fold of the key's bytes, so no byte can be skipped): the bytes the indexer
must move, with none of its arithmetic. The best of a few launch configurations is kept. The ``ws`` indexer kernel
(``index_scores_fp4_ws``, its default launch) is timed on the same inputs beside them.

    python3 benchmarks/diag_indexer_read.py --out DIR [--reps 3]

Writes DIR/diag_indexer_read.json and prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from diag_indexer_ws import indexer_sets  # noqa: E402
from kernel_sections.common import time_fn  # noqa: E402

from fidelity.decoders.production.kernels import indexer_ws  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_keys_kernel(k_ptr, ks_ptr, out_ptr, n_keys, N_Q: tl.constexpr, BLOCK: tl.constexpr):
    """out[i, j] = bf16 of (XOR of key j's 16 code words and its scale word) & 0x7fff, for i < N_Q."""
    pid = tl.program_id(0)
    keys = pid * BLOCK + tl.arange(0, BLOCK)
    valid = keys < n_keys
    words = tl.load(k_ptr + keys[:, None] * 16 + tl.arange(0, 16)[None, :], mask=valid[:, None], other=0,
                    cache_modifier=".cg")
    fold = tl.reduce(words, 1, _xor) ^ tl.load(ks_ptr + keys, mask=valid, other=0)
    val = (fold & 0x7FFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    for i in tl.static_range(N_Q):
        tl.store(out_ptr + i * n_keys + keys, val, mask=valid)


def read_keys(packed: torch.Tensor, scales: torch.Tensor, n_q: int, block: int, warps: int) -> torch.Tensor:
    """The bare read: packed uint8 [e, 64], scales uint8 [e, 4] -> bf16 [n_q, e]."""
    e = packed.shape[0]
    out = torch.empty((n_q, e), dtype=torch.bfloat16, device=packed.device)
    _read_keys_kernel[(triton.cdiv(e, block),)](packed.view(torch.int32), scales.view(torch.int32), out, e,
                                               N_Q=n_q, BLOCK=block, num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    dummy = torch.empty(1, device="cuda")
    for ctas in (1, torch.cuda.get_device_properties(0).multi_processor_count):
        t = [time_fn(lambda x, n=ctas: _empty_kernel[(n,)](x), [(dummy,)] * 3)["us"] for _ in range(args.reps)]
        rows.append({"what": f"empty kernel, {ctas} CTAs", "us": t})
        print(json.dumps(rows[-1]), flush=True)
    for n_q, e in ((1, 262144), (1, 32768), (1, 1024), (4, 262144)):
        full = indexer_sets(n_q, e, seed=e + n_q)
        sets = [(p, s) for _, p, s, _ in full]
        ref = sets[0][0].view(torch.int32).reshape(e, 16)
        fold = ref[:, 0]
        for k in range(1, 16):
            fold = fold ^ ref[:, k]
        fold = (fold ^ sets[0][1].view(torch.int32)[:, 0]) & 0x7FFF
        best, moved = None, e * 68 + e * 2 * n_q
        for block, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
            got = read_keys(*sets[0], n_q, block, warps)
            assert torch.equal(got.view(torch.int16).to(torch.int32), fold.expand(n_q, e).to(torch.int32) & 0x7FFF)
            t = [time_fn(lambda p, s, b=block, w=warps, n=n_q: read_keys(p, s, n, b, w), sets)["us"]
                 for _ in range(args.reps)]
            row = {"what": "bare read of the FP4 keys", "n_q": n_q, "keys": e, "block": block, "warps": warps,
                   "us": t, "bytes": moved, "tb_per_s": moved / min(t) / 1e6,
                   "sets": len(sets)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            best = row if best is None or min(t) < min(best["us"]) else best
        rows.append({**best, "what": "bare read of the FP4 keys, best config"})
        t = [time_fn(indexer_ws.index_scores_fp4_ws, full)["us"] for _ in range(args.reps)]
        rows.append({"what": "ws indexer kernel", "n_q": n_q, "keys": e, "us": t, "sets": len(full)})
        print(json.dumps(rows[-1]), flush=True)
        del full, sets
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "diag_indexer_read.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
