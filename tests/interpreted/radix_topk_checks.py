"""Checks of the radix top-k kernel under Triton's CPU interpreter; run as ``TRITON_INTERPRET=1 python -m
tests.interpreted.radix_topk_checks`` (``tests/test_radix_topk_interpreted.py`` does so). Prints one JSON object:
{check name: list of the cases whose picks differ from the CPU stable sort's (empty: all equal)}."""

from __future__ import annotations

import json
import os

import torch

from fidelity.decoders.production.kernels.radix_topk import radix_topk
from fidelity.decoders.production.topk import stable_topk

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38]


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.float().sort(dim=-1, descending=True, stable=True).indices[..., :k]


def _mismatches(cases, fn=radix_topk) -> list[str]:
    return [name for name, x, k in cases if not torch.equal(fn(x, k), _reference(x, k))]


def _signed_zero_rows(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    """70% zeros of both signs, the rest normal; NaNs of both signs and infinities sprinkled in."""
    x = torch.where(torch.rand(rows, n, generator=g) < 0.7, torch.zeros(rows, n), torch.randn(rows, n, generator=g))
    x = torch.where(torch.rand(rows, n, generator=g) < 0.5, -x, x)
    x[..., ::97], x[..., 5::89] = float("nan"), -float("nan")
    x[..., 7::50], x[..., 3::71] = float("-inf"), float("inf")
    return x


def main() -> dict[str, list[str]]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 700, 512), (2, 5000, 200), (2, 2048, 1), (1, 9000, 600), (1, 300, 300)]  # k = n included
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).removeprefix("torch.")
        out[f"random_{tag}"] = _mismatches(
            [(f"{r}x{n} k{k}", torch.randn(r, n, generator=g).to(dtype), k) for r, n, k in shapes])
        out[f"signed_zero_nan_inf_ties_{tag}"] = _mismatches(
            [(f"{r}x{n} k{k}", _signed_zero_rows(r, n, g).to(dtype), k) for r, n, k in shapes])
        rows = []
        for i in range(12):  # a small pool of values: every threshold is a tie spread over several chunks
            pool = torch.tensor(SPECIALS + torch.randint(-6, 7, (4,), generator=g).div(4).tolist())
            r, n = 1 + i % 2, int(torch.randint(1, 6000, (1,), generator=g))
            k = int(torch.randint(1, min(n, 256) + 1, (1,), generator=g))
            rows.append((f"pool {i}: {r}x{n} k{k}", pool[torch.randint(len(pool), (r, n), generator=g)].to(dtype), k))
        out[f"few_distinct_values_{tag}"] = _mismatches(rows)
        x = torch.randn(4, 6000, generator=g).to(dtype)
        out[f"strided_rows_and_leading_dims_{tag}"] = _mismatches(
            [("every other entry", x[:, ::2], 100), ("[2, 2, n]", x.reshape(2, 2, 6000), 64)])
        out[f"all_zero_rows_{tag}"] = _mismatches(
            [("+0 and -0 rows", (torch.zeros(2, 3000) * torch.tensor([1.0, -1.0])[:, None]).to(dtype), 256)])
        out[f"stable_topk_route_radix_{tag}"] = _mismatches(
            [("signed zeros", _signed_zero_rows(2, 3000, g).to(dtype), 256)],
            fn=lambda s, k: stable_topk(s, k, "radix"))
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
