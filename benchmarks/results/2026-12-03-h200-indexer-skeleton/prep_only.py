"""The ws indexer with no keys (one CTA codes the query and writes ``used``; no tile runs) beside an empty Triton
kernel, both graph-replayed over 24 rotating queries. With no keys, index_scores_fp4_ws also makes two one-row
zero tensors (two fill kernels in the graph) before its launch."""

import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
import triton  # noqa: E402
from bench_kernels import time_fn  # noqa: E402
from fidelity.production.kernels import indexer_ws  # noqa: E402


@triton.jit
def _empty(x):
    pass


g = torch.Generator(device="cuda").manual_seed(1)
none_u8 = [torch.zeros(0, n, dtype=torch.uint8, device="cuda") for n in (64, 4)]
sets = [(torch.randn(1, 64, 128, device="cuda", generator=g).to(torch.bfloat16), *none_u8,
         torch.randn(1, 64, device="cuda", generator=g).to(torch.bfloat16)) for _ in range(24)]
x = torch.zeros(1, device="cuda")
for _ in range(3):
    prep = time_fn(lambda q, p, s, w: indexer_ws.index_scores_fp4_ws(q, p, s, w), sets)["us"]
    empty = time_fn(lambda q, p, s, w: _empty[(1,)](x), sets)["us"]
    print("e=0 prep only (1 CTA)", round(prep, 3), "empty", round(empty, 3), flush=True)
