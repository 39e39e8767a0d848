"""Where the FP4-key FP8-MMA indexer spends its time (H200 diagnosis, not a test): the production kernel's
tile loop rebuilt with parts switched off or swapped, timed at 1M context (262144 keys, 64 heads, d = 128).

    python benchmarks/diag_indexer.py [--out DIR]

Modes (each a variant of the exact-q loop of ``indexer._index_scores_fp8mma_kernel``):
  full        the loop with both bf16 roundings through the conversion unit (the kernel before 2026-12-01)
  no_round    epilogue without the two bf16 round trips (wrong numerics: timing only)
  bf16_math   epilogue rounds once to bf16, ReLU and the weight product in bf16 (numerics under test)
  int_round   bf16 rounding by integer arithmetic on the fp32 bits (numerics under test)
  no_scale    no key block scales (wrong numerics)
  no_unpack   packed bytes reinterpreted as e4m3 without the shuffle (wrong numerics)
  loads_only  loads + shuffle, a row sum stored (no MMA, no epilogue)
  mma_only    loads + shuffle + MMAs, the accumulator's head sum stored (no scale, no epilogue)
  fp32_pipe   bf16 roundings by Veltkamp's split on the FP32 pipe (the production loop since 2026-12-01)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sections.common import time_fn  # noqa: E402

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import indexer  # noqa: E402
from fidelity.decoders.production.kernels._common import INTERPRET  # noqa: E402
from fidelity.decoders.production.kernels.indexer import _k_block_fp8, _query_fp8, _round_bf16  # noqa: E402
from fidelity.model.formats import quantize_fp4  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
MODES = ("full", "no_round", "bf16_math", "int_round", "no_scale", "no_unpack", "loads_only", "mma_only",
         "fp32_pipe")


@triton.jit
def _round_bf16_int(x):
    """fp32 -> nearest-even bf16 value, kept in fp32, by integer arithmetic (NaN kept)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _blk(k_ptr, ks_ptr, krow, kmask, b, stride_k, stride_ks, BLOCK_E: tl.constexpr, UNPACK: tl.constexpr,
         ASM: tl.constexpr = not INTERPRET):
    if UNPACK:
        return _k_block_fp8(k_ptr, ks_ptr, krow, kmask, b, stride_k, stride_ks, BLOCK_E, ASM)
    pk = tl.load(k_ptr + krow[:, None] * stride_k + b * 16 + tl.arange(0, 16)[None, :], mask=kmask[:, None], other=0)
    k8 = tl.reshape(tl.join(pk, pk), [BLOCK_E, 32]).to(tl.float8e4nv, bitcast=True)
    sb = tl.load(ks_ptr + krow * stride_ks + b, mask=kmask, other=127)
    return k8, (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _diag_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, out_ptr, n_keys, stride_qh, stride_k, stride_ks,
                 BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, TILES: tl.constexpr, MODE: tl.constexpr,
                 ASM: tl.constexpr):
    pid_e = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < BLOCK_H
    q0, q1, q2, q3, _, w, _ = _query_fp8(q_ptr, w_ptr, 0, 0, heads, hmask, stride_qh)
    unpack: tl.constexpr = MODE != 5
    for t in range(TILES):
        keys = (pid_e * TILES + t) * BLOCK_E + tl.arange(0, BLOCK_E)
        kmask = keys < n_keys
        krow = keys.to(tl.int64)
        if MODE == 6:
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 0, stride_k, stride_ks, BLOCK_E, True)
            tot = tl.sum(k8.to(tl.float32), axis=1) * ks
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 1, stride_k, stride_ks, BLOCK_E, True)
            tot += tl.sum(k8.to(tl.float32), axis=1) * ks
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 2, stride_k, stride_ks, BLOCK_E, True)
            tot += tl.sum(k8.to(tl.float32), axis=1) * ks
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 3, stride_k, stride_ks, BLOCK_E, True)
            tot += tl.sum(k8.to(tl.float32), axis=1) * ks
            tl.store(out_ptr + keys, tot.to(tl.bfloat16), mask=kmask)
        else:
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 0, stride_k, stride_ks, BLOCK_E, unpack)
            acc = tl.dot(k8, q0)
            if MODE != 4 and MODE != 7:
                acc = acc * ks[:, None]
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 1, stride_k, stride_ks, BLOCK_E, unpack)
            if MODE != 4 and MODE != 7:
                acc += tl.dot(k8, q1) * ks[:, None]
            else:
                acc += tl.dot(k8, q1)
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 2, stride_k, stride_ks, BLOCK_E, unpack)
            if MODE != 4 and MODE != 7:
                acc += tl.dot(k8, q2) * ks[:, None]
            else:
                acc += tl.dot(k8, q2)
            k8, ks = _blk(k_ptr, ks_ptr, krow, kmask, 3, stride_k, stride_ks, BLOCK_E, unpack)
            if MODE != 4 and MODE != 7:
                acc += tl.dot(k8, q3) * ks[:, None]
            else:
                acc += tl.dot(k8, q3)
            if MODE == 7:
                score = tl.sum(acc, axis=1)
            elif MODE == 1:
                score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
            elif MODE == 2:
                s = acc.to(tl.bfloat16)
                s = tl.where(s < 0, 0.0, s).to(tl.bfloat16)
                score = tl.sum((s * w.to(tl.bfloat16)[None, :]).to(tl.float32), axis=1)
            elif MODE == 8:
                s = _round_bf16(acc, ASM)
                s = tl.where(s < 0, 0.0, s)
                score = tl.sum(_round_bf16(s * w[None, :], ASM), axis=1)
            elif MODE == 3:
                s = _round_bf16_int(acc)
                s = tl.where(s < 0, 0.0, s)
                score = tl.sum(_round_bf16_int(s * w[None, :]), axis=1)
            else:
                s = acc.to(tl.bfloat16).to(tl.float32)
                s = tl.where(s < 0, 0.0, s)
                score = tl.sum((s * w[None, :]).to(tl.bfloat16).to(tl.float32), axis=1)
            tl.store(out_ptr + keys, score.to(tl.bfloat16), mask=kmask)


