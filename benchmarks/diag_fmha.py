"""Where the sparse FMHA decode kernel spends its time (H200 diagnosis, not a test): the production tile loop
rebuilt with parts switched off or reoriented, timed at the Flash decode shape (batch 64, 64 heads, 640 entries).

    python benchmarks/diag_fmha.py [--out DIR]

Modes (each a variant of ``sparse_attention._sparse_attn_kernel``'s bf16-KV loop, no split):
  full        the production loop: S = Q K^T [heads, rows], O += P V            (heads are the MMA's M)
  gather      the row gathers only, a column sum of each tile stored              (no MMA, no softmax)
  gather_max  the row gathers only, an elementwise running max (no per-block cross-thread reduction)
  qk          gathers + S = Q K^T + the online-softmax statistics                  (no P V)
  swap        S^T = K Q^T [rows, heads], O^T += V^T P^T                            (rows are the MMA's M = 64)
  swap_ws     swap with ``tl.range(warp_specialize=True)``                         (Triton's Hopper auto-WS)
A ``_pf`` suffix loads each index block one iteration ahead (what the production kernel does since 2026-12-01).
For every compiled variant the PTX is scanned for the MMA instruction it uses (wgmma or mma.sync) and async
copies, with the register count and spills, so a slow variant can be told apart from a badly lowered one.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sections.attention import decode_sets  # noqa: E402
from kernel_sections.common import _row_calc_diff, time_fn  # noqa: E402

from fidelity.decoders.production import ops  # noqa: E402
from fidelity.decoders.production.kernels import sparse_attention  # noqa: E402
from fidelity.decoders.production.kernels.sparse_attention import BLOCK_N  # noqa: E402


@triton.jit
def _diag_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, topk, n_blocks, scale, stride_qn, stride_qh,
                 stride_kv, stride_in, stride_on, stride_oh, D: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, MODE: tl.constexpr, WS: tl.constexpr, NS: tl.constexpr, PF: tl.constexpr):
    pid_n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dk = tl.arange(0, D)
    q = tl.load(q_ptr + pid_n * stride_qn + heads[:, None] * stride_qh + dk[None, :])
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if MODE == "swap" or MODE == "swap_ws":
        acc = tl.zeros([D, BLOCK_H], tl.float32)
    elif MODE == "gather":
        acc = tl.zeros([D], tl.float32)
    elif MODE == "gather_max":
        acc = tl.full([BLOCK_N, D], float("-inf"), tl.bfloat16)
    else:
        acc = tl.zeros([BLOCK_H, D], tl.float32)
    cols0 = tl.arange(0, BLOCK_N)
    ids_next = tl.load(idx_ptr + pid_n * stride_in + cols0, mask=cols0 < topk, other=-1)
    for j in tl.range(0, n_blocks, 1, num_stages=NS, warp_specialize=WS):
        if PF:  # the next block's indices are loaded one iteration ahead (loop-carried)
            ids = ids_next
            cols = (j + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ids_next = tl.load(idx_ptr + pid_n * stride_in + cols, mask=cols < topk, other=-1)
        else:
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            ids = tl.load(idx_ptr + pid_n * stride_in + cols, mask=cols < topk, other=-1)
        valid = ids >= 0
        rows = tl.where(valid, ids, 0).to(tl.int64)
        k = tl.load(kv_ptr + rows[:, None] * stride_kv + dk[None, :], mask=valid[:, None], other=0.0)
        if MODE == "gather":
            acc += tl.sum(k.to(tl.float32), axis=0)
        elif MODE == "gather_max":
            acc = tl.maximum(acc, k).to(tl.bfloat16)
        elif MODE == "swap" or MODE == "swap_ws":
            s = tl.dot(k, tl.trans(q)) * scale  # [BLOCK_N, BLOCK_H]
            s = tl.where(valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(k), p.to(tl.bfloat16))  # [D, BLOCK_H]
            m_i = m_new
        else:
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if MODE == "full":
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
            m_i = m_new
    sink = tl.load(sink_ptr + heads)
    l_i = l_i + tl.exp(sink - m_i)
    base = o_ptr + pid_n * stride_on
    if MODE == "swap" or MODE == "swap_ws":
        o = acc / l_i[None, :]
        tl.store(base + heads[None, :] * stride_oh + dk[:, None], o.to(tl.bfloat16))
    elif MODE == "gather":
        tl.store(base + dk, acc.to(tl.bfloat16))
    elif MODE == "gather_max":
        tl.store(base + dk, tl.max(acc, axis=0))
    elif MODE == "qk":
        tl.store(base + heads * stride_oh, l_i.to(tl.bfloat16))
    else:
        o = acc / l_i[:, None]
        tl.store(base + heads[:, None] * stride_oh + dk[None, :], o.to(tl.bfloat16))


def launch(mode, q, kv, idx, sink, scale, cfg):
    pf = mode.endswith("_pf")
    mode = mode.removesuffix("_pf")
    n, h, d = q.shape
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    grid = (n, h // cfg["block_h"])
    n_blocks = triton.cdiv(idx.shape[1], BLOCK_N)
    return o, _diag_kernel[grid](q, kv, idx, sink, o, idx.shape[1], n_blocks, scale, q.stride(0), q.stride(1),
                                 kv.stride(0), idx.stride(0), o.stride(0), o.stride(1), D=d, BLOCK_H=cfg["block_h"],
                                 BLOCK_N=BLOCK_N, MODE=mode, WS=mode == "swap_ws", NS=cfg["num_stages"], PF=pf,
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def ptx_facts(compiled) -> dict:
    ptx = compiled.asm.get("ptx", "")
    return {"wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "ld_global": ptx.count("ld.global"),
            "n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None),
            "shared": getattr(compiled.metadata, "shared", None)}


def _c(bh, w, s):
    return {"block_h": bh, "num_warps": w, "num_stages": s}


CONFIGS = {  # the H200 tuning sweep's configurations (git history of BENCHMARKS.md), for reruns
    "full": [_c(16, 4, 2), _c(32, 4, 2), _c(32, 8, 2), _c(64, 8, 2), _c(64, 8, 1), _c(32, 8, 3)],
    "full_pf": [_c(32, 8, 2), _c(32, 8, 3), _c(64, 8, 2)],
    "qk": [_c(32, 8, 2), _c(64, 8, 2)],
    "qk_pf": [_c(32, 4, 2), _c(64, 8, 2)],
    "swap": [_c(16, 4, 2), _c(32, 4, 2), _c(32, 8, 2), _c(64, 8, 2), _c(32, 4, 3)],
    "swap_pf": [_c(16, 4, 3), _c(32, 4, 2), _c(32, 8, 2)],
    "swap_ws": [_c(32, 8, 2), _c(32, 8, 3)],
    "gather": [_c(32, 4, 2), _c(64, 4, 2), _c(64, 4, 3)],
    "gather_pf": [_c(32, 4, 3), _c(64, 4, 2), _c(64, 4, 3), _c(64, 4, 4)],
    "gather_max_pf": [_c(64, 4, 2), _c(64, 4, 3), _c(64, 8, 2), _c(64, 8, 3), _c(32, 8, 3)],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--modes", default=",".join(CONFIGS))
    a = ap.parse_args()
    scale = 512**-0.5
    sets, _ = decode_sets(64, 64, 512, 12, 8192, fp8=False)
    args = [(s["q"], s["cache"], s["idx"], s["sink"]) for s in sets]
    s0 = sets[0]
    ref = ops.sparse_attention(s0["q"], s0["cache"], s0["idx"], s0["sink"], scale)
    t = time_fn(lambda q, c, i, s: sparse_attention.sparse_attention_cuda(q, c, i, s, scale), args)
    results = [{"mode": "production default", "us": t["us"]}]
    t = time_fn(lambda q, c, i, s: c.index_select(0, i.view(-1)), [(*x[:2], x[2].long(), x[3]) for x in args])
    results.append({"mode": "torch index_select of the same rows (reads + writes them)", "us": t["us"]})
    for r in results:
        print(json.dumps(r), flush=True)
    for mode in a.modes.split(","):
        for cfg in CONFIGS[mode]:
            row = {"mode": mode, **cfg}
            try:
                o, compiled = launch(mode, *args[0], scale, cfg)
                row.update(ptx_facts(compiled))
                if mode.removesuffix("_pf") in ("full", "swap", "swap_ws"):
                    row["max_row_calc_diff"] = float(_row_calc_diff(o, ref).max())
                    row["equal_frac"] = float((o == ref).float().mean())
                t = time_fn(lambda *xs, mode=mode, cfg=cfg: launch(mode, *xs, scale, cfg)[0], args)
                row["us"] = t["us"]
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc(limit=1)
            print(json.dumps(row), flush=True)
            results.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_fmha.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
