"""RMSNorm and the fused RMSNorm + FP8 quantization at prefill and decode shapes."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import rms_norm
from fidelity.model.formats import quantize_fp8
from kernel_sections.common import BF16, DEV, _n_sets, record, sweep, time_fn


def torch_naive_norm_fp8(x, w, eps):
    y = ops.rms_norm(x, w, eps).float().unflatten(-1, (-1, 128))
    s = torch.exp2(torch.ceil(torch.log2(y.abs().amax(-1).clamp(min=1e-4) / 448)))
    return (y / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2), s


def bench_norm(quick: bool):
    for name, n, d in (("V4-Flash prefill 4096x4096", 4096, 4096), ("V4-Pro prefill 4096x7168", 4096, 7168),
                       ("V4-Flash decode 64x4096", 64, 4096)):
        g = torch.Generator(device=DEV).manual_seed(4)
        per = n * d * 3 + d * 4
        sets = [((torch.randn(n, d, device=DEV, generator=g) * 3).to(BF16), torch.randn(d, device=DEV, generator=g))
                for _ in range(_n_sets(per, hi=48))]
        x, w = sets[0]
        q, s, y = rms_norm.rms_norm_fp8_cuda(x, w, 1e-6, return_y=True)
        rq, rs = quantize_fp8(y, 128)
        yr = ops.rms_norm(x, w, 1e-6)
        yc = ops.rms_norm(x[:64].cpu(), w.cpu(), 1e-6)
        eq, es = quantize_fp8(yr, 128)
        check = {"codes_bit_exact_given_y": bool(torch.equal(q.view(torch.uint8), rq.view(torch.uint8))),
                 "scales_bit_exact_given_y": bool(torch.equal(s, rs)),
                 "y_equal_frac_vs_emulation_cuda": float((y == yr).float().mean()),
                 "y_equal_frac_vs_emulation_cpu": float((y[:64].cpu() == yc).float().mean()),
                 "codes_equal_frac_vs_emulation": float((q.view(torch.uint8) == eq.view(torch.uint8)).float().mean()),
                 "scales_equal_frac_vs_emulation": float((s == es).float().mean())}
        print(f"[norm] {name}: {check}", flush=True)
        bytes_ = n * d * 2 + d * 4 + n * d + n * d // 128
        base = {}
        t = time_fn(lambda x, w: ops.rms_norm_fp8(x, w, 1e-6), sets[:3], graph=False, calls=3, reps=6)
        base["torch emulation (ops, CUDA)"] = t["us"]
        record("rms_norm_fp8", name, "torch emulation", t, bytes_=bytes_, flops=0)
        t = time_fn(lambda x, w: torch_naive_norm_fp8(x, w, 1e-6), sets)
        base["torch naive (rms_norm + amax/exp2/cast)"] = t["us"]
        record("rms_norm_fp8", name, "torch naive", t, bytes_=bytes_, flops=0)
        best = sweep("rms_norm_fp8", name, "triton fused", lambda cfg: (
            lambda *xs: rms_norm.rms_norm_fp8_cuda(*xs, 1e-6, **cfg)),
            [{}, {"per_sm": 0}] + [{"num_warps": nw, "rows": r, "stream": st} for st in (False, True)
                    for nw in (4, 8, 16) for r in ((1, 2, 4) if n >= 1024 else (1,))]
            # the persistent kernel (per_sm programs per SM, register double buffer)
            + [{"per_sm": k, "rows": r, "num_warps": nw, "stream": True} for k in (1, 2, 4)
               for r, nw in ((1, 4), (1, 8), (2, 8), (2, 16))],
            sets, validate=lambda fn, x=x, w=w, q=q: {"codes_equal_frac_vs_default": float(
                (fn(x, w)[0].view(torch.uint8) == q.view(torch.uint8)).float().mean())},
            bytes_=bytes_, flops=0, check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
        t = time_fn(lambda x, w: rms_norm.rms_norm_cuda(x, w, 1e-6), sets)
        # the same [d/128, 128] kernel without the FP8 epilogue: what the quantization costs
        tq = time_fn(lambda x, w: rms_norm.rms_norm_fp8_cuda(x, w, 1e-6, return_y=True), sets)
        record("rms_norm_fp8", name, "triton fused, y written too", tq, bytes_=bytes_ + n * d * 2, flops=0)
        tr = time_fn(lambda x, w: ops.rms_norm(x, w, 1e-6), sets)
        r = record("rms_norm", name, "triton", t, bytes_=n * d * 4 + d * 4, flops=0)
        r["baselines"] = {"torch emulation (ops, CUDA)": tr["us"], "speedup vs torch emulation": tr["us"] / t["us"]}
        del sets
        torch.cuda.empty_cache()
