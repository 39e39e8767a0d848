"""Sparse attention at V4-Flash / V4-Pro decode and prefill shapes: bf16 KV (routes ``ws`` and ``triton``),
the 584 B/token FP8 KV layout, the e4m3 profile; peers: the torch emulation and a transformers-style dense eager."""

from __future__ import annotations

import torch

from fidelity.decoders.production import kv_layout, ops
from fidelity.decoders.production.kernels import sparse_attention
from kernel_sections.common import BF16, DEV, _n_sets, _row_calc_diff, record, sweep, time_fn

ATTN_CONFIGS: list[dict] = []  # --attn-configs: replaces the decode launch-config sweep
WS_ROUTES = [{"route": "ws"}, {"route": "ws", "consumers": 1}, {"route": "ws", "consumers": 2}]  # default, forced


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
        packed = kv_layout.pack(cache, 64) if fp8 else None
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
        extra = [] if ATTN_CONFIGS else [dict(cfgs512[i], num_splits=2) for i in (3, 5) if i < len(cfgs512)]
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
