"""Where the warp-specialized attention kernel's time goes, at Flash decode b64 (64 tokens, 64 heads, 640 entries)
and Pro decode b64 (64 tokens, 128 heads, 1152 entries): one and two consumer warpgroups per CTA, each with both
partitions working, with the gathers switched off (the math on whatever the slots hold), with the math switched
off (gathers only) and with both off (launch, Q load, handshakes and the output store). The halves' times against
the full kernel show how well they overlap.

    python benchmarks/diag_fmha_ws.py --out DIR     # writes DIR/diag_fmha_ws.json (needs an sm_90 GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sections.attention import decode_sets  # noqa: E402
from kernel_sections.common import _n_sets, time_fn  # noqa: E402

from fidelity.decoders.production.kernels import sparse_attention  # noqa: E402
from fidelity.decoders.production.kernels import sparse_attention_ws as ws

PARTS = {"gathers + math": ws.GATHER | ws.MATH, "math only (no gathers)": ws.MATH,
         "gathers only (no math)": ws.GATHER, "neither": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = Path(ap.parse_args().out)
    scale = 512**-0.5
    rows = []
    for shape, heads, topk in (("Flash decode b64", 64, 512), ("Pro decode b64", 128, 1024)):
        sets, _ = decode_sets(64, heads, topk, _n_sets(64 * (128 + topk) * 1024), 8192, False)
        args = [(s["q"], s["cache"], s["idx"], s["sink"]) for s in sets]
        variants = [("triton route (default config)", lambda *xs: sparse_attention.sparse_attention_cuda(
            *xs, scale, config={"route": "triton"}))]
        for c in (1, 2):
            variants += [(f"ws, {c} consumer(s): {label}", lambda *xs, c=c, p=p: ws.sparse_attention_ws(
                *xs, scale, consumers=c, parts=p)) for label, p in PARTS.items()]
        for label, fn in variants:
            t = time_fn(fn, args)
            rows.append({"shape": shape, "variant": label, "us": t["us"], "spread_us": t["spread_us"]})
            print(f"{shape}, {label}: {t['us']:.2f} us", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_fmha_ws.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
