"""Validate, then time the Triton production kernels at V4-Flash / V4-Pro shapes on one GPU.

    python benchmarks/bench_kernels.py --out DIR [--only attn,index,norm,mhc,post,kv,act,topk] [--quick]
                                             [--cases "Flash decode b64"]

For every kernel and shape: a correctness check against the torch emulation (``fidelity.decoders.production.ops`` on
CUDA tensors) on the benchmark inputs, then CUDA-event timings (median over many runs) of

* the kernel (a launch-config sweep where it matters; the best config is reported, all are kept in the JSON),
* the torch emulation (``ops.*`` on CUDA),
* a transformers-style eager implementation (dense masked attention with the sink as an extra logit column;
  fp32 index scores [S, H, T]) for attention and the indexer,

each rotating over >= 3 input sets whose bytes exceed the 60 MB L2 several times. Timed regions are captured
in a CUDA graph when possible (replay time / calls = device time per call, no Python launch gaps); the eager
per-call time (Python launch included) is reported beside it. The ceilings are measured in the same run (a
device-to-device copy, bytes read + written; an 8192^3 bf16 matmul) and each result is given as the fraction
of its floor (``max(bytes / bandwidth, flops / rate)``) for both the vendor peaks of the card
(``common.VENDOR_PEAKS``: H200 4.8 TB/s, H100 SXM 3.35 TB/s; 989 TFLOP/s bf16, 67 TFLOP/s fp32 on both; none for
another card) and the measured ceilings. FLOP convention for attention (performance-floors.md):
``2 * H * entries * (d_qk + d_v)`` per query; bytes: Q + O + each unique KV entry + indices.

Writes DIR/bench_kernels.json and DIR/bench_kernels.md; prints the markdown table last. The benchmarks of each
kernel family are in ``benchmarks/kernel_sections/`` (``--only`` keys: norm, act, post, kv, index, topk, mhc, attn,
moe).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sections import act, attention, common, indexer, kv, mhc, moe, norm, topk  # noqa: E402


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown() -> str:
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {__import__('triton').__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"ceilings measured in this run: copy {common.CEIL.get('bw', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{common.CEIL.get('bf16', 0) / 1e12:.0f} TFLOP/s, "
             f"fp32 matmul {common.CEIL.get('fp32', 0) / 1e12:.1f} TFLOP/s; vendor peaks: "
             f"{common.VENDOR or 'none known for this card'}", "",
             "| kernel | shape | variant | us (median) | eager us | GB/s | TFLOP/s | floor us (meas.) | bound | "
             "frac of floor meas. / vendor | config | speed-ups |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in common.RESULTS:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['variant']} | ERROR | | | | | | | {r['config']} | "
                         f"{r['error'][:80]} |")
            continue
        if r["variant"].endswith("(sweep)") and not r.get("best_of_sweep"):
            continue
        fl = r["floors"].get("measured", {})
        sp = ", ".join(f"{k.removeprefix('speedup vs ')}: {v:.1f}x" for k, v in r["baselines"].items()
                       if k.startswith("speedup"))
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['variant']} | {r['us']:.2f} | {r['eager_us'] or 0:.2f} | "
            f"{r['GBps']:.0f} | {r['TFLOPs']:.1f} | {fl.get('floor_us', 0):.2f} | {fl.get('bound', '')} | "
            f"{r['frac_floor_measured'] or 0:.2f} / {_frac(r['frac_floor_vendor'])} | {r['config']} | {sp} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="attn,index,norm,mhc,post,kv,act,topk,moe")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="", help="attention shapes to run, e.g. 'Flash decode b64' (default: all)")
    ap.add_argument("--attn-configs", default="",
                    help="JSON list of launch configs swept at the batch-64 decode shapes instead of the built-in "
                         "list, e.g. '[{\"block_h\": 64, \"num_warps\": 8, \"num_stages\": 2, \"num_splits\": 2}]'")
    a = ap.parse_args()
    attention.ATTN_CONFIGS[:] = json.loads(a.attn_configs) if a.attn_configs else []
    attention.CASES[:] = [c.strip() for c in a.cases.split(",") if c.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    common.measure_ceilings()
    for key, fn in (("norm", norm.bench_norm), ("act", act.bench_act), ("post", mhc.bench_post), ("kv", kv.bench_kv),
                    ("index", indexer.bench_indexer), ("topk", topk.bench_topk),
                    ("mhc", mhc.bench_mhc), ("attn", attention.bench_attention), ("moe", moe.bench_moe)):
        if key not in a.only.split(","):
            continue
        try:
            fn(a.quick)
        except Exception:  # noqa: BLE001 - keep the other sections' results
            traceback.print_exc()
            common.RESULTS.append({"kernel": key, "shape": "-", "variant": "-", "config": {},
                            "error": traceback.format_exc()[-300:]})
        (out / "bench_kernels.json").write_text(json.dumps({"ceilings": common.CEIL, "results": common.RESULTS},
                                                           indent=1))
        print(f"[{key}] done at {time.time() - t0:.0f}s", flush=True)
    md = markdown()
    (out / "bench_kernels.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
