"""Where the warp-specialized decode kernel's time goes: Flash decode b64 (64 tokens, 64 heads, 640 entries) with
both partitions working, with the gathers switched off (the math on whatever the tiles hold), and with the math
switched off (gathers only). The two halves' times against the full kernel show how well they overlap.

    python benchmarks/diag_fmha_ws.py --out DIR     # writes DIR/diag_fmha_ws.json (needs an sm_90 GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels as bk  # noqa: E402

from fidelity.production.kernels import sparse_attention  # noqa: E402
from fidelity.production.kernels import sparse_attention_ws as ws


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = Path(ap.parse_args().out)
    batch, heads, topk, scale = 64, 64, 512, 512**-0.5
    sets, _ = bk.decode_sets(batch, heads, topk, bk._n_sets(batch * (128 + topk) * 1024), 8192, False)
    args = [(s["q"], s["cache"], s["idx"], s["sink"]) for s in sets]
    rows = []
    for label, fn in (
            ("triton route (default config)", lambda *xs: sparse_attention.sparse_attention_cuda(
                *xs, scale, config={"route": "triton"})),
            ("ws: gathers + math", lambda *xs: ws.sparse_attention_ws(*xs, scale)),
            ("ws: math only (no gathers)", lambda *xs: ws.sparse_attention_ws(*xs, scale, parts=ws.MATH)),
            ("ws: gathers only (no math)", lambda *xs: ws.sparse_attention_ws(*xs, scale, parts=ws.GATHER))):
        t = bk.time_fn(fn, args)
        rows.append({"variant": label, "us": t["us"], "spread_us": t["spread_us"]})
        print(f"{label}: {t['us']:.2f} us", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_fmha_ws.json").write_text(json.dumps({"shape": "Flash decode b64", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
