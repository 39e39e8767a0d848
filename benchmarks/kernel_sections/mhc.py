"""The mHC kernels: ``hc_pre`` (mixes + Sinkhorn + collapse) and ``hc_post``."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import mhc
from kernel_sections.common import BF16, DEV, _n_sets, _row_calc_diff, record, sweep, time_fn


def bench_mhc(quick: bool):
    for name, n, dim in (("V4-Flash 4096 tokens", 4096, 4096), ("V4-Pro 4096 tokens", 4096, 7168),
                         ("V4-Flash decode 64", 64, 4096), ("V4-Flash decode 1", 1, 4096),
                         ("V4-Flash decode 4", 4, 4096), ("V4-Flash decode 16", 16, 4096)):
        g = torch.Generator(device=DEV).manual_seed(5)
        per = n * 4 * dim * 2
        sets = []
        fn = torch.randn(24, 4 * dim, device=DEV, generator=g) * (4 * dim) ** -0.5
        scale, base_ = torch.rand(3, device=DEV, generator=g) * 2, torch.randn(24, device=DEV, generator=g)
        for _ in range(_n_sets(per, hi=48)):
            sets.append((torch.randn(n, 4, dim, device=DEV, generator=g).to(BF16), fn, scale, base_))
        x = sets[0][0]
        ref = ops.hc_pre(x, fn, scale, base_, 1e-6, 20, 1e-6)
        check = {}
        for prec in ("ieee", "tf32x3", "bf16x3"):
            got = mhc.hc_pre_cuda(x, fn, scale, base_, 1e-6, 20, 1e-6, precision=prec)
            check[prec] = {"y_max_row_calc_diff": float(_row_calc_diff(got[0], ref[0]).max()),
                           "y_equal_frac": float((got[0] == ref[0]).float().mean()),
                           **{f"{k}_max_rel": float(((a - b).abs() / b.abs().clamp(min=1e-30)).max())
                              for k, a, b in zip(("pre", "post", "comb"), got[1:], ref[1:], strict=True)}}
        print(f"[mhc] {name}: {check}", flush=True)
        bytes_ = n * 4 * dim * 2 + 24 * 4 * dim * 4 + n * dim * 2 + n * 24 * 4
        flops = 2 * 24 * 4 * dim * n + 3 * 4 * dim * n
        base = {}
        t = time_fn(lambda x, f, s, b: ops.hc_pre(x, f, s, b, 1e-6, 20, 1e-6), sets)
        base["torch emulation (ops, CUDA)"] = t["us"]
        record("hc_pre", name, "torch emulation", t, bytes_=bytes_, flops=flops, unit="fp32")
        if n >= 2048:
            cfgs = [{"precision": "ieee", "bt": 16, "num_warps": 4}, {"precision": "tf32x3", "bt": 16, "num_warps": 4},
                    {"precision": "tf32x3", "bt": 32, "num_warps": 4}, {"precision": "tf32x3", "bt": 16, "bk": 256,
                                                                         "num_warps": 4},
                    {"precision": "tf32x3", "bt": 64, "splits": 2, "num_warps": 4},
                    {"precision": "tf32x3", "bt": 32, "splits": 2, "num_warps": 4}]
            cfgs += [{"precision": "bf16x3", "bt": bt, "splits": sp, "num_warps": nw}
                     for bt, sp, nw in ((16, 1, 4), (64, 2, 4), (64, 4, 4), (64, 2, 8), (64, 3, 8), (64, 4, 8),
                                        (64, None, 8))]
        elif n <= 16:  # one token tile: the default launches (split-K, then the finish)
            cfgs = [{}]
        else:
            cfgs = [{"precision": "tf32x3", "splits": 1}, {"precision": "tf32x3", "splits": None},
                    {"precision": "tf32x3", "splits": 8}, {"precision": "ieee", "splits": None},
                    {"precision": "bf16x3", "splits": None}, {"precision": "bf16x3", "bt": 64, "splits": None}]
        if quick and n > 16:
            cfgs = cfgs[::2]
        best = sweep("hc_pre", name, "triton fused", lambda cfg: (
            lambda *xs: mhc.hc_pre_cuda(*xs, 1e-6, 20, 1e-6, **cfg)), cfgs, sets,
            bytes_=bytes_, flops=flops, unit="fp32", check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
        del sets
        torch.cuda.empty_cache()


def bench_post(quick: bool):
    """hc_post: read f [n, dim] and the residual [n, 4, dim], write [n, 4, dim] (bf16 streams)."""
    for name, n, dim in (("V4-Flash 4096 tokens", 4096, 4096), ("V4-Pro 4096 tokens", 4096, 7168),
                         ("V4-Flash decode 64", 64, 4096)):
        g = torch.Generator(device=DEV).manual_seed(6)
        per = n * dim * 2 * 9
        sets = []
        for _ in range(_n_sets(per, hi=48)):
            comb = torch.rand(n, 4, 4, device=DEV, generator=g)
            sets.append((torch.randn(n, dim, device=DEV, generator=g).to(BF16),
                         torch.randn(n, 4, dim, device=DEV, generator=g).to(BF16),
                         torch.rand(n, 4, device=DEV, generator=g) * 2, comb / comb.sum(-1, keepdim=True)))
        f, r, post, comb = sets[0]
        got, ref = mhc.hc_post_cuda(f, r, post, comb), ops.hc_post(f, r, post, comb)
        check = {"equal_frac_vs_emulation": float((got == ref).float().mean()),
                 "max_rel_diff": float(((got.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-30)).max())}
        print(f"[post] {name}: {check}", flush=True)
        bytes_ = n * dim * 2 * 9 + n * 20 * 4
        t = time_fn(lambda *xs: ops.hc_post(*xs), sets)
        base = {"torch emulation (ops, CUDA)": t["us"]}
        record("hc_post", name, "torch emulation", t, bytes_=bytes_, flops=0)
        cfgs = [{"bt": bt, "bd": bd, "num_warps": nw} for bt, bd, nw in
                ((1, 1024, 4), (2, 512, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 4))]
        best = sweep("hc_post", name, "triton fused", lambda cfg: (lambda *xs: mhc.hc_post_cuda(*xs, **cfg)),
                     cfgs[:2] if quick else cfgs, sets, bytes_=bytes_, flops=0, check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
        del sets
        torch.cuda.empty_cache()
