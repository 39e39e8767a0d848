"""The FP8 activation quantize-dequantize (1x128)."""

from __future__ import annotations

import torch

from kernel_sections.common import BF16, DEV, _n_sets, record, sweep, time_fn


def bench_act(quick: bool):
    """FP8 activation quantize-dequantize (1x128, the input of every linear layer): one kernel vs the emulation."""
    from fidelity.decoders.production.kernels import act_quant
    from fidelity.model.formats import fake_quant_fp8

    for name, n, d in (("V4-Flash prefill 4096x4096", 4096, 4096), ("V4-Flash decode 1x4096", 1, 4096)):
        g = torch.Generator(device=DEV).manual_seed(8)
        sets = [((torch.randn(n, d, device=DEV, generator=g) * 3).to(BF16),) for _ in range(_n_sets(n * d * 4, hi=48))]
        x = sets[0][0]
        check = {"bit_exact_vs_formats": bool(torch.equal(act_quant.fake_quant_fp8(x).view(torch.int16),
                                                          fake_quant_fp8(x, 128).view(torch.int16)))}
        print(f"[act] {name}: {check}", flush=True)
        bytes_ = n * d * 4
        t = time_fn(lambda x: fake_quant_fp8(x, 128), sets[:3], graph=False, calls=3, reps=6)
        base = {"torch emulation (formats.fake_quant_fp8, CUDA)": t["us"]}
        record("fake_quant_fp8", name, "torch emulation", t, bytes_=bytes_, flops=0)
        best = sweep("fake_quant_fp8", name, "triton",
                     lambda cfg: (lambda xx: act_quant.fake_quant_fp8(xx, 128, **cfg)),
                     [{"rows": r, "num_warps": nw} for r, nw in ((1, 4), (2, 4), (2, 8))][: 1 if n == 1 else 3],
                     sets, bytes_=bytes_, flops=0, check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
        del sets
        torch.cuda.empty_cache()
