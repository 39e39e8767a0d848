"""The fused KV path (``kv_norm_rope_fp8``) and the 584 B cache rows."""

from __future__ import annotations

import torch

from fidelity.decoders.production import kv_layout, ops
from fidelity.decoders.production.kernels import kv_path, rms_norm
from kernel_sections.common import BF16, DEV, _n_sets, record, sweep, time_fn


def bench_kv(quick: bool):
    """KV path: RMSNorm + RoPE + FP8 round of [n, 512] in one launch, then the 584 B cache rows (``kv_layout.pack``,
    as the cache stores them)."""
    freqs = 1.0 / (10000.0 ** (torch.arange(32, device=DEV) / 32))
    for name, n in (("prefill 4096 tokens", 4096), ("decode 64 tokens", 64)):
        g = torch.Generator(device=DEV).manual_seed(7)
        sets = [((torch.randn(n, 512, device=DEV, generator=g) * 3).to(BF16), torch.randn(512, device=DEV, generator=g),
                 torch.arange(n, device=DEV) + 131072) for _ in range(_n_sets(n * 512 * 4, hi=48))]
        x, w, pos = sets[0]
        kv = kv_path.kv_norm_rope_fp8(x, w, 1e-6, pos, freqs)
        packed = kv_layout.pack(kv, 64)
        ref = ops.kv_round(ops.apply_rope(ops.rms_norm(x, w, 1e-6), pos, freqs), 64, "fp8")
        check = {"equal_frac_vs_emulation": float((kv == ref).float().mean()),
                 "unpacked_equal_kv": bool(torch.equal(kv_layout.unpack(packed, 512, 64), kv))}
        print(f"[kv] {name}: {check}", flush=True)
        bytes_ = n * 512 * 2 * 2 + n * 584
        t = time_fn(lambda x, w, p: kv_layout.pack(
            ops.kv_round(ops.apply_rope(ops.rms_norm(x, w, 1e-6), p, freqs), 64, "fp8"), 64), sets)
        base = {"torch emulation (ops, CUDA)": t["us"]}
        record("kv_norm_rope_fp8", name, "torch emulation (+ pack)", t, bytes_=bytes_, flops=0)
        t = time_fn(lambda x, w, p: kv_layout.pack(ops.kv_round(ops.apply_rope(
            rms_norm.rms_norm_cuda(x, w, 1e-6), p, freqs), 64, "fp8"), 64), sets)
        base["triton rms_norm + torch rope/round/pack"] = t["us"]
        cfgs = [{"rows": r, "num_warps": nw} for r, nw in ((1, 1), (1, 2), (1, 4), (4, 2))]
        best = sweep("kv_norm_rope_fp8", name, "triton fused + kv_layout.pack", lambda cfg: (
            lambda xx, ww, p: kv_layout.pack(kv_path.kv_norm_rope_fp8(xx, ww, 1e-6, p, freqs, **cfg), 64)),
            cfgs[:2] if quick else cfgs, sets, bytes_=bytes_, flops=0, check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
        del sets
        torch.cuda.empty_cache()
