"""Validate, then time the Triton production kernels at V4-Flash / V4-Pro shapes on one GPU.

    python benchmarks/bench_kernels.py --out DIR [--only attn,index,norm,mhc,post,kv,act,topk] [--quick]
                                             [--cases "Flash decode b64"]

For every kernel and shape: a correctness check against the torch emulation (``fidelity.decoders.production.ops`` on
CUDA tensors) on the benchmark inputs, then CUDA-event timings (median over many runs) of

* the kernel (a launch-config sweep where it matters; the best config is reported, all are kept in the JSON),
* the torch emulation (``ops.*`` on CUDA),
* a transformers-style eager implementation (dense masked attention with the sink as an extra logit column;
  fp32 index scores [S, H, T]) for attention and the indexer,

each rotating over >= 3 input sets whose bytes exceed the 60 MB L2 several times. Timed regions are captured
in a CUDA graph when possible (replay time / calls = device time per call, no Python launch gaps); the eager
per-call time (Python launch included) is reported beside it. The ceilings are measured in the same run (a
device-to-device copy, bytes read + written; an 8192^3 bf16 matmul) and each result is given as the fraction
of its floor (``max(bytes / bandwidth, flops / rate)``) for both the vendor peaks (4.8 TB/s, 989 TFLOP/s bf16,
67 TFLOP/s fp32) and the measured ceilings. FLOP convention for attention (performance-floors.md):
``2 * H * entries * (d_qk + d_v)`` per query; bytes: Q + O + each unique KV entry + indices.

Writes DIR/bench_kernels.json and DIR/bench_kernels.md; prints the markdown table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import indexer, kv_path, mhc, rms_norm, sparse_attention  # noqa: E402
from fidelity.model.formats import quantize_fp4, quantize_fp8  # noqa: E402

BF16 = torch.bfloat16
DEV = "cuda"
L2_BYTES = 60e6
VENDOR = {"bw": 4.8e12, "bf16": 989e12, "fp32": 67e12, "fp8": 1979e12}
RESULTS: list[dict] = []
CEIL: dict[str, float] = {}
ATTN_CONFIGS: list[dict] = []  # --attn-configs: replaces the decode launch-config sweep
WS_ROUTES = [{"route": "ws"}, {"route": "ws", "consumers": 1}, {"route": "ws", "consumers": 2}]  # default, forced


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------


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


def record(kernel: str, shape: str, variant: str, t: dict, *, bytes_: float, flops: float, unit: str = "bf16",
           check: dict | None = None, config: dict | None = None, baselines: dict | None = None) -> dict:
    us = t["us"]
    floors = {}
    for tag, bw, rate in (("vendor", VENDOR["bw"], VENDOR[unit]), ("measured", CEIL.get("bw"), CEIL.get(unit))):
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


# ---------------------------------------------------------------------------------------------------------------
# ceilings
# ---------------------------------------------------------------------------------------------------------------


def measure_ceilings():
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


# ---------------------------------------------------------------------------------------------------------------
# sparse attention
# ---------------------------------------------------------------------------------------------------------------


def _row_calc_diff(a, b):
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    den = (a * a).sum(-1) + (b * b).sum(-1)
    return torch.where(den > 0, 1 - 2 * (a * b).sum(-1) / den.clamp(min=1e-300), 0.0)


def hf_style_attention(q, cache, idx, sink, scale, seq_rows):
    """transformers-style eager: per sequence a dense [H, m_seq] logit matrix over its whole cache, a -inf mask
    built from the selected indices, the sink as an extra logit column, fp32 softmax, bf16 P, P @ V.
    q [B, H, d] (one query per sequence), cache [B * m_seq, d], idx [B, K] (global rows, -1 masked)."""
    b, h, d = q.shape
    kv = cache.view(b, seq_rows, d)
    logits = torch.einsum("bhd,bmd->bhm", q, kv).float() * scale
    local = torch.where(idx >= 0, idx - torch.arange(b, device=q.device)[:, None] * seq_rows, seq_rows)
    mask = torch.full((b, seq_rows + 1), float("-inf"), device=q.device)
    mask.scatter_(1, local.long(), 0.0)
    logits = logits + mask[:, None, :seq_rows]
    p = torch.cat((logits, sink.float()[None, :, None].expand(b, -1, 1)), -1).softmax(-1)[..., :-1].to(q.dtype)
    return torch.einsum("bhm,bmd->bhd", p, kv)


def hf_style_prefill(q, kv, idx, sink, scale):
    """Dense prefill: logits [H, n, m] over all rows, mask from idx, sink column, fp32 softmax."""
    n, h, d = q.shape
    logits = torch.einsum("nhd,md->hnm", q, kv).float() * scale
    mask = torch.full((n, kv.shape[0] + 1), float("-inf"), device=q.device)
    mask.scatter_(1, torch.where(idx >= 0, idx, kv.shape[0]).long(), 0.0)
    logits = logits + mask[None, :, : kv.shape[0]]
    p = torch.cat((logits, sink.float()[:, None, None].expand(-1, n, 1)), -1).softmax(-1)[..., :-1].to(q.dtype)
    return torch.einsum("hnm,md->nhd", p, kv)


CASES: list[str] = []  # --cases: run only the attention shapes whose name contains one of these


def _wanted(name: str) -> bool:
    return not CASES or any(c in name for c in CASES)


def decode_sets(batch, heads, topk, n_sets, ctx_entries, fp8, seed=0):
    """n_sets independent decode batches: each token owns a sequence with 128 window rows and ``ctx_entries``
    compressed rows; idx = the 128 window rows + ``topk`` distinct compressed rows."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = 128 + ctx_entries
    sets = []
    for _ in range(n_sets):
        cache = (torch.randn(batch * rows, 512, device=DEV, generator=g)).to(BF16)
        cache = ops.kv_round(cache, 64, "fp8")
        q = (torch.randn(batch, heads, 512, device=DEV, generator=g) * 2).to(BF16)
        base = torch.arange(batch, device=DEV)[:, None] * rows
        comp = torch.argsort(torch.rand(batch, ctx_entries, device=DEV, generator=g), dim=1)[:, :topk] + 128
        idx = torch.cat((base + torch.arange(128, device=DEV)[None, :], base + comp), 1).to(torch.int32)
        sink = torch.randn(heads, device=DEV, generator=g)
        packed = sparse_attention.pack_kv_fp8(cache) if fp8 else None
        sets.append({"q": q, "cache": cache, "packed": packed, "idx": idx, "sink": sink})
    return sets, rows