def time_us(fn, sets) -> float:
    """Median device time per call (``kernel_sections.common.time_fn``: CUDA-graph replays rotating over ``sets``)."""
    return 0.0 if INTERPRET else time_fn(fn, sets)["us"]


def _runner(e, h, block_e, tiles, warps, stages, mode):
    def run(q, p, s, w, compiled=False):
        out = torch.empty((e,), dtype=torch.bfloat16, device=q.device)
        k = _diag_kernel[(triton.cdiv(e, block_e * tiles),)](
            q, p, s, w, out, e, q.stride(1), p.stride(0), s.stride(0), BLOCK_H=h, BLOCK_E=block_e,
            TILES=tiles, MODE=mode, ASM=not INTERPRET, num_warps=warps, num_stages=stages)
        return (out, k) if compiled else out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--keys", type=int, default=262144)
    args = ap.parse_args()
    h, d, e = 64, 128, args.keys
    g = torch.Generator(device=DEV).manual_seed(2)
    sets = []
    for _ in range(4):
        q = ops.indexer_round(torch.randn(1, h, d, device=DEV, generator=g), "fp4", rotate=True).to(torch.bfloat16)
        p, s = quantize_fp4(torch.randn(e, d, device=DEV, generator=g), 32)
        w = (torch.randn(1, h, device=DEV, generator=g) * (d**-0.5 * h**-0.5)).to(torch.bfloat16)
        sets.append((q, p, s, w))
    ref = indexer.index_scores_fp4(*sets[0], mma="fp8")
    results = []
    for block_e, tiles, warps, stages in ((128, 8, 4, 3), (128, 4, 4, 3), (64, 8, 4, 3)):
        for mode, name in enumerate(MODES):
            run = _runner(e, h, block_e, tiles, warps, stages, mode)
            try:
                us = time_us(run, sets)
                got, compiled = run(*sets[0], compiled=True)
                r = {"mode": name, "block_e": block_e, "tiles": tiles, "warps": warps, "stages": stages, "us": us,
                     "equal_frac_vs_production": float((got == ref[0]).float().mean()),
                     "regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None)}
            except Exception as exc:  # noqa: BLE001 - report and go on
                r = {"mode": name, "block_e": block_e, "tiles": tiles, "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(r, flush=True)
            results.append(r)
    if args.out:
        Path(args.out, "diag_indexer.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
