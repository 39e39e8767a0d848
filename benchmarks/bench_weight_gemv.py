"""The decode GEMMs on the release formats (``kernels/weight_gemv.py``) against the emulation's fp32 GEMM on the
dequantized weight, at V4-Flash's shapes, one token (and 2, for MTP); then wo_a's grouped projection on its FP8
codes against the bf16 einsum, and the compressors' stacked bf16 projections against their fp32 GEMMs.

    python benchmarks/bench_weight_gemv.py --out DIR [--sections fp8,fp4,wo_a,compressor]

Each row: the weight's shape, device time per call (CUDA-graph replay, rotating over enough weight copies to
spill the L2, ``kernel_sections.common.time_fn``), the bytes the kernel must read (codes + scales + x), the resulting
bandwidth and the emulation's time on the same inputs, and the largest error against the fp64 product of the same
rounded inputs relative to the ``act_linear`` contract bound. The FP8 and FP4 rows time the decode step's call (bf16
x quantized in the call). A sweep of launch configurations (row block, warps, k slices; FP4: blocks per step)
picks each row's fastest; ``default_us`` is the default configuration's time, the one the decoder runs. Writes
DIR/weight_gemv.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sections.common import _n_sets, time_fn  # noqa: E402

from fidelity.decoders.production.kernels.weight_gemv import (  # noqa: E402
    bf16_weight_linear_f32,
    fp4_expert_linear,
    fp8_weight_linear,
)
from fidelity.decoders.production.ops import grouped_out  # noqa: E402
from fidelity.model.formats import (  # noqa: E402
    decode_e8m0,
    dequantize_fp4,
    dequantize_fp8,
    fake_quant_fp8,
    quantize_fp4,
    quantize_fp8,
)

FP8_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
              "indexer.wq_b": (8192, 1024), "shared.w1": (2048, 4096), "shared.w2": (4096, 2048)}
EXPERT_SHAPES = {"experts.w1": (2048, 4096), "experts.w13": (4096, 4096), "experts.w2": (4096, 2048)}
# launch configurations swept per shape; ``splits`` None is the default (about two programs per SM), the others
# put more of the weight in flight at once (a GEMV of few rows is bound by the loads each SM has outstanding)
CONFIGS = [dict(bn=bn, num_warps=nw, splits=sp) for bn in (16, 32) for nw in (4, 8) for sp in (None, 4, 8, 16)]
FP4_CONFIGS = [dict(bn=bn, bb=bb, num_warps=nw, splits=sp) for bn in (32, 64) for bb in (4, 8) for nw in (4, 8)
               for sp in (None, 2, 4)]


def _fastest(call, configs: list[dict], sets: list) -> tuple[dict, dict]:
    """(config, time_fn result) of the fastest of ``configs`` (``call(*set, **config)``); a configuration the
    shape cannot take (its k slices do not divide k) is skipped."""
    best = None
    for cfg in configs:
        try:
            call(*sets[0], **cfg)
        except ValueError:
            continue
        t = time_fn(lambda *a, cfg=cfg: call(*a, **cfg), sets)
        if best is None or t["us"] < best[1]["us"]:
            best = (cfg, t)
    return best


def _bound_ratio(y, x, w) -> float:
    """max |y - x w^T| / (k 2^-23 |x| |w|^T + 1.25 * 2^-8 |x w^T|) (fp64)."""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T
    bound = x.shape[-1] * 2.0**-23 * (xd.abs() @ wd.abs().T) + 1.25 * 2.0**-8 * exact.abs()
    return float(((y.double() - exact).abs() / bound.clamp_min(1e-30)).max())


def bench_fp8(name, n, k, m, out):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g)
    codes, sb = quantize_fp8(w, (128, 128))
    scales = decode_e8m0(sb)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    wd = dequantize_fp8(codes, sb, (128, 128))
    nbytes = n * k + scales.numel() * 4 + m * k * 4
    sets = [(x, codes.clone(), scales.clone()) for _ in range(_n_sets(nbytes))]
    ratio = _bound_ratio(fp8_weight_linear(x, codes, scales, quantize=True), fake_quant_fp8(x, 128), wd)
    best = _fastest(lambda a, b, c, **cfg: fp8_weight_linear(a, b, c, quantize=True, **cfg), CONFIGS, sets)
    default = time_fn(lambda a, b, c: fp8_weight_linear(a, b, c, quantize=True), sets)  # what the decoder runs
    emu_sets = [(x, wd.clone()) for _ in range(_n_sets(n * k * 4))]
    emu = time_fn(lambda a, b: (a.float() @ b.T).to(torch.bfloat16), emu_sets)
    row = {"weight": name, "fmt": "fp8", "n": n, "k": k, "m": m, "us": best[1]["us"], "config": best[0],
           "default_us": default["us"], "bytes": nbytes, "TBps": nbytes / best[1]["us"] / 1e6,
           "emulation_us": emu["us"], "error_over_bound": ratio}
    out.append(row)
    print(json.dumps(row), flush=True)


def bench_grouped_wo_a(n, k, groups, out):
    """wo_a's grouped projection: o bf16 [1, groups * k] as given (no activation quantization) against the FP8
    codes [n, k]; beside it the bf16 einsum it replaces (``ops.grouped_out`` on the bf16 weight)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    codes, sb = quantize_fp8(torch.randn(n, k, device="cuda", generator=g), (128, 128))
    scales = decode_e8m0(sb)
    o = torch.randn(1, groups * k, device="cuda", generator=g).to(torch.bfloat16)
    wd = dequantize_fp8(codes, sb, (128, 128))
    y = fp8_weight_linear(o, codes, scales, groups=groups)
    ratio = max(_bound_ratio(y[:, j * (n // groups):(j + 1) * (n // groups)], o[:, j * k:(j + 1) * k],
                             wd[j * (n // groups):(j + 1) * (n // groups)]) for j in range(groups))
    nbytes = n * k + scales.numel() * 4 + o.numel() * 2
    sets = [(o, codes.clone(), scales.clone()) for _ in range(_n_sets(nbytes))]
    t = time_fn(lambda a, b, c: fp8_weight_linear(a, b, c, groups=groups), sets)
    bf16 = wd.to(torch.bfloat16)
    ein = time_fn(lambda a, b: grouped_out(a.unflatten(-1, (groups * 8, -1)), b, groups),
                  [(o, bf16.clone()) for _ in range(_n_sets(bf16.numel() * 2))])
    row = {"weight": "wo_a (grouped, bf16 o)", "fmt": "fp8", "n": n, "k": k, "groups": groups, "m": 1, "us": t["us"],
           "bytes": nbytes, "TBps": nbytes / t["us"] / 1e6, "bf16_einsum_us": ein["us"], "error_over_bound": ratio}
    out.append(row)
    print(json.dumps(row), flush=True)


def bench_compressor(name, n, k, out):
    """A compressor's stacked wkv / wgate (bf16 [n, k]) times one bf16 row -> fp32; beside it the two fp32 GEMMs on
    the fp32 copies it replaces."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    err = float(((bf16_weight_linear_f32(x, w).double() - exact).abs()
                 / (k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)).clamp_min(1e-30)).max())
    nbytes = n * k * 2 + k * 2
    t = time_fn(bf16_weight_linear_f32, [(x, w.clone()) for _ in range(_n_sets(nbytes))])
    w32 = w.float()
    half = n // 2
    fp32 = time_fn(lambda a, b: (a.float() @ b[:half].T, a.float() @ b[half:].T),
                   [(x, w32.clone()) for _ in range(_n_sets(n * k * 4))])
    row = {"weight": name, "fmt": "bf16 -> fp32", "n": n, "k": k, "m": 1, "us": t["us"], "bytes": nbytes,
           "TBps": nbytes / t["us"] / 1e6, "fp32_gemms_us": fp32["us"], "error_over_bound": err}
    out.append(row)
    print(json.dumps(row), flush=True)


def _fp4_experts(n_experts: int, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_experts`` random [n, k] weights as FP4 codes and e8m0 scales, quantized 16 experts at a time (one
    ``quantize_fp4`` over 256 Flash experts makes 8 GB fp32 temporaries: out of memory on an H200 after the FP8
    section)."""
    parts = [quantize_fp4(torch.randn(min(16, n_experts - e), n, k, device="cuda", generator=g))
             for e in range(0, n_experts, 16)]
    return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])


def bench_fp4(name, n, k, m, out, n_experts=256, slots=6):
    gc.collect()
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(1)
    packed, sb = _fp4_experts(n_experts, n, k, g)
    scales = sb.view(torch.uint8)  # the stored e8m0 bytes, as the kernel reads them
    experts = torch.randperm(n_experts, device="cuda", generator=g)[: slots * m].contiguous()
    x = torch.randn(slots * m, k, device="cuda", generator=g).to(torch.bfloat16)
    y = fp4_expert_linear(x, experts, packed, scales, quantize=True)  # the decode step's call: x quantized in it
    wd = dequantize_fp4(packed[experts], sb[experts])
    xq = fake_quant_fp8(x, 128)
    ratio = max(_bound_ratio(y[i : i + 1], xq[i : i + 1], wd[i]) for i in range(len(experts)))
    nbytes = len(experts) * (n * k // 2 + n * k // 32) + x.numel() * 4
    sets = [(x, torch.randperm(n_experts, device="cuda", generator=g)[: slots * m].contiguous())
            for _ in range(8)]  # other experts each call: the weights come from HBM
    best = _fastest(lambda a, e, **cfg: fp4_expert_linear(a, e, packed, scales, quantize=True, **cfg), FP4_CONFIGS,
                    sets)
    default = time_fn(lambda a, e: fp4_expert_linear(a, e, packed, scales, quantize=True), sets)
    row = {"weight": name, "fmt": "fp4", "n": n, "k": k, "slots": len(experts), "us": best[1]["us"],
           "config": best[0], "default_us": default["us"], "bytes": nbytes, "TBps": nbytes / best[1]["us"] / 1e6,
           "error_over_bound": ratio}
    out.append(row)
    print(json.dumps(row), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="fp8,fp4,wo_a,compressor", help="comma-separated: which tables to time")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    for m in (1, 2) if "fp8" in sections else ():
        for name, (n, k) in FP8_SHAPES.items():
            bench_fp8(name, n, k, m, rows)
    for name, (n, k) in EXPERT_SHAPES.items() if "fp4" in sections else ():
        bench_fp4(name, n, k, 1, rows)
    if "wo_a" in sections:
        bench_grouped_wo_a(8192, 4096, 8, rows)
    if "compressor" in sections:
        bench_compressor("compressor wkv + wgate (main, ratio 4)", 2048, 4096, rows)
        bench_compressor("compressor wkv + wgate (indexer)", 512, 4096, rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_gemv.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