def bench_attention(quick: bool):
    scale = 512**-0.5
    cfgs512 = [
        {"block_h": 16, "split_d": 1, "num_warps": 4, "num_stages": 1},
        {"block_h": 32, "split_d": 1, "num_warps": 4, "num_stages": 1},
        {"block_h": 32, "split_d": 1, "num_warps": 8, "num_stages": 1},
        {"block_h": 32, "split_d": 1, "num_warps": 8, "num_stages": 2},
        {"block_h": 32, "split_d": 2, "num_warps": 4, "num_stages": 1},
        {"block_h": 64, "split_d": 1, "num_warps": 8, "num_stages": 1},
        {"block_h": 64, "split_d": 2, "num_warps": 8, "num_stages": 1},
        # added 2026-12-01 (deeper pipelines, 64-head wgmma tiles with one warpgroup)
        {"block_h": 64, "split_d": 1, "num_warps": 8, "num_stages": 2},
        {"block_h": 64, "split_d": 2, "num_warps": 4, "num_stages": 1},
        {"block_h": 64, "split_d": 2, "num_warps": 4, "num_stages": 2},
        {"block_h": 64, "split_d": 2, "num_warps": 8, "num_stages": 2},
        {"block_h": 32, "split_d": 1, "num_warps": 4, "num_stages": 2},
        {"block_h": 32, "split_d": 2, "num_warps": 8, "num_stages": 2},
        {"block_h": 32, "split_d": 1, "num_warps": 8, "num_stages": 3},
        {"block_h": 16, "split_d": 1, "num_warps": 4, "num_stages": 2},
    ]
    if quick:
        cfgs512 = cfgs512[1:3]
    if ATTN_CONFIGS:
        cfgs512 = list(ATTN_CONFIGS)
    cases = [("V4-Flash decode b64", 64, 64, 512), ("V4-Pro decode b64", 64, 128, 1024),
             ("V4-Flash decode b1", 1, 64, 512), ("V4-Pro decode b1", 1, 128, 1024)]
    for name, batch, heads, topk in [c for c in cases if _wanted(c[0])]:
        k = 128 + topk
        flops = 2 * batch * heads * k * 1024
        ctx = 8192 if batch > 1 else 16384  # compressed entries per sequence (32K / 64K tokens at ratio 4)
        per_set_bf16 = batch * k * 1024
        sets, rows = decode_sets(batch, heads, topk, _n_sets(per_set_bf16, hi=24), ctx, fp8=True)
        qo = 2 * batch * heads * 512 * 2
        idx_b = batch * k * 4
        # correctness on set 0: kernel vs emulation (CUDA) and fp8 layout vs bf16 rows (bit-exact)
        s0 = sets[0]
        ref = ops.sparse_attention(s0["q"], s0["cache"], s0["idx"], s0["sink"], scale)
        got = sparse_attention.sparse_attention_cuda(s0["q"], s0["cache"], s0["idx"], s0["sink"], scale)
        got8 = sparse_attention.sparse_attention_fp8kv(s0["q"], s0["packed"], s0["idx"], s0["sink"], scale)
        check = {"max_row_calc_diff_vs_emulation": float(_row_calc_diff(got, ref).max()),
                 "bf16_equal_frac_vs_emulation": float((got == ref).float().mean()),
                 "fp8_layout_max_row_calc_diff_vs_bf16_kernel": float(_row_calc_diff(got8, got).max()),
                 "fp8_layout_max_row_calc_diff_vs_emulation": float(_row_calc_diff(got8, ref).max()),
                 "fp8_layout_equal_frac_vs_bf16_kernel": float((got8 == got).float().mean())}
        print(f"[attn] {name}: {check}", flush=True)
        args_bf16 = [(s["q"], s["cache"], s["idx"], s["sink"]) for s in sets]
        args_fp8 = [(s["q"], s["packed"], s["idx"], s["sink"]) for s in sets]
        extra = [] if ATTN_CONFIGS else [dict(cfgs512[i], num_splits=2) for i in (3, 5)]
        configs = cfgs512 + extra if batch > 1 else [
            dict(c, num_splits=ns) for c in cfgs512[:2] for ns in (1, 5, 10)]
        if batch == 1 and quick:
            configs = [dict(cfgs512[0], num_splits=ns) for ns in (1, 5)]
        base = {}
        t = time_fn(lambda q, c, i, s: ops.sparse_attention(q, c, i, s, scale), args_bf16[:3])
        base["torch emulation (ops, CUDA)"] = t["us"]
        record("sparse_attention", name, "torch emulation", t, bytes_=qo + idx_b + per_set_bf16, flops=flops)
        t = time_fn(lambda *xs, rows=rows: hf_style_attention(*xs, scale, rows), args_bf16[:3])
        base["transformers-style eager (dense)"] = t["us"]
        record("sparse_attention", name, "transformers-style eager", t, bytes_=qo + batch * rows * 1024, flops=flops)
        for variant, args, row_bytes, fn in (
                ("bf16 KV", args_bf16, 1024, sparse_attention.sparse_attention_cuda),
                ("fp8 KV (584 B)", args_fp8, 584, sparse_attention.sparse_attention_fp8kv)):
            def make(cfg, fn=fn):
                return lambda *xs: fn(*xs, scale, config=cfg)
            speed = {}
            # bf16 KV: the warp-specialized route (the default on sm_90; one or two consumer warpgroups per CTA)
            # against the Triton launches
            routes_ = WS_ROUTES if row_bytes == 1024 and not ATTN_CONFIGS else []
            best = sweep("sparse_attention", name, variant, make, routes_ + configs, args,
                         bytes_=qo + idx_b + batch * k * row_bytes, flops=flops, check=check)
            if best:
                r = best[0]
                speed = {f"speedup vs {kname}": us / r["us"] for kname, us in base.items()}
                r["baselines"] = dict(base, **speed)
                print(f"  best {variant}: {r['us']:.2f} us {best[1]} {speed}", flush=True)
        bench_e4m3_profile(name, s0, args_bf16, scale, bytes_=qo + idx_b + batch * k * 1024, flops=flops)
        del sets, args_bf16, args_fp8
        torch.cuda.empty_cache()

    # prefill: 4096 tokens, window 128 + top-k compressed entries (CSA), compute-bound
    for name, heads, topk in [c for c in (("V4-Flash prefill 4K", 64, 512), ("V4-Pro prefill 4K", 128, 1024))
                              if _wanted(c[0])]:
        n = 2048 if quick else 4096
        g = torch.Generator(device=DEV).manual_seed(1)
        n_comp = n // 4
        k = 128 + topk
        sets = []
        for _ in range(3):
            kv = ops.kv_round(torch.randn(n + n_comp, 512, device=DEV, generator=g).to(BF16), 64, "fp8")
            q = (torch.randn(n, heads, 512, device=DEV, generator=g) * 2).to(BF16)
            pos = torch.arange(n, device=DEV)
            win = pos[:, None] - 127 + torch.arange(128, device=DEV)[None, :]
            win = torch.where(win >= 0, win, -1)
            vis = (pos + 1) // 4
            r = torch.rand(n, n_comp, device=DEV, generator=g).masked_fill(
                torch.arange(n_comp, device=DEV)[None, :] >= vis[:, None], 2.0)
            top = torch.topk(r, min(topk, n_comp), dim=1, largest=False)
            comp = torch.where(top.values < 2.0, top.indices + n, -1)
            if comp.shape[1] < topk:
                comp = torch.cat((comp, torch.full((n, topk - comp.shape[1]), -1, device=DEV)), 1)
            idx = torch.cat((win, comp), 1).to(torch.int32)
            sets.append((q, kv, idx, torch.randn(heads, device=DEV, generator=g)))
        valid = int((sets[0][2] >= 0).sum())
        flops = 2 * heads * valid * 1024  # only valid entries: the floor counts real work
        flops_padded = 2 * n * heads * k * 1024
        bytes_ = 2 * n * heads * 512 * 2 + (n + n_comp) * 1024 + n * k * 4
        q, kv, idx, sink = sets[0]
        ref = ops.sparse_attention(q, kv, idx, sink, scale)
        got = sparse_attention.sparse_attention_cuda(q, kv, idx, sink, scale)
        check = {"max_row_calc_diff_vs_emulation": float(_row_calc_diff(got, ref).max()),
                 "bf16_equal_frac_vs_emulation": float((got == ref).float().mean()),
                 "valid_entries_frac": valid / (n * k), "flops_incl_masked": flops_padded}
        print(f"[attn] {name}: {check}", flush=True)
        del ref, got
        base = {}
        t = time_fn(lambda q, c, i, s: ops.sparse_attention(q, c, i, s, scale), sets, graph=False, calls=3, reps=3)
        base["torch emulation (ops, CUDA)"] = t["us"]
        record("sparse_attention", name, "torch emulation", t, bytes_=bytes_, flops=flops)
        if heads == 64:
            t = time_fn(lambda q, c, i, s: hf_style_prefill(q, c, i, s, scale), sets, graph=False, calls=3, reps=3)
            base["transformers-style eager (dense)"] = t["us"]
            record("sparse_attention", name, "transformers-style eager", t, bytes_=bytes_, flops=flops)
        torch.cuda.empty_cache()
        pre_cfgs = [cfgs512[i] for i in ((3, 5) if not quick else (5,))] + WS_ROUTES

        def make(cfg):
            return lambda *xs: sparse_attention.sparse_attention_cuda(*xs, scale, config=cfg)

        best = sweep("sparse_attention", name, "bf16 KV", make, pre_cfgs, sets, bytes_=bytes_, flops=flops,
                     check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
            print(f"  best prefill: {best[0]['us']:.1f} us {best[1]} {best[0]['baselines']}", flush=True)
        del sets
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------------------------


def hf_style_index_scores(q, keys, w):
    """fp32 scores through an fp32 [S, H, T] intermediate (transformers' eager indexer)."""
    s = torch.einsum("shd,td->sht", q.float(), keys.float()).relu()
    return (s * w.float()[..., None]).sum(1)


def bench_indexer(quick: bool):
    h, d = 64, 128
    cfgs = [{"block_e": 32, "num_warps": 2}, {"block_e": 64, "num_warps": 4}, {"block_e": 128, "num_warps": 4},
            {"block_e": 128, "num_warps": 8}, {"block_e": 256, "num_warps": 8}]
    if quick:
        cfgs = cfgs[1:3]
    for name, e in (("128K ctx decode (32768 keys)", 32768), ("1M ctx decode (262144 keys)", 262144)):
        g = torch.Generator(device=DEV).manual_seed(2)
        n_sets = _n_sets(e * 68, hi=96)  # >= 3x L2 of the smallest keys timed (FP4, 68 B per key)
        sets = []
        for _ in range(n_sets):
            q = ops.indexer_round(torch.randn(1, h, d, device=DEV, generator=g), "fp4", rotate=True).to(BF16)
            keys = torch.randn(e, d, device=DEV, generator=g)
            packed, sc = quantize_fp4(keys, 32)
            kb = indexer.dequantize_fp4_keys(packed, sc)
            w = (torch.randn(1, h, device=DEV, generator=g) * (d**-0.5 * h**-0.5)).to(BF16)
            sets.append({"q": q, "k": kb, "p": packed, "s": sc, "w": w})
        s0 = sets[0]
        ref = ops.index_scores(s0["q"], s0["k"], s0["w"])
        got = indexer.index_scores_cuda(s0["q"], s0["k"], s0["w"])
        got4, used = indexer.index_scores_fp4(s0["q"], s0["p"], s0["s"], s0["w"], mma="fp8", return_path=True)
        got4b = indexer.index_scores_fp4(s0["q"], s0["p"], s0["s"], s0["w"], mma="bf16")
        diff = (got.float() - ref.float()).abs()
        check = {"bf16_equal_frac_vs_emulation": float((got == ref).float().mean()),
                 "max_abs_diff_vs_emulation": float(diff.max()), "max_abs_score": float(ref.float().abs().max()),
                 "fp4_equal_frac_vs_bf16_keys": float((got4 == got).float().mean()),
                 "fp4_max_abs_diff_vs_bf16_keys": float((got4.float() - got.float()).abs().max()),
                 "fp4_equal_frac_vs_emulation": float((got4 == ref).float().mean()),
                 "fp4_fp8mma_ran": int(used.min()),
                 "fp4_bf16mma_equal_frac_vs_bf16_keys": float((got4b == got).float().mean()),
                 "fp4_topk512_overlap_vs_emulation": float(
                     len(set(torch.topk(got4.float(), 512).indices[0].tolist())
                         & set(torch.topk(ref.float(), 512).indices[0].tolist())) / 512),
                 "topk512_overlap_vs_emulation": float(
                     len(set(torch.topk(got.float(), 512).indices[0].tolist())
                         & set(torch.topk(ref.float(), 512).indices[0].tolist())) / 512)}
        print(f"[index] {name}: {check}", flush=True)
        flops = 2 * h * d * e
        base = {}
        a_b = [(s["q"], s["k"], s["w"]) for s in sets]
        a_4 = [(s["q"], s["p"], s["s"], s["w"]) for s in sets]
        t = time_fn(lambda q, k, w: ops.index_scores(q, k, w), a_b)
        base["torch emulation (ops, CUDA)"] = t["us"]
        record("index_scores", name, "torch emulation", t, bytes_=e * 256 + e * 2, flops=flops)
        t = time_fn(hf_style_index_scores, a_b)
        base["transformers-style eager (fp32)"] = t["us"]
        record("index_scores", name, "transformers-style eager", t, bytes_=e * 256 + e * 4, flops=flops)
        mma_cfgs = [{}, {"packed": False}] + [
            {"block_e": 128, "tiles": t, "num_warps": 4, "num_stages": ns} for t in (1, 2, 4, 8)
            for ns in (1, 2, 3)] + [
            {"block_e": 128, "tiles": 2, "num_warps": 8, "num_stages": 2},
            {"block_e": 128, "tiles": 4, "num_warps": 8, "num_stages": 2},
            {"block_e": 64, "tiles": 4, "num_warps": 4, "num_stages": 2},
            {"block_e": 64, "tiles": 8, "num_warps": 4, "num_stages": 3},
            {"block_e": 256, "tiles": 2, "num_warps": 8, "num_stages": 2}]
        if quick:
            mma_cfgs = mma_cfgs[::3]
        for variant, args, kbytes, fn, vcfgs in (
                ("bf16 keys", a_b, 256, lambda cfg: (lambda *xs: indexer.index_scores_cuda(*xs, config=cfg)),
                 [dict(c, q_per_prog=1) for c in cfgs]),
                ("fp4 keys (68 B), bf16 MMA", a_4, 68,
                 lambda cfg: (lambda *xs: indexer.index_scores_fp4(*xs, config=cfg, mma="bf16")),
                 [dict(c, q_per_prog=1) for c in cfgs]),
                ("fp4 keys (68 B), FP8 MMA", a_4, 68,
                 lambda cfg: (lambda *xs: indexer.index_scores_fp4(*xs, config=cfg, mma="fp8")), mma_cfgs),
                ("fp4 keys (68 B), FP8 MMA, warp-specialized (ws)", a_4, 68,
                 lambda cfg: (lambda *xs: indexer.index_scores_fp4(*xs, config=cfg, mma="ws")),
                 [{}, {"slots": 6}, {"slots": 8}])):
            best = sweep("index_scores", name, variant, fn, vcfgs, args,
                         bytes_=e * kbytes + e * 2 + h * d * 2 + h * 2, flops=flops, check=check,
                         unit="fp8" if variant.startswith("fp4") else "bf16",
                         validate=lambda f, a=args[0], ref=got: {
                             "equal_frac_vs_bf16_keys": float((f(*a) == ref).float().mean())})
            if best:
                best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
                print(f"  best {variant}: {best[0]['us']:.2f} us {best[1]} {best[0]['baselines']}", flush=True)
                if "FP8 MMA" in variant:
                    cfg = best[1]
                    topk = 512

                    mma = "ws" if variant.endswith("(ws)") else "fp8"

                    def sel(q, p, s, w, cfg=cfg, topk=topk, mma=mma):
                        return torch.topk(indexer.index_scores_fp4(q, p, s, w, config=cfg, mma=mma), topk, dim=-1)
                    t = time_fn(sel, a_4)
                    record("index_scores+topk", name, f"fp4 keys ({mma}) + torch.topk({topk})", t,
                           bytes_=e * kbytes + e * 2, flops=flops, unit="fp8")
        del sets, a_b, a_4
        torch.cuda.empty_cache()

    # prefill chunk: 1024 queries x 32768 keys (MMA-bound)
    nq, e = (256 if quick else 1024), 32768
    g = torch.Generator(device=DEV).manual_seed(3)
    sets = []
    for _ in range(3):
        q = ops.indexer_round(torch.randn(nq, h, d, device=DEV, generator=g), "fp4", rotate=True).to(BF16)
        packed, sc = quantize_fp4(torch.randn(e, d, device=DEV, generator=g), 32)
        w = (torch.randn(nq, h, device=DEV, generator=g) * (d**-0.5 * h**-0.5)).to(BF16)
        sets.append((q, indexer.dequantize_fp4_keys(packed, sc), w))
    name = f"prefill chunk {nq}q x {e} keys"
    flops = 2 * nq * h * d * e
    bytes_ = nq * e * 2 + e * 256 + nq * h * d * 2
    q, kb, w = sets[0]
    ref = ops.index_scores(q[:64], kb, w[:64])
    got = indexer.index_scores_cuda(q[:64], kb, w[:64])
    check = {"bf16_equal_frac_vs_emulation": float((got == ref).float().mean())}
    print(f"[index] {name}: {check}", flush=True)
    base = {}
    t = time_fn(lambda q, k, w: ops.index_scores(q, k, w), sets, graph=False, calls=3, reps=3)
    base["torch emulation (ops, CUDA)"] = t["us"]
    record("index_scores", name, "torch emulation", t, bytes_=bytes_, flops=flops)
    t = time_fn(hf_style_index_scores, sets, graph=False, calls=3, reps=3)
    base["transformers-style eager (fp32)"] = t["us"]
    record("index_scores", name, "transformers-style eager", t, bytes_=bytes_, flops=flops)
    torch.cuda.empty_cache()
    pcfgs = [{"block_e": 128, "num_warps": 4, "q_per_prog": 8}, {"block_e": 128, "num_warps": 8, "q_per_prog": 32},
             {"block_e": 64, "num_warps": 4, "q_per_prog": 16}]
    best = sweep("index_scores", name, "bf16 keys", lambda cfg: (
        lambda q, k, w: indexer.index_scores_cuda(q, k, w, config=cfg)), pcfgs[: 1 if quick else 3], sets,
        bytes_=bytes_, flops=flops, check=check)
    if best:
        best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
    sets4 = []
    for q, kb, w in sets:
        packed, sc = quantize_fp4(kb.float(), 32)
        sets4.append((q, packed, sc, w))
    got4 = indexer.index_scores_fp4(*(t[:64] if i in (0, 3) else t for i, t in enumerate(sets4[0])), mma="fp8")
    check4 = {"fp4_fp8mma_equal_frac_vs_bf16_keys": float((got4 == got).float().mean())}
    print(f"[index] {name} FP8 MMA: {check4}", flush=True)
    best = sweep("index_scores", name, "fp4 keys (68 B), FP8 MMA", lambda cfg: (
        lambda *xs: indexer.index_scores_fp4(*xs, config=cfg, mma="fp8")),
        [{"block_e": 128, "tiles": t, "q_per_prog": qp, "num_warps": nw} for t, qp, nw in
         ((8, 1, 4), (16, 1, 4), (8, 1, 8), (4, 2, 4))][: 2 if quick else 4],
        sets4, bytes_=nq * e * 2 + e * 68 + nq * h * d * 2, flops=flops, check=check4, unit="fp8")
    if best:
        best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
    del sets4
    del sets
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm + FP8 quant
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# mHC pre
# ---------------------------------------------------------------------------------------------------------------


def bench_mhc(quick: bool):
    for name, n, dim in (("V4-Flash 4096 tokens", 4096, 4096), ("V4-Pro 4096 tokens", 4096, 7168),
                         ("V4-Flash decode 64", 64, 4096)):
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
        else:
            cfgs = [{"precision": "tf32x3", "splits": 1}, {"precision": "tf32x3", "splits": None},
                    {"precision": "tf32x3", "splits": 8}, {"precision": "ieee", "splits": None},
                    {"precision": "bf16x3", "splits": None}, {"precision": "bf16x3", "bt": 64, "splits": None}]
        if quick:
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


def bench_kv(quick: bool):
    """KV path: RMSNorm + RoPE + FP8 round of [n, 512] (and the 584 B cache rows) in one launch."""
    freqs = 1.0 / (10000.0 ** (torch.arange(32, device=DEV) / 32))
    for name, n in (("prefill 4096 tokens", 4096), ("decode 64 tokens", 64)):
        g = torch.Generator(device=DEV).manual_seed(7)
        sets = [((torch.randn(n, 512, device=DEV, generator=g) * 3).to(BF16), torch.randn(512, device=DEV, generator=g),
                 torch.arange(n, device=DEV) + 131072) for _ in range(_n_sets(n * 512 * 4, hi=48))]
        x, w, pos = sets[0]
        kv, packed = kv_path.kv_norm_rope_fp8(x, w, 1e-6, pos, freqs, pack=True)
        ref = ops.kv_round(ops.apply_rope(ops.rms_norm(x, w, 1e-6), pos, freqs), 64, "fp8")
        check = {"equal_frac_vs_emulation": float((kv == ref).float().mean()),
                 "unpacked_equal_kv": bool(torch.equal(sparse_attention.unpack_kv_fp8(packed), kv))}
        print(f"[kv] {name}: {check}", flush=True)
        bytes_ = n * 512 * 2 * 2 + n * 584
        t = time_fn(lambda x, w, p: sparse_attention.pack_kv_fp8(
            ops.kv_round(ops.apply_rope(ops.rms_norm(x, w, 1e-6), p, freqs), 64, "fp8")), sets)
        base = {"torch emulation (ops, CUDA)": t["us"]}
        record("kv_norm_rope_fp8", name, "torch emulation (+ pack)", t, bytes_=bytes_, flops=0)
        t = time_fn(lambda x, w, p: sparse_attention.pack_kv_fp8(ops.kv_round(ops.apply_rope(
            rms_norm.rms_norm_cuda(x, w, 1e-6), p, freqs), 64, "fp8")), sets)
        base["triton rms_norm + torch rope/round/pack"] = t["us"]
        cfgs = [{"rows": r, "num_warps": nw} for r, nw in ((1, 1), (1, 2), (1, 4), (4, 2))]
        best = sweep("kv_norm_rope_fp8", name, "triton fused (+ pack)", lambda cfg: (
            lambda xx, ww, p: kv_path.kv_norm_rope_fp8(xx, ww, 1e-6, p, freqs, pack=True, **cfg)),
            cfgs[:2] if quick else cfgs, sets, bytes_=bytes_, flops=0, check=check)
        if best:
            best[0]["baselines"] = dict(base, **{f"speedup vs {kk}": v / best[0]["us"] for kk, v in base.items()})
        del sets
        torch.cuda.empty_cache()


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


def bench_e4m3_profile(name, s0, args, scale, *, bytes_, flops):
    """Profile fp8-fmha (``fmt="fp8"``: e4m3 Q, K/V and P) in the kernel vs its torch emulation, default launch."""
    got = sparse_attention.sparse_attention_cuda(s0["q"], s0["cache"], s0["idx"], s0["sink"], scale, "fp8")
    ref = ops.sparse_attention(s0["q"], s0["cache"], s0["idx"], s0["sink"], scale, "fp8")
    check = {"max_row_calc_diff_vs_emulation": float(_row_calc_diff(got, ref).max()),
             "equal_frac_vs_emulation": float((got == ref).float().mean())}
    print(f"[attn] {name} e4m3 profile: {check}", flush=True)
    t = time_fn(lambda q, c, i, s: ops.sparse_attention(q, c, i, s, scale, "fp8"), args[:3])
    record("sparse_attention", name, "e4m3 profile: torch emulation", t, bytes_=bytes_, flops=flops)
    t_k = time_fn(lambda q, c, i, s: sparse_attention.sparse_attention_cuda(q, c, i, s, scale, "fp8"), args)
    record("sparse_attention", name, "e4m3 profile (fp8-fmha), kernel", t_k, bytes_=bytes_, flops=flops,
           check=check, baselines={"torch emulation": t["us"], "speedup vs torch emulation": t["us"] / t_k["us"]})


def _radix_at(block: int):
    """The radix selection at ``block`` entries per program (a sweep point)."""
    from fidelity.decoders.production.kernels.radix_topk import radix_topk

    return lambda s, k: radix_topk(s, k, {"block": block})


def bench_topk(quick: bool):
    """Indexer top-k selection on bf16 scores (what the indexer ops return; -inf past the causal limit): the
    routes of ``topk.stable_topk`` (each must equal the CPU's stable sort of the scores; ``radix`` is the Triton
    selection, ``sort`` the default before it), the path before the fourth 2026-12-01 session (an fp32 copy, then
    CUDA's float sort, which differs from the CPU's on -0.0 and negative NaNs), and plain ``torch.topk`` (tie order
    unspecified: a speed reference only). Cases marked "ties" have 80% of the scores at +-0.0 (ReLU-weighted
    scores of a short context), so the k-th score is a zero shared by thousands of entries."""
    from fidelity.decoders.production.topk import ROUTES, default_route, stable_topk

    cases = [("decode b1, 128K ctx (32768 keys), k=512", 1, 32768, 512),
             ("decode b1, 1M ctx (262144 keys), k=512", 1, 262144, 512),
             ("decode b1, 1M ctx (262144 keys), k=1024", 1, 262144, 1024),
             ("decode b64, 32K ctx (8192 keys), k=512", 64, 8192, 512),
             ("decode b1, 1M ctx (262144 keys), k=512, ties", 1, 262144, 512),
             ("decode b64, 32K ctx (8192 keys), k=512, ties", 64, 8192, 512)]
    cases += [(f"prefill chunk {r} q x {n} keys, k=512", r, n, 512)
              for r, n in ((128, 32768), (256, 32768), (512, 8192), (512, 32768), (512, 262144), (1024, 32768))]
    z = torch.randn(1, 32768).bfloat16().float()  # why the routes sort integers: signed zeros and NaNs
    z[torch.rand(1, 32768) < 0.8] = 0.0
    z[torch.rand(1, 32768) < 0.4] = -0.0
    z[0, 5], z[0, 9] = float("nan"), -float("nan")
    cpu = z.sort(dim=-1, descending=True, stable=True).indices[:, :4096]
    print(f"[topk] on +-0 / NaN scores: CUDA float sort == CPU sort: "
          f"{torch.equal(z.to(DEV).sort(dim=-1, descending=True, stable=True).indices[:, :4096].cpu(), cpu)}, "
          f"route sort == CPU sort: {torch.equal(stable_topk(z.to(DEV), 4096, 'sort').cpu(), cpu)}", flush=True)
    for name, rows, n, k in cases[:2] if quick else cases:
        g = torch.Generator(device=DEV).manual_seed(9)
        sets = []
        for _ in range(_n_sets(rows * n * 2, hi=48)):
            x = torch.randn(rows, n, device=DEV, generator=g).to(BF16)
            if name.endswith("ties"):
                x[torch.rand(rows, n, device=DEV, generator=g) < 0.8] = 0.0
                x[torch.rand(rows, n, device=DEV, generator=g) < 0.4] = -0.0
            x[:, n - n // 8:] = float("-inf")
            sets.append((x,))
        x = sets[0][0]
        ref = x.float().cpu().sort(dim=-1, descending=True, stable=True).indices[:, :k]
        check = {f"{route}_equal_to_cpu_stable_sort": bool(torch.equal(stable_topk(x, k, route).cpu(), ref))
                 for route in ROUTES}
        check["default_route"] = default_route(x, k)
        base = {}
        variants = [(f"route {route}", lambda s, k=k, route=route: stable_topk(s, k, route)) for route in ROUTES]
        sweep = {b: _radix_at(b) for b in (1024, 2048, 4096, 8192) if b <= n}
        check.update({f"radix_block_{b}_equal_to_cpu_stable_sort": bool(torch.equal(fn(x, k).cpu(), ref))
                      for b, fn in sweep.items()})
        print(f"[topk] {name}: {check}", flush=True)
        variants += [(f"radix, block {b} (sweep)", lambda s, k=k, fn=fn: fn(s, k)) for b, fn in sweep.items()]
        variants += [("before: fp32 copy + CUDA float sort",
                      lambda s, k=k: s.float().sort(dim=-1, descending=True, stable=True).indices[:, :k]),
                     ("torch.topk, unspecified ties", lambda s, k=k: torch.topk(s, k).indices)]
        for variant, fn in variants:
            r = record("topk", name, variant, time_fn(fn, sets), bytes_=rows * n * 2, flops=0, check=check)
            base[variant] = r["us"]
        chosen = base["route " + check["default_route"]]
        print(f"  default route {check['default_route']}: {chosen:.1f} us, {base['route sort'] / chosen:.2f}x "
              f"faster than the route sort, {base['before: fp32 copy + CUDA float sort'] / chosen:.2f}x than the "
              f"fp32 float sort", flush=True)
        del sets
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------


def markdown() -> str:
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {__import__('triton').__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"ceilings measured in this run: copy {CEIL.get('bw', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{CEIL.get('bf16', 0) / 1e12:.0f} TFLOP/s, fp32 matmul {CEIL.get('fp32', 0) / 1e12:.1f} TFLOP/s", "",
             "| kernel | shape | variant | us (median) | eager us | GB/s | TFLOP/s | floor us (meas.) | bound | "
             "frac of floor meas. / vendor | config | speed-ups |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in RESULTS:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['variant']} | ERROR | | | | | | | {r['config']} | "
                         f"{r['error'][:80]} |")
            continue
        if r["variant"].endswith("(sweep)") and not r.get("best_of_sweep"):
            continue
        fl = r["floors"].get("measured", {})
        sp = ", ".join(f"{k.removeprefix('speedup vs ')}: {v:.1f}x" for k, v in r["baselines"].items()
                       if k.startswith("speedup"))
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['variant']} | {r['us']:.2f} | {r['eager_us'] or 0:.2f} | "
            f"{r['GBps']:.0f} | {r['TFLOPs']:.1f} | {fl.get('floor_us', 0):.2f} | {fl.get('bound', '')} | "
            f"{r['frac_floor_measured'] or 0:.2f} / {r['frac_floor_vendor'] or 0:.2f} | {r['config']} | {sp} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="attn,index,norm,mhc,post,kv,act,topk")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="", help="attention shapes to run, e.g. 'Flash decode b64' (default: all)")
    ap.add_argument("--attn-configs", default="",
                    help="JSON list of launch configs swept at the batch-64 decode shapes instead of the built-in "
                         "list, e.g. '[{\"block_h\": 64, \"num_warps\": 8, \"num_stages\": 2, \"num_splits\": 2}]'")
    a = ap.parse_args()
    ATTN_CONFIGS[:] = json.loads(a.attn_configs) if a.attn_configs else []
    CASES[:] = [c.strip() for c in a.cases.split(",") if c.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    measure_ceilings()
    for key, fn in (("norm", bench_norm), ("act", bench_act), ("post", bench_post), ("kv", bench_kv),
                    ("index", bench_indexer), ("topk", bench_topk),
                    ("mhc", bench_mhc), ("attn", bench_attention)):
        if key not in a.only.split(","):
            continue
        try:
            fn(a.quick)
        except Exception:  # noqa: BLE001 - keep the other sections' results
            traceback.print_exc()
            RESULTS.append({"kernel": key, "shape": "-", "variant": "-", "config": {},
                            "error": traceback.format_exc()[-300:]})
        (out / "bench_kernels.json").write_text(json.dumps({"ceilings": CEIL, "results": RESULTS}, indent=1))
        print(f"[{key}] done at {time.time() - t0:.0f}s", flush=True)
    md = markdown()
    (out / "bench_kernels.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
