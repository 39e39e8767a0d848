"""Shared by the kernel benchmarks: device-time measurement (CUDA-graph replays rotating over input sets that
exceed the L2), result records against the memory / compute floors, launch-config sweeps, the measured ceilings."""

from __future__ import annotations

import math
import statistics

import torch

BF16 = torch.bfloat16
DEV = "cuda"
L2_BYTES = 60e6
_HOPPER_SXM_RATES = {"bf16": 989e12, "fp32": 67e12, "fp8": 1979e12}  # dense; the SXM H200 and H100 share them
VENDOR_PEAKS = {"H200": {"bw": 4.8e12, **_HOPPER_SXM_RATES}, "H100 80GB HBM3": {"bw": 3.35e12, **_HOPPER_SXM_RATES}}
VENDOR: dict[str, float] = {}
RESULTS: list[dict] = []
CEIL: dict[str, float] = {}


def _n_sets(bytes_per_set: float, lo: int = 3, hi: int = 64) -> int:
    """Input sets to rotate so that one pass over them is >= 3x the L2."""
    return max(lo, min(hi, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1.0))))


def time_fn(fn, sets, *, graph: bool = True, calls: int | None = None, reps: int = 15) -> dict:
    """Median device time per call of ``fn(*s)`` rotating over ``sets``; also the eager time per call."""
    for s in sets:  # warm-up (compilation, allocator)
        fn(*s)
    torch.cuda.synchronize()
    calls = calls or max(len(sets), 12)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = []
    for _ in range(max(3, reps // 3)):
        start.record()
        for i in range(calls):
            fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3 / calls)
    out = {"eager_us": statistics.median(eager), "method": "eager"}
    if graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for s in sets:
                    fn(*s)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(calls):
                    fn(*sets[i % len(sets)])
            g.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                ts.append(start.elapsed_time(end) * 1e3 / calls)
            out.update({"us": statistics.median(ts), "spread_us": [min(ts), max(ts)], "method": "cuda-graph"})
            del g
            return out
        except Exception as exc:  # noqa: BLE001 - ops with host syncs cannot be captured
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            torch.cuda.synchronize()
    out["us"] = out["eager_us"]
    out["spread_us"] = [min(eager), max(eager)]
    return out


def vendor_peaks(device_name: str) -> dict[str, float]:
    """The vendor's peaks for ``device_name`` (``torch.cuda.get_device_name``); {} for a card not in
    ``VENDOR_PEAKS``, whose rows then carry the measured floor only."""
    return next((dict(v) for k, v in VENDOR_PEAKS.items() if k in device_name), {})


def record(kernel: str, shape: str, variant: str, t: dict, *, bytes_: float, flops: float, unit: str = "bf16",
           check: dict | None = None, config: dict | None = None, baselines: dict | None = None) -> dict:
    us = t["us"]
    floors = {}
    for tag, bw, rate in (("vendor", VENDOR.get("bw"), VENDOR.get(unit)), ("measured", CEIL.get("bw"), CEIL.get(unit))):
        if bw:
            mem = bytes_ / bw * 1e6
            comp = flops / rate * 1e6 if rate else 0.0
            floors[tag] = {"floor_us": max(mem, comp), "mem_us": mem, "compute_us": comp,
                           "bound": "memory" if mem >= comp else "compute"}
    r = {"kernel": kernel, "shape": shape, "variant": variant, "us": us, "eager_us": t.get("eager_us"),
         "method": t.get("method"), "spread_us": t.get("spread_us"), "bytes": bytes_, "flops": flops,
         "GBps": bytes_ / us / 1e3, "TFLOPs": flops / us / 1e6, "floors": floors,
         "frac_floor_vendor": floors["vendor"]["floor_us"] / us if "vendor" in floors else None,
         "frac_floor_measured": floors["measured"]["floor_us"] / us if "measured" in floors else None,
         "check": check or {}, "config": config or {}, "baselines": baselines or {}}
    if "graph_error" in t:
        r["graph_error"] = t["graph_error"]
    RESULTS.append(r)
    print(f"  {kernel:18s} {shape:26s} {variant:22s} {us:10.2f} us  {r['GBps']:8.0f} GB/s  {r['TFLOPs']:7.1f} TF/s"
          f"  floor(meas) {r['frac_floor_measured'] or 0:.2f}  {config or ''}", flush=True)
    return r


def sweep(kernel, shape, variant, make_fn, configs, sets, validate=None, **rec):
    """Time every config; record all (variant/cfg), return the best (us, config, fn). ``validate(fn)`` (optional)
    checks each config's output on the benchmark inputs; its dict is recorded with the timing."""
    best = None
    for cfg in configs:
        fn = make_fn(cfg)
        try:
            t = time_fn(fn, sets)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
            print(f"  {kernel} {shape} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            RESULTS.append({"kernel": kernel, "shape": shape, "variant": variant, "config": cfg,
                            "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        r = record(kernel, shape, f"{variant} (sweep)", t, config=dict(cfg), **rec)
        if validate is not None:
            r["validation"] = validate(fn)
            print(f"    validation: {r['validation']}", flush=True)
        if best is None or r["us"] < best[0]["us"]:
            best = (r, cfg, fn)
    if best is not None:
        best[0]["best_of_sweep"] = True
    return best


def measure_ceilings():
    VENDOR.clear()
    VENDOR.update(vendor_peaks(torch.cuda.get_device_name()))
    bws = []
    for dtype, numel in ((torch.uint8, 1 << 30), (torch.float32, 1 << 28), (torch.float32, 1 << 30)):
        src = torch.randn(numel, device=DEV).to(dtype) if dtype != torch.uint8 else torch.randint(
            0, 255, (numel,), device=DEV, dtype=dtype)
        dst = torch.empty_like(src)
        t = time_fn(lambda dst=dst, src=src: dst.copy_(src), [()], graph=True, calls=10, reps=10)
        nbytes = 2 * numel * src.element_size()
        bws.append({"dtype": str(dtype), "bytes_read_plus_written": nbytes, "us": t["us"],
                    "TBps": nbytes / (t["us"] * 1e-6) / 1e12})
        del src, dst
        torch.cuda.empty_cache()
    import triton
    import triton.language as tl

    @triton.jit
    def _stream_copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    numel = 1 << 30
    a_in = torch.randn(numel, device=DEV, dtype=BF16)
    a_out = torch.empty_like(a_in)
    for block in (2048, 8192):
        t = time_fn(lambda i, o, block=block: _stream_copy[(triton.cdiv(numel, block),)](i, o, numel, BLOCK=block),
                    [(a_in, a_out)], graph=True, calls=10, reps=10)
        bws.append({"dtype": f"triton stream copy bf16 BLOCK={block}", "bytes_read_plus_written": 4 * numel,
                    "us": t["us"], "TBps": 4 * numel / (t["us"] * 1e-6) / 1e12})
    assert torch.equal(a_out, a_in)
    del a_in, a_out
    torch.cuda.empty_cache()
    CEIL["copies"] = bws
    CEIL["bw"] = max(b["TBps"] for b in bws) * 1e12
    m = 8192
    x = torch.randn(m, m, device=DEV, dtype=BF16)
    y = torch.randn(m, m, device=DEV, dtype=BF16)
    t = time_fn(lambda: x @ y, [()], graph=False, calls=10, reps=6)
    CEIL["bf16"] = 2 * m**3 / (t["us"] * 1e-6)
    xf, yf = x[:4096, :4096].float(), y[:4096, :4096].float()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    t = time_fn(lambda: xf @ yf, [()], graph=False, calls=5, reps=5)
    torch.backends.cuda.matmul.allow_tf32 = prev
    CEIL["fp32"] = 2 * 4096**3 / (t["us"] * 1e-6)
    try:  # FP8 e4m3 GEMM through cuBLAS (tensor-wise scales): the measured FP8 MMA ceiling
        x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=DEV)
        t = time_fn(lambda: torch._scaled_mm(x8, y8, scale_a=one, scale_b=one, out_dtype=BF16), [()], graph=False,
                    calls=10, reps=6)
        CEIL["fp8"] = 2 * m**3 / (t["us"] * 1e-6)
    except Exception as exc:  # noqa: BLE001 - older torch: no FP8 ceiling, vendor figure only
        print(f"ceilings: fp8 matmul not measured ({type(exc).__name__}: {str(exc)[:100]})")
    print(f"ceilings: {[(b['dtype'], round(b['TBps'], 2)) for b in bws]}")
    print(f"ceilings: max copy {CEIL['bw'] / 1e12:.2f} TB/s, bf16 matmul {CEIL['bf16'] / 1e12:.0f} TFLOP/s, "
          f"fp32 (no TF32) matmul {CEIL['fp32'] / 1e12:.1f} TFLOP/s, "
          f"fp8 matmul {CEIL.get('fp8', 0) / 1e12:.0f} TFLOP/s", flush=True)


def _row_calc_diff(a, b):
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    den = (a * a).sum(-1) + (b * b).sum(-1)
    return torch.where(den > 0, 1 - 2 * (a * b).sum(-1) / den.clamp(min=1e-300), 0.0)
