"""Same-process A/B of two versions of a kernel module: this tree's routed FP4 GEMV and mHC kernels against the
files of another tree (same inputs, same timer), on CUDA.

    python benchmarks/ab_kernel_modules.py --old DIR --out FILE

DIR holds the other tree's ``weight_gemv.py`` and ``mhc.py`` (``git show REV:fidelity/decoders/production/kernels/
weight_gemv.py > DIR/weight_gemv.py``); they are loaded as siblings of this tree's kernel modules, so their relative
imports resolve against this tree. Each case checks old and new against each other (max abs difference, fraction of
equal outputs) and records the median device time per call (CUDA graph of 12 calls, ``kernel_sections.common``).
Writes FILE (JSON) and prints one line per case.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_sections.common import time_fn  # noqa: E402

from fidelity.decoders.production.kernels import mhc, weight_gemv  # noqa: E402

PACKAGE = "fidelity.decoders.production.kernels"


def load_old(path: Path, name: str):
    """The module at ``path`` imported as ``PACKAGE.<name>_old`` (relative imports resolve in PACKAGE)."""
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compare(label: str, shape: str, new_fn, old_fn, sets: list[tuple]) -> dict:
    a, b = new_fn(*sets[0]), old_fn(*sets[0])
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    row = {"case": label, "shape": shape, "max_abs_diff": float((a.float() - b.float()).abs().max()),
           "equal_frac": float((a == b).float().mean())}
    for tag, fn in (("new", new_fn), ("old", old_fn), ("new_again", new_fn)):
        row[f"{tag}_us"] = time_fn(fn, sets)["us"]
    row["old_over_new"] = row["old_us"] / row["new_us"]
    print(json.dumps(row), flush=True)
    return row


def fp4_cases(old) -> list[dict]:
    rows, g = [], torch.Generator(device="cuda").manual_seed(3)
    for name, n, k in (("w1 (gate)", 2048, 4096), ("w13 (gate+up)", 4096, 4096), ("w2 (down)", 4096, 2048),
                       ("Pro w1", 3072, 7168)):
        sets = []
        for _ in range(4):
            packed = torch.randint(0, 256, (256, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
            scales = torch.randint(118, 128, (256, n, k // 32), dtype=torch.uint8, device="cuda", generator=g)
            x = torch.randn(6, k, device="cuda", generator=g).to(torch.bfloat16)
            experts = torch.randperm(256, device="cuda", generator=g)[:6]
            sets.append((x, experts, packed, scales))
        rows.append(compare("fp4_picked_linear, 6 of 256 experts", f"{name} n={n} k={k}",
                            weight_gemv.fp4_picked_linear_cuda, old.fp4_picked_linear_cuda, sets))
        del sets
        torch.cuda.empty_cache()
    return rows


def mhc_cases(old) -> list[dict]:
    rows, g = [], torch.Generator(device="cuda").manual_seed(5)
    for dim in (4096, 7168):
        for n in (1, 2, 64):
            fn = torch.randn(24, 4 * dim, device="cuda", generator=g) * (4 * dim) ** -0.5
            scale, base = torch.rand(3, device="cuda", generator=g) * 2, torch.randn(24, device="cuda", generator=g)
            sets = [(torch.randn(n, 4, dim, device="cuda", generator=g).to(torch.bfloat16), fn, scale, base)
                    for _ in range(8)]
            rows.append(compare("hc_pre", f"n={n} dim={dim}",
                                lambda *xs: mhc.hc_pre_cuda(*xs, 1e-6, 20, 1e-6),
                                lambda *xs: old.hc_pre_cuda(*xs, 1e-6, 20, 1e-6), sets))
            hfn = fn[:4].contiguous()
            hsets = [(s[0], hfn, scale[:1].contiguous(), base[:4].contiguous()) for s in sets]
            rows.append(compare("hc_head", f"n={n} dim={dim}",
                                lambda *xs: mhc.hc_head_cuda(*xs, 1e-6, 1e-6),
                                lambda *xs: old.hc_head_cuda(*xs, 1e-6, 1e-6), hsets))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    old_dir = Path(args.old)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    result["rows"] += fp4_cases(load_old(old_dir / "weight_gemv.py", "weight_gemv"))
    result["rows"] += mhc_cases(load_old(old_dir / "mhc.py", "mhc"))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
