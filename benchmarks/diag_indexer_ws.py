"""A/B timing of the FP4 indexer's decode kernels on the H200: the Triton FP8-MMA kernel (``mma="fp8"``) and the
warp-specialized Gluon kernel (``mma="ws"``) over the same rotating inputs (>= 3x L2 of key bytes), each checked
against the bf16 kernel on the dequantized keys first. Usage: python3 benchmarks/diag_indexer_ws.py --out DIR"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernel_sections.common import _n_sets, time_fn  # noqa: E402

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import indexer  # noqa: E402
from fidelity.model.formats import dequantize_fp4, quantize_fp4  # noqa: E402

BF16 = torch.bfloat16


def indexer_sets(n_q: int, e: int, seed: int) -> list[tuple]:
    """Rotating decode inputs (q, packed FP4 keys, scale bytes, weights): n_q FP4-simulated queries over e keys,
    as many sets as make >= 3x the L2 of key bytes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(_n_sets(e * 68, hi=96)):
        q = ops.indexer_round(torch.randn(n_q, 64, 128, device="cuda", generator=g), "fp4", rotate=True).to(BF16)
        packed, sc = quantize_fp4(torch.randn(e, 128, device="cuda", generator=g), 32)
        w = (torch.randn(n_q, 64, device="cuda", generator=g) * (128**-0.5 * 64**-0.5)).to(BF16)
        out.append((q, packed, sc, w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    variants = {"triton fp8": ("fp8", {}), "ws": ("ws", {}), "ws slots=6": ("ws", {"slots": 6}),
                "ws slots=8": ("ws", {"slots": 8}), "ws no loads": ("ws", {"parts": 6}),
                "ws no MMAs": ("ws", {"parts": 5}), "ws no epilogue": ("ws", {"parts": 3})}
    rows = []
    for n_q, e in ((1, 262144), (1, 32768), (4, 262144)):
        sets = indexer_sets(n_q, e, seed=e + n_q)
        q, p, s, w = sets[0]
        ref = indexer.index_scores_cuda(q, dequantize_fp4(p, s, 32).to(torch.bfloat16), w)
        for name, (mma, cfg) in variants.items():
            if "parts" in cfg and (n_q, e) != (1, 262144):
                continue
            got, used = indexer.index_scores_fp4(q, p, s, w, config=cfg, mma=mma, return_path=True)
            check = {"equal_frac_vs_bf16_kernel": float((got == ref).float().mean()), "used": used.tolist(),
                     "max_abs_diff": float((got.float() - ref.float()).abs().max())}
            times = [time_fn(lambda *xs, c=cfg, m=mma: indexer.index_scores_fp4(*xs, config=c, mma=m), sets)["us"]
                     for _ in range(args.reps)]
            row = {"n_q": n_q, "keys": e, "variant": name, "us": times, "sets": len(sets), **check,
                   "floor_us": (e * 68 + e * 2 * n_q) / 4.26e6}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del sets
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "diag_indexer_ws.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
