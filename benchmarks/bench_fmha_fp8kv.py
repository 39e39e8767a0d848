"""Sparse FMHA decode on the 584 B/token FP8 KV layout, in one run on one GPU: the warp-specialized route
(``ws``, its ring depth and prefetch distance swept), the CUDA C++ route (``cuda``: CTA pairs sharing the
dequantized rows, ``kernels/sparse_attention_pair.py``), the Triton route, the bf16 ``ws`` kernel
on the unpacked rows (1024 B a row), and optionally FlashMLA's sm90 MODEL1 sparse FP8 decode kernel (the peer) on
the same timer.

    python benchmarks/bench_fmha_fp8kv.py --out DIR [--peer PATH] [--quick] [--diag] [--diag-cuda]

Cases: V4-Flash (64 heads, 128 window + 512 selected entries) and V4-Pro (128 heads, 128 + 1024) at batch 64 with
one query per sequence and with two (MTP, s_q = 2: 128 query tokens, each with its own indices). Every token owns
a sequence of 128 window rows and 8192 compressed rows (``kernel_sections.attention.decode_sets``).

Before timing, on the benchmark inputs: the ``ws`` FP8 outputs against the bf16 ``ws`` kernel on
``kv_layout.unpack`` rows (bit for bit, each consumer layout), the per-row calc_diff against the emulation (the
``cuda`` route's too, with the fractions of its outputs equal to the emulation's and to ``ws``'s).
Timing: ``kernel_sections.common.time_fn`` (median device time per call of CUDA-graph replays rotating over input
sets that exceed the L2 several times). Floor: bytes (Q, O, 584 B per entry, indices) at the copy bandwidth
measured in the same run, or the FLOPs at the measured bf16 matmul rate, whichever is larger.

``--peer PATH``: a FlashMLA tree with the sm90 MODEL1 decode kernels (built in place with ``setup_min.py
build_ext --inplace`` when ``flash_mla.cuda`` does not import), timed on its own test-case generator
(``tests/lib.py``: a 256-token-page cache for the 128 window entries and a 64-token-page cache for the selected
entries, FP8 584 B rows, fixed lengths so that every index is valid) at the same batch, heads, top-k and s_q,
with the same ``time_fn``. The bundle stays out of the tree.

Also, per shape, one decode token at batch 1 as the production decoder runs it with ``kv_storage=fp8``: the rows
gathered and dequantized into a bf16 workspace, then the bf16 ``ws`` kernel, against ``sparse_attention_fp8kv`` on
the packed store (bit-equality of the two checked).

Writes DIR/bench_fmha_fp8kv.json; prints a markdown table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_sections.attention import decode_sets  # noqa: E402
from kernel_sections.common import CEIL, _n_sets, _row_calc_diff, measure_ceilings, time_fn  # noqa: E402

from fidelity.decoders.production import kv_layout, ops  # noqa: E402
from fidelity.decoders.production.kernels import sparse_attention  # noqa: E402
from fidelity.decoders.production.kernels.sparse_attention_pair import sparse_attention_pair  # noqa: E402
from fidelity.decoders.production.kernels.sparse_attention_ws import sparse_attention_ws  # noqa: E402
from fidelity.decoders.production.kernels.sparse_attention_ws_fp8kv import sparse_attention_ws_fp8kv  # noqa: E402
from fidelity.model.formats import dequantize_fp8  # noqa: E402

SCALE = 512**-0.5
CASES = [("V4-Flash", 64, 512), ("V4-Pro", 128, 1024)]
# (consumers, bf16 slots, L2 prefetch distance in blocks, two consumers' halves loaded one ahead): layouts that fit
# the shared memory
WS_RINGS = [(1, 5, 0, None), (1, 5, 1, None), (1, 5, 2, None), (1, 4, 1, None), (1, 3, 1, None),
            (2, 4, 0, False), (2, 4, 1, False), (2, 4, 2, False), (2, 3, 1, False),
            (2, 4, 0, True), (2, 4, 1, True), (2, 4, 2, True), (2, 3, 1, True)]
# --quick: the two-consumer producer's fill orders alone, at the default ring
QUICK_RINGS = [(2, None, None, False), (2, None, None, True)]
# (consumers, two consumers' halves loaded one ahead) checked and diagnosed; one consumer where 64 heads do not divide
LAYOUTS, ONE_CONSUMER = ((1, None), (2, False), (2, True)), ((1, None),)
# --diag: the kernel with parts switched off (wrong results by design; PARTS bits of the kernel module): the
# producers' loads (1), the consumers' math (2), dequantization and stores (4), the producers' proxy fence (8)
DIAG_PARTS = {"all": 15, "no fence": 7, "no math": 13, "no gathers": 14, "math only": 10, "none": 8}
# route cuda with parts switched off (``sparse_attention_pair``'s bits: row copies 1, math 2, dequantization and
# stores 4)
CUDA_DIAG_PARTS = {"all": 7, "producers only (no math)": 5, "math only": 2, "no dequant": 3, "no loads": 6,
                   "none (handshakes)": 0}
ROWS: list[dict] = []


def check(s0: dict, heads: int) -> dict:
    """The ``ws`` FP8 route against the bf16 ``ws`` kernel on the unpacked rows and against the emulation."""
    rows = kv_layout.unpack(s0["packed"], 512, 64)
    ref = ops.sparse_attention(s0["q"], rows, s0["idx"], s0["sink"], SCALE)
    out = {}
    for nc, ahead in LAYOUTS if heads % 64 == 0 else ONE_CONSUMER:
        got = sparse_attention.sparse_attention_fp8kv(s0["q"], s0["packed"], s0["idx"], s0["sink"], SCALE,
                                                      config={"consumers": nc, "ahead": ahead})
        bf16 = sparse_attention_ws(s0["q"], rows, s0["idx"], s0["sink"], SCALE, consumers=nc)
        out[f"consumers={nc}" + ("" if ahead is None else f" ahead={int(ahead)}")] = {
            "bit_equal_to_bf16_ws_on_unpacked_rows": bool(torch.equal(got.view(torch.int16), bf16.view(torch.int16))),
            "max_row_calc_diff_vs_emulation": float(_row_calc_diff(got, ref).max()),
            "bf16_equal_frac_vs_emulation": float((got == ref).float().mean())}
    tri = sparse_attention.sparse_attention_fp8kv(s0["q"], s0["packed"], s0["idx"], s0["sink"], SCALE,
                                                  config={"route": "triton"})
    out["triton_max_row_calc_diff_vs_emulation"] = float(_row_calc_diff(tri, ref).max())
    why = sparse_attention._cuda_refusal(s0["q"], s0["packed"], s0["idx"], "fp8-kv")
    if why is None:
        pair = sparse_attention.sparse_attention_fp8kv(s0["q"], s0["packed"], s0["idx"], s0["sink"], SCALE,
                                                       config={"route": "cuda"})
        ws = sparse_attention.sparse_attention_fp8kv(s0["q"], s0["packed"], s0["idx"], s0["sink"], SCALE,
                                                     config={"route": "ws"})
        out["cuda"] = {"max_row_calc_diff_vs_emulation": float(_row_calc_diff(pair, ref).max()),
                       "bf16_equal_frac_vs_emulation": float((pair == ref).float().mean()),
                       "bf16_equal_frac_vs_ws": float((pair == ws).float().mean())}
    else:
        out["cuda"] = {"refusal": why}
    return out


def floor_us(n_tokens: int, heads: int, entries: int) -> dict:
    bytes_ = n_tokens * (2 * heads * 512 * 2 + entries * (584 + 4))
    flops = 2 * n_tokens * heads * entries * 1024
    return {"bytes": bytes_, "flops": flops, "us": max(bytes_ / CEIL["bw"], flops / CEIL["bf16"]) * 1e6,
            "bound": "memory" if bytes_ / CEIL["bw"] > flops / CEIL["bf16"] else "bf16 MMA"}


def time_ours(name: str, heads: int, topk: int, s_q: int, quick: bool, diag: bool, diag_cuda: bool) -> None:
    n = 64 * s_q
    entries = 128 + topk
    sets, _ = decode_sets(n, heads, topk, _n_sets(n * entries * 584, hi=16), 8192, fp8=True)
    for s in sets:
        s["rows"] = kv_layout.unpack(s["packed"], 512, 64)
    fl = floor_us(n, heads, entries)
    case = f"{name} b64 s_q={s_q}"
    checks = check(sets[0], heads)
    print(f"[check] {case}: {json.dumps(checks)}", flush=True)
    args8 = [(s["q"], s["packed"], s["idx"], s["sink"]) for s in sets]
    args16 = [(s["q"], s["rows"], s["idx"], s["sink"]) for s in sets]
    variants = [("ws FP8 (default)", {"route": "ws"}, args8)]
    variants += [(f"ws FP8 c{c} slots {ns} prefetch {pf}" + ("" if ah is None else f" ahead {int(ah)}"),
                  {"route": "ws", "consumers": c, "slots": ns, "prefetch": pf, "ahead": ah}, args8)
                 for c, ns, pf, ah in (QUICK_RINGS if quick else WS_RINGS) if heads % (32 * c) == 0]
    variants += [("CUDA pairs FP8 (route cuda)", {"route": "cuda"}, args8)] if "refusal" not in checks["cuda"] else []
    variants += [("Triton FP8", {"route": "triton"}, args8), ("ws bf16 rows (1024 B)", {"route": "ws"}, args16)]
    for label, cfg, args in variants:
        fn = (sparse_attention.sparse_attention_cuda if args is args16 else sparse_attention.sparse_attention_fp8kv)
        try:
            t = time_fn(lambda q, kv, i, s, fn=fn, cfg=cfg: fn(q, kv, i, s, SCALE, config=cfg), args)
        except Exception as exc:  # noqa: BLE001 - a ring that does not fit is reported, not fatal
            t = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row = {"case": case, "variant": label, **t, "floor_us": fl["us"], "floor_bound": fl["bound"],
               "checks": checks}
        if "us" in t:
            row["frac_of_floor"] = fl["us"] / t["us"]
        ROWS.append(row)
        print(f"[time] {case} {label}: {t.get('us', float('nan')):.2f} us {t.get('error', '')}", flush=True)
    if diag_cuda and "refusal" not in checks["cuda"]:
        for label, parts in CUDA_DIAG_PARTS.items():
            t = time_fn(lambda q, kv, i, s, parts=parts: sparse_attention_pair(q, kv, i, s, SCALE, parts=parts), args8)
            ROWS.append({"case": case, "variant": f"diag cuda: {label}", **t, "floor_us": fl["us"],
                         "floor_bound": fl["bound"]})
            print(f"[diag] {case} cuda {label}: {t['us']:.2f} us", flush=True)
    if diag:
        for c, ah in LAYOUTS if heads % 64 == 0 else ONE_CONSUMER:
            layout = f"c{c}" + ("" if ah is None else f" ahead {int(ah)}")
            for label, parts in DIAG_PARTS.items():
                t = time_fn(lambda q, kv, i, s, c=c, ah=ah, parts=parts: sparse_attention_ws_fp8kv(
                    q, kv, i, s, SCALE, consumers=c, ahead=ah, parts=parts), args8)
                ROWS.append({"case": case, "variant": f"diag {layout}: {label}", **t, "floor_us": fl["us"],
                             "floor_bound": fl["bound"]})
                print(f"[diag] {case} {layout} {label}: {t['us']:.2f} us", flush=True)
    del sets, args8, args16
    torch.cuda.empty_cache()


def time_decode_step(name: str, heads: int, topk: int) -> None:
    """One decode token (batch 1) of a layer with ``kv_storage=fp8``: the gather path (the visible rows gathered
    and dequantized into a bf16 workspace as ``KVStore.read_into`` does, then the bf16 ``ws`` kernel on local
    indices) against ``sparse_attention_fp8kv`` on the packed store with the cache slots (what decode runs)."""
    sets, _ = decode_sets(1, heads, topk, 16, 32768, fp8=True)
    buf = torch.empty(128 + topk, 512, dtype=torch.bfloat16, device="cuda")
    local = torch.arange(128 + topk, device="cuda")[None]

    def gather_path(q, packed, idx, sink):
        slots = idx[0].long()
        codes, rope, scales = kv_layout.views(packed, 512, 64)
        buf[:, :448] = dequantize_fp8(codes[slots], scales[slots], 64)
        buf[:, 448:] = rope[slots]
        return sparse_attention.sparse_attention_cuda(q, buf, local, sink, SCALE)

    args = [(s["q"], s["packed"], s["idx"], s["sink"]) for s in sets]
    same = torch.equal(gather_path(*args[0]), sparse_attention.sparse_attention_fp8kv(*args[0], SCALE))
    def packed_path(q, packed, idx, sink):
        return sparse_attention.sparse_attention_fp8kv(q, packed, idx, sink, SCALE)

    for label, fn in (("decode b1: gather + dequantize, bf16 ws", gather_path),
                      ("decode b1: ws FP8 on the packed rows", packed_path)):
        t = time_fn(fn, args)
        fl = floor_us(1, heads, 128 + topk)
        ROWS.append({"case": f"{name} b1 s_q=1", "variant": label, **t, "floor_us": fl["us"],
                     "floor_bound": fl["bound"], "frac_of_floor": fl["us"] / t["us"], "bit_equal_paths": same})
        print(f"[decode] {name} {label}: {t['us']:.2f} us (eager {t.get('eager_us', float('nan')):.2f}), "
              f"bit-equal {same}", flush=True)


def load_peer(path: Path):
    """Import FlashMLA from ``path`` (built in place when its extension does not import)."""
    sys.path[:0] = [str(path), str(path / "tests")]
    try:
        import flash_mla.cuda  # noqa: F401
    except ImportError:
        print(f"[peer] building {path} (setup_min.py build_ext --inplace)", flush=True)
        subprocess.run([sys.executable, "setup_min.py", "build_ext", "--inplace"], cwd=path, check=True,
                       stdout=subprocess.DEVNULL)
    import flash_mla
    import lib
    return flash_mla, lib


def time_peer(path: Path, quick: bool) -> None:
    flash_mla, lib = load_peer(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the peer's generator makes its tensors in the default dtype / device
    torch.set_default_device("cuda")
    try:
        for name, heads, topk in CASES:
            for s_q in (1, 2):
                sets = []
                for i in range(3 if quick else 6):
                    p = lib.RawTestParamForDecode(b=64, h_q=heads, s_q=s_q, h_kv=1, s_kv=16384, is_varlen=False,
                                                  topk=128, d_qk=512, extra_s_k=16384, extra_topk=topk,
                                                  block_size=256, extra_block_size=64, seed=1000 + i
                                                  ).to_test_param()
                    sets.append((p, lib.generate_testcase_for_decode(p), flash_mla.get_mla_metadata()[0]))
                t = time_fn(lambda p, tc, meta: lib.run_flash_mla_decode(p, tc, meta, None), sets)
                fl = floor_us(64 * s_q, heads, 128 + topk)
                ROWS.append({"case": f"{name} b64 s_q={s_q}", "variant": "FlashMLA sm90 MODEL1 (peer)", **t,
                             "floor_us": fl["us"], "floor_bound": fl["bound"], "frac_of_floor": fl["us"] / t["us"]})
                print(f"[peer] {name} s_q={s_q}: {t['us']:.2f} us", flush=True)
                del sets
                torch.cuda.empty_cache()
    finally:
        torch.set_default_dtype(default)
        torch.set_default_device(None)


def table() -> str:
    lines = ["| case | variant | us | frac of floor | floor (bound) |", "|---|---|---|---|---|"]
    for r in ROWS:
        us = f"{r['us']:.2f}" if "us" in r else r.get("error", "")
        frac = f"{r['frac_of_floor']:.2f}" if "frac_of_floor" in r else ""
        lines.append(f"| {r['case']} | {r['variant']} | {us} | {frac} | {r['floor_us']:.2f} ({r['floor_bound']}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--peer", type=Path, help="a FlashMLA tree with the sm90 MODEL1 decode kernels")
    ap.add_argument("--quick", action="store_true",
                    help="no ring sweep (the two-consumer fill orders only), fewer peer input sets")
    ap.add_argument("--diag", action="store_true", help="also time the kernel with parts switched off")
    ap.add_argument("--diag-cuda", action="store_true", help="also time route cuda with parts switched off")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    measure_ceilings()
    print(f"[ceilings] {CEIL}", flush=True)
    for name, heads, topk in CASES:
        for s_q in (1, 2):
            time_ours(name, heads, topk, s_q, a.quick, a.diag, a.diag_cuda)
        time_decode_step(name, heads, topk)
    if a.peer:
        try:
            time_peer(a.peer.resolve(), a.quick)
        except Exception:  # noqa: BLE001 - our rows stand without the peer's
            print(traceback.format_exc(), flush=True)
            ROWS.append({"case": "peer", "variant": "FlashMLA", "error": traceback.format_exc()[-600:],
                         "floor_us": float("nan"), "floor_bound": ""})
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "ceilings": CEIL, "rows": ROWS}
    (a.out / "bench_fmha_fp8kv.json").write_text(json.dumps(info, indent=1, default=str))
    print(table())


if __name__ == "__main__":
    main()
