"""The routed experts of a prefill chunk: op ``grouped_expert``'s kernels vs the per-expert loop."""

from __future__ import annotations

import torch

from kernel_sections.common import BF16, DEV, _row_calc_diff, record, sweep, time_fn

# the 1M study's prefill chunk on the Flash slice (bench_long_context.py --chunk 8192; dim 4096, moe_inter_dim 2048,
# 256 routed experts, top-6)
CHUNK, DIM, INTER, EXPERTS, TOPK = 8192, 4096, 2048, 256, 6


def flash_chunk(n: int, seed: int = 0) -> dict:
    """``grouped_expert``'s inputs at Flash's shapes on the device: random FP4 code bytes, 1x32 power-of-two scales
    (w13's pre-activations reach past the clamp), n tokens routed by random scores (top-6 of 256)."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def fp4(rows: int, cols: int, log2_scale: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (EXPERTS, rows, cols // 2), generator=g, device=DEV, dtype=torch.uint8)
        steps = torch.randint(-1, 2, (EXPERTS, rows, cols // 32), generator=g, device=DEV)
        return codes, (127 + log2_scale + steps).to(torch.uint8)  # e8m0 scale bytes, as stored

    (w13, s13), (w2, s2) = fp4(2 * INTER, DIM, -5), fp4(DIM, INTER, -7)
    weights, experts = torch.rand(n, EXPERTS, generator=g, device=DEV).topk(TOPK, dim=-1)
    return {"x": (torch.randn(n, DIM, generator=g, device=DEV) * 2).to(BF16),
            "weights": weights / weights.sum(-1, keepdim=True), "experts": experts.sort(dim=1).values, "w13": w13,
            "w13_scales": s13, "w2": w2, "w2_scales": s2, "limit": 10.0, "act": "fp8"}


def launches(fn) -> int:
    """CUDA kernels (and copies) one call of ``fn()`` launches, counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_moe(quick: bool):
    """One layer's routed experts for a prefill chunk: grouped kernels (launch-config sweep) vs the per-expert loop
    (``ops.grouped_expert`` on the device: the model's loop, one cuBLAS fp32 GEMM per expert and weight)."""
    from fidelity.decoders.production import ops
    from fidelity.decoders.production.kernels import grouped_expert

    n = 2048 if quick else CHUNK
    shape = f"Flash chunk {n} tok x top-{TOPK}"
    args = flash_chunk(n)
    flops = 2 * n * TOPK * 3 * DIM * INTER
    bytes_ = EXPERTS * 3 * DIM * INTER * (0.5 + 1 / 32) + n * DIM * 2 * (1 + TOPK)
    want = ops.grouped_expert(**args)
    loop = time_fn(lambda: ops.grouped_expert(**args), [()], graph=False, calls=2, reps=3)
    loop_launches = launches(lambda: ops.grouped_expert(**args))
    record("grouped_expert", shape, "per-expert loop (cuBLAS fp32)", loop, bytes_=bytes_, flops=flops, unit="fp32",
           check={"launches": loop_launches})

    def validate(fn) -> dict:
        got = fn()
        return {"max_row_calc_diff_vs_loop": float(_row_calc_diff(got, want).max()),
                "bits_equal_frac": float((got.view(torch.int16) == want.view(torch.int16)).float().mean())}

    configs = [{"block_m": m, "num_warps": w, "num_stages": s} for m, w, s in
               ((64, 8, 3), (64, 4, 3), (128, 8, 3), (128, 8, 2), (64, 8, 4))][: 2 if quick else 5]
    best = sweep("grouped_expert", shape, "triton grouped",
                 lambda cfg: (lambda: grouped_expert.grouped_expert_cuda(**args, launch=cfg)), configs, [()],
                 validate=validate, bytes_=bytes_, flops=flops)
    if best:
        best[0]["check"]["launches"] = launches(best[2])
        best[0]["baselines"] = {"per-expert loop": loop["us"], "speedup vs per-expert loop": loop["us"] / best[0]["us"]}
        print(f"  launches per call: grouped {best[0]['check']['launches']}, loop {loop_launches}", flush=True)
