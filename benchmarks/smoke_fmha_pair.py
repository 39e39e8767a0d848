"""Builds route ``cuda`` of ``sparse_attention_fp8kv`` (timed) and compares one small case per pair layout (64 and
128 heads) with the emulation: per-row calc_diff, the fraction of outputs bit-equal, the worst head and row.

    python benchmarks/smoke_fmha_pair.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import kv_layout, ops  # noqa: E402
from fidelity.decoders.production.kernels import sparse_attention_pair  # noqa: E402


def main() -> None:
    t0 = time.perf_counter()
    module, error = sparse_attention_pair._extension()
    print(f"[build] {time.perf_counter() - t0:.1f} s, error={error}", flush=True)
    if module is None:
        sys.exit(1)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for heads, topk in ((64, 640), (128, 1152), (64, 100)):
        q = torch.randn(3, heads, 512, generator=g).to(torch.bfloat16)
        kv = ops.kv_round(torch.randn(4000, 512, generator=g).to(torch.bfloat16), 64, "fp8")
        packed = kv_layout.pack(kv, 64)
        idx = torch.randint(0, 4000, (3, topk), generator=g).to(torch.int32)
        idx[torch.rand(3, topk, generator=g) < 0.2] = -1
        sink = torch.randn(heads, generator=g)
        got = sparse_attention_pair.sparse_attention_pair(q.cuda(), packed.cuda(), idx.cuda(), sink.cuda(),
                                                          512**-0.5).cpu()
        torch.cuda.synchronize()
        ref = ops.sparse_attention(q, kv, idx, sink, 512**-0.5)
        x, y = got.double(), ref.double()
        diff = 1 - 2 * (x * y).sum(-1) / (x * x + y * y).sum(-1).clamp_min(1e-30)
        err = (x - y).abs()
        h_bad = err.amax(dim=(0, 2))
        d_bad = err.amax(dim=(0, 1))
        print(f"[case] heads={heads} topk={topk}: max row calc_diff {float(diff.max()):.3e}, equal "
              f"{float((got == ref).float().mean()):.4f}, finite {bool(torch.isfinite(got).all())}, "
              f"worst heads {h_bad.topk(4).indices.tolist()} dims {d_bad.topk(4).indices.tolist()}, "
              f"max abs err {float(err.max()):.3e} (ref max {float(y.abs().max()):.3e})", flush=True)
        worst = max(worst, float(diff.max()))
    sys.exit(0 if worst < 1e-4 else 2)


if __name__ == "__main__":
    main()
