"""Indexer scores (bf16 keys; FP4 keys on bf16 / FP8 tensor cores, the ``ws`` kernel) at 128K / 1M-context
decode and a prefill chunk; peers: the torch emulation and transformers' fp32 eager."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import indexer
from fidelity.model.formats import dequantize_fp4, quantize_fp4
from kernel_sections.common import BF16, DEV, _n_sets, record, sweep, time_fn


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
            kb = dequantize_fp4(packed, sc, 32).to(BF16)
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
        sets.append((q, dequantize_fp4(packed, sc, 32).to(BF16), w))
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
