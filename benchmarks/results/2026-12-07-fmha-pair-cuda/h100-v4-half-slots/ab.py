"""A/B of route cuda's kernels in one process: the tree's ``sparse_attention_pair.cu`` and a candidate .cu (built as
a second extension with the same binding), at the four bench shapes (batch 64, V4-Flash 64 heads / 640 indices,
V4-Pro 128 heads / 1152 indices, s_q = 1, 2), each with parts switched off; the candidate's outputs compared with
the tree kernel's (fraction bit-equal, max per-row calc_diff). Contexts of 2048 compressed rows per token (the
bench uses 8192), six rotating input sets, kernel_sections.common.time_fn (CUDA-graph replays).

    python ab.py CANDIDATE.cu
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from kernel_sections.attention import decode_sets  # noqa: E402
from kernel_sections.common import _row_calc_diff, time_fn  # noqa: E402
from torch.utils.cpp_extension import load  # noqa: E402

from fidelity.decoders.production.kernels import sparse_attention_pair as pair  # noqa: E402

SCALE = 512**-0.5
RENAME = "-Dfidelity_fp8kv_pair_launch=fidelity_fp8kv_pair_launch_cand"  # the candidate's own launch symbol
# label: parts (1 row copies, 2 math, 4 dequantization and stores, 8 with copies off: none issued, candidate only)
PARTS = {"all": 7, "producers only": 5, "math only": 2, "no dequant": 3, "none (zero-fill copies)": 0,
         "none (no copies)": 8, "math only (no copies)": 10}


def main() -> None:
    cand_src = Path(sys.argv[1]).resolve()
    t0 = time.perf_counter()
    tree, err = pair._extension()
    print(f"[build] tree {time.perf_counter() - t0:.1f} s error={err}", flush=True)
    t0 = time.perf_counter()
    cand = load(name="fidelity_sparse_attention_pair_cand", sources=[str(pair.SOURCES[0]), str(cand_src)],
                extra_cuda_cflags=[*pair.NVCC_FLAGS, RENAME], extra_cflags=["-O3", RENAME], verbose=False)
    print(f"[build] candidate {time.perf_counter() - t0:.1f} s", flush=True)
    mods = {"tree": tree, "cand": cand}
    table = []
    for name, heads, topk in (("V4-Flash", 64, 512), ("V4-Pro", 128, 1024)):
        for s_q in (1, 2):
            n = 64 * s_q
            sets, _ = decode_sets(n, heads, topk, 6, 2048, fp8=True)
            args = [(s["q"], s["packed"], s["idx"], s["sink"]) for s in sets]
            a = args[0]
            o_tree = tree.forward(*a, SCALE, 7)
            o_cand = cand.forward(*a, SCALE, 7)
            torch.cuda.synchronize()
            eq = float((o_tree == o_cand).float().mean())
            cd = float(_row_calc_diff(o_cand, o_tree).max())
            fin = bool(torch.isfinite(o_cand).all())
            print(f"[check] {name} s_q={s_q}: cand vs tree equal {eq:.6f}, max row calc_diff {cd:.3e}, finite {fin}",
                  flush=True)
            for label, parts in PARTS.items():
                for which, mod in mods.items():
                    if which == "tree" and parts & 8:
                        continue
                    t = time_fn(lambda q, kv, i, s, mod=mod, parts=parts: mod.forward(q, kv, i, s, SCALE, parts), args)
                    table.append((f"{name} s_q={s_q}", label, which, t["us"], t["spread_us"]))
                    print(f"[time] {name} s_q={s_q} {label} {which}: {t['us']:.2f} us "
                          f"(spread {t['spread_us'][0]:.2f}-{t['spread_us'][1]:.2f})", flush=True)
            del sets, args
            torch.cuda.empty_cache()
    print("\n| case | parts | tree us | candidate us |\n|---|---|---|---|")
    rows = {}
    for case, label, which, us, _ in table:
        rows.setdefault((case, label), {})[which] = us
    for (case, label), v in rows.items():
        tr = f"{v['tree']:.2f}" if "tree" in v else ""
        print(f"| {case} | {label} | {tr} | {v['cand']:.2f} |")


if __name__ == "__main__":
    main()
