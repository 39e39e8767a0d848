"""Sparse FMHA (spec §3 ``sparse_attn``) in Triton: decode and prefill, shared K = V rows, per-head sink.

Semantics are those of :func:`fidelity.decoders.production.ops.sparse_attention` (the CPU emulation):

* q [n, H, d] bf16, kv [m, d] bf16 (K = V, one KV head), idx [n, K] int (-1 = masked), sink [H] fp32;
* online softmax over consecutive blocks of 64 indices in idx order: ``s = (q . k) * scale`` with fp32
  accumulation, running max / sum in fp32, ``P = exp(s - m)`` rounded to bf16 before ``P . V`` (fp32
  accumulation), the denominator keeps fp32 P; a -1 index loads no row (the tile row is 0, its logit -inf);
* after the loop ``sum += exp(sink - m)`` (sink in the denominator only), ``o = acc / sum`` rounded to bf16.

One program handles one query token and ``BLOCK_H`` heads (MQA: every head of a token reads the same gathered
rows, so a tile of 64 rows feeds ``BLOCK_H`` heads), optionally one slice of the output dims (``split_d``:
the QK product over all d is recomputed per slice, the P.V accumulator shrinks) and optionally one chunk of
the index blocks (``num_splits`` > 1, flash-decoding: partial (acc, max, sum) combined by a second kernel;
this changes the reference max against which P is rounded to bf16, so it is opt-in, default off).

Profile ``fp8-fmha`` (``fmt="fp8"``): Q and the K/V rows fake-quantized to e4m3 with 1x64 ue8m0 blocks and P
rounded to e4m3, as ``ops.sparse_attention(..., fmt="fp8")``. The kernel quantizes q once per program and each
gathered tile in registers (bit-exact with ``formats.fake_quant_fp8``: the same ``e4m3_blocks`` as the fused
RMSNorm + FP8 kernel) and rounds P with the hardware's RNE e4m3 conversion. The MMAs run on bf16 tensor cores:
every operand value is an e4m3 code times a power of two, exact in bf16, so each product is exact and the
sums are fp32, as in an FP8 MMA with fp32 accumulation. FP8 tensor-core MMAs proper were not used: P.V would
need the rows' per-64-dim scales (which vary along its reduction axis, the rows) folded into P, and those
products leave e4m3's range, so P would no longer be the emulation's e4m3-rounded P.

FP8 KV (``sparse_attention_fp8kv``): the 584 B/token production layout, per row
``[448 e4m3 nope | 64 bf16 rope (128 B) | 7 ue8m0 scale bytes (per 64 nope dims) | 1 pad]``, dequantized
once per tile in registers (``e4m3 * 2^(b-127)`` is exact in bf16, so the tile equals the bf16 kernel's tile on
``ops.kv_round(kv, 64, "fp8")`` rows; the MMA then reads it from registers instead of shared memory, so the fp32
sums may round differently: equal up to rare bf16 flips, not bit-identical on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from fidelity.decoders.production.kernels._common import (
    PDL_LAUNCH,
    UNSUPPORTED,
    e4m3_blocks,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
    with_overrides,
    ws_refusal,
)

BLOCK_N = 64  # indices per online-softmax step: the reference's block (fixes where P is rounded)
FP8_ROW_BYTES = 584
FP8_NOPE = 448
FP8_ROPE = 64


@triton.jit
def _kv_tile(kv_ptr, kv16_ptr, rows, valid, c0, stride_kv, C: tl.constexpr, FP8: tl.constexpr):
    """Rows ``rows`` (int64 [BN]) of the cache, columns c0 .. c0+C-1, as bf16 [BN, C]; invalid rows are 0."""
    cols = c0 + tl.arange(0, C)
    if FP8:
        base = rows[:, None] * 584
        is_nope = cols[None, :] < 448
        u8 = tl.load(kv_ptr + base + cols[None, :], mask=valid[:, None] & is_nope, other=0)
        sc_idx = c0 // 64 + tl.arange(0, C // 64)
        sb = tl.load(kv_ptr + base + 576 + sc_idx[None, :], mask=valid[:, None] & (sc_idx[None, :] < 7), other=127)
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(b-127), exact for b in 1..254
        nope = u8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        nope = tl.reshape(tl.reshape(nope, [rows.shape[0], C // 64, 64]) * scale[:, :, None], [rows.shape[0], C])
        rope = tl.load(kv16_ptr + rows[:, None] * 292 + 224 + (cols[None, :] - 448),
                       mask=valid[:, None] & (cols[None, :] >= 448), other=0.0)
        return tl.where(is_nope, nope, rope.to(tl.float32)).to(tl.bfloat16)
    else:
        return tl.load(kv_ptr + rows[:, None] * stride_kv + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _fake_e4m3(x, R: tl.constexpr, C: tl.constexpr):
    """``formats.fake_quant_fp8(x, 64)`` of a [R, C] tile (C a multiple of 64) as bf16: e4m3 codes times their
    block's ue8m0 scale (exact in bf16)."""
    codes, _, s = e4m3_blocks(tl.reshape(x.to(tl.float32), [R * (C // 64), 64]))
    return tl.reshape(codes.to(tl.float32) * s[:, None], [R, C]).to(tl.bfloat16)


@triton.jit(do_not_specialize=["n_tokens", "n_heads", "topk", "blocks_per_split"])
def _sparse_attn_kernel(q_ptr, kv_ptr, kv16_ptr, idx_ptr, sink_ptr, o_ptr, acc_ptr, ml_ptr,
                        n_tokens, n_heads, topk, blocks_per_split, scale,
                        stride_qn, stride_qh, stride_kv, stride_in, stride_on, stride_oh,
                        D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, PREFETCH: tl.constexpr, E4M3: tl.constexpr):
    wait_for_previous_kernel()
    pid_n = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_z = tl.program_id(2)
    pid_d = pid_z // NUM_SPLITS
    pid_s = pid_z % NUM_SPLITS
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dk = tl.arange(0, D)
    q = tl.load(q_ptr + pid_n * stride_qn + heads[:, None] * stride_qh + dk[None, :], mask=hmask[:, None], other=0.0)
    if E4M3:
        q = _fake_e4m3(q, BLOCK_H, D)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    start = pid_s * blocks_per_split * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    ids_next = tl.load(idx_ptr + pid_n * stride_in + cols, mask=cols < topk, other=-1)
    for j in range(0, blocks_per_split):
        if PREFETCH:  # indices one block ahead (loop-carried): the pipeliner starts the next row gather at once
            ids = ids_next
            cols = start + (j + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ids_next = tl.load(idx_ptr + pid_n * stride_in + cols, mask=cols < topk, other=-1)
        else:
            cols = start + j * BLOCK_N + tl.arange(0, BLOCK_N)
            ids = tl.load(idx_ptr + pid_n * stride_in + cols, mask=cols < topk, other=-1)
        valid = ids >= 0
        rows = tl.where(valid, ids, 0).to(tl.int64)
        k = _kv_tile(kv_ptr, kv16_ptr, rows, valid, 0, stride_kv, D, FP8)
        if E4M3:
            k = _fake_e4m3(k, BLOCK_N, D)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid logit yet: keep exp() finite
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DV == D:
            v = k
        else:
            v = _kv_tile(kv_ptr, kv16_ptr, rows, valid, pid_d * DV, stride_kv, DV, FP8)
            if E4M3:
                v = _fake_e4m3(v, BLOCK_N, DV)
        if E4M3:  # P on the e4m3 grid (RNE; p <= 1, so no saturation), exact in bf16
            pm = p.to(tl.float8e4nv).to(tl.float32).to(tl.bfloat16)
        else:
            pm = p.to(tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(pm, v)
        m_i = m_new
    dv = pid_d * DV + tl.arange(0, DV)
    if NUM_SPLITS == 1:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        l_i = l_i + tl.exp(sink - m_i)
        o = acc / l_i[:, None]
        tl.store(o_ptr + pid_n * stride_on + heads[:, None] * stride_oh + dv[None, :], o.to(tl.bfloat16),
                 mask=hmask[:, None])
    else:
        # partials: acc [S, n, H, D] fp32, ml [S, n, H, 2] fp32 (running max, running sum)
        row = (pid_s * n_tokens + pid_n) * n_heads + heads
        tl.store(acc_ptr + row[:, None] * D + dv[None, :], acc, mask=hmask[:, None])
        if pid_d == 0:
            tl.store(ml_ptr + row * 2, m_i, mask=hmask)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, sink_ptr, o_ptr, n_tokens, n_heads, num_splits, stride_on, stride_oh,
                    D: tl.constexpr, BLOCK_H: tl.constexpr):
    wait_for_previous_kernel()
    pid_n = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dk = tl.arange(0, D)
    m_tot = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        row = (s * n_tokens + pid_n) * n_heads + heads
        m_tot = tl.maximum(m_tot, tl.load(ml_ptr + row * 2, mask=hmask, other=float("-inf")))
    m_use = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    l_tot = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for s in range(num_splits):
        row = (s * n_tokens + pid_n) * n_heads + heads
        w = tl.exp(tl.load(ml_ptr + row * 2, mask=hmask, other=float("-inf")) - m_use)
        l_tot += w * tl.load(ml_ptr + row * 2 + 1, mask=hmask, other=0.0)
        acc += w[:, None] * tl.load(acc_ptr + row[:, None] * D + dk[None, :], mask=hmask[:, None], other=0.0)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    l_tot = l_tot + tl.exp(sink - m_tot)
    o = acc / l_tot[:, None]
    tl.store(o_ptr + pid_n * stride_on + heads[:, None] * stride_oh + dk[None, :], o.to(tl.bfloat16),
             mask=hmask[:, None])


def _config(block_h: int, num_warps: int, num_stages: int, *, split_d: int = 1, prefetch: bool = False) -> dict:
    return {"block_h": block_h, "split_d": split_d, "num_splits": 1, "num_warps": num_warps,
            "num_stages": num_stages, "prefetch": prefetch}


def default_config_fp8(n_tokens: int, n_heads: int, d: int, topk: int) -> dict:
    """FP8-KV launch parameters (the dequantized tile needs more shared memory: one pipeline stage, except at
    128-head decode, where 64 heads per program fit two (faster at Pro decode b64); 64 heads per
    program amortize the dequantization over more heads)."""
    if n_heads <= 16:
        return _config(16, 4, 1)
    if n_tokens > 256:
        return _config(64, 8, 1)
    if n_heads >= 128:
        return _config(64, 8, 2)
    return _config(64, 8, 1, split_d=2)


def default_config(n_tokens: int, n_heads: int, d: int, topk: int) -> dict:
    """Launch parameters, from the H200 sweep in ``benchmarks/bench_kernels.py`` (BENCHMARKS.md): d=512 long
    prefill: 64 heads per program, 1 stage; 128 heads decode: 64 heads, 2 stages; 64 heads decode: 32 heads,
    3 stages; few heads: 16. Never split-KV by default (it changes the max against which P is rounded to bf16).
    ``prefetch`` loads each index block one loop iteration ahead: on for d=512 with 64 or more heads (faster
    at Flash decode b64, neutral at batch 1 and in prefill), off where not measured (d <= 128, 16 heads) and on
    the FP8 layout (slower there)."""
    if d <= 128:
        return _config(max(16, min(next_pow2(n_heads), 64)), 4, 1)
    if n_heads <= 16:
        return _config(16, 4, 1)
    if n_tokens > 256:
        return _config(64, 8, 1, prefetch=True)
    if n_heads >= 128:
        return _config(64, 8, 2, prefetch=True)
    return _config(32, 8, 3, prefetch=True)


def _launch(q, kv_main, kv16, idx, sink, scale, d, fp8, cfg, e4m3=False):
    n, h, dq = q.shape
    topk = idx.shape[1]
    o = torch.empty((n, h, d), dtype=torch.bfloat16, device=q.device)
    if n == 0 or h == 0:
        return o
    # at d = 512 the e4m3 profile quantizes each tile in registers, as the FP8 layout dequantizes it: same launch
    c = with_overrides((default_config_fp8 if fp8 or (e4m3 and d > 128) else default_config)(n, h, d, topk), cfg)
    block_h, split_d, num_splits = c["block_h"], c["split_d"], c["num_splits"]
    if e4m3 and (d // split_d) % 64:
        raise ValueError(f"fmt='fp8' quantizes 64-dim blocks: head_dim / split_d must be a multiple of 64, found "
                         f"{d} / {split_d}")
    n_blocks = triton.cdiv(topk, BLOCK_N)
    num_splits = max(1, min(num_splits, n_blocks))
    per_split = triton.cdiv(n_blocks, num_splits)
    num_splits = max(1, triton.cdiv(n_blocks, max(per_split, 1)))
    q = q.contiguous()
    idx = idx.to(torch.int32).contiguous()
    sink = sink.to(torch.float32).contiguous()
    if num_splits > 1:
        acc = torch.empty((num_splits, n, h, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((num_splits, n, h, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = o
    grid = (n, triton.cdiv(h, block_h), split_d * num_splits)
    # a default stage count that does not fit next to overridden parameters (e.g. split_d) shrinks; stages
    # asked for explicitly do not (a config sweep must time what it names)
    lowest = c["num_stages"] if (cfg or {}).get("num_stages") is not None else 1
    for stages in range(c["num_stages"], lowest - 1, -1):
        try:
            _sparse_attn_kernel[grid](
                q, kv_main, kv16, idx, sink, o, acc, ml, n, h, topk, per_split, scale,
                q.stride(0), q.stride(1), kv_main.stride(0), idx.stride(0), o.stride(0), o.stride(1),
                D=d, DV=d // split_d, BLOCK_H=block_h, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits, FP8=fp8,
                PREFETCH=bool(c["prefetch"]), E4M3=e4m3, num_warps=c["num_warps"], num_stages=stages, **PDL_LAUNCH)
            break
        except OutOfResources:
            if stages == lowest:
                raise
    if num_splits > 1:
        _combine_kernel[(n, triton.cdiv(h, block_h))](
            acc, ml, sink, o, n, h, num_splits, o.stride(0), o.stride(1), D=d, BLOCK_H=block_h, num_warps=4,
            **PDL_LAUNCH)
    return o


def _supported(q, kv, idx) -> bool:
    d = q.shape[-1]
    return (on_device(q) and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and q.dim() == 3
            and kv.dim() == 2 and kv.shape[1] == d and d in (16, 32, 64, 128, 256, 512) and idx.dim() == 2)


def takes_sparse_attention(q, kv, idx, sink, scale, fmt="bf16") -> str | None:
    """Why :func:`sparse_attention_cuda` cannot take these inputs (None: it can): bf16 q [n, H, d], kv [m, d],
    d a power of two in 16..512, fmt "bf16" or "fp8" (d a multiple of 64)."""
    if fmt not in ("bf16", "fp8"):
        return f"fmt {fmt!r}"
    if not _supported(q, kv, idx):
        return UNSUPPORTED
    if fmt == "fp8" and q.shape[-1] % 64:
        return "fmt 'fp8' with a head_dim that is not a multiple of 64"
    return None


def sparse_attention_cuda(q, kv, idx, sink, scale, fmt="bf16", *, config=None):
    """CUDA-tensor entry point; same signature and result as ``ops.sparse_attention``, ``fmt`` "bf16" or "fp8"
    (profile ``fp8-fmha``: e4m3 Q, K/V and P; head_dim a multiple of 64; :func:`takes_sparse_attention`). Two
    kernel routes (:func:`route_sparse_attention` names the one taken): ``ws``, the
    warp-specialized Gluon kernel (``kernels/sparse_attention_ws.py``; bf16 d = 512 on sm_90), and
    ``triton``, this module's kernel; see :func:`_route`."""
    route, launch = _route(q, kv, idx, fmt, config)
    if route == "ws":
        from fidelity.decoders.production.kernels.sparse_attention_ws import sparse_attention_ws
        return sparse_attention_ws(q, kv, idx, sink, scale, **launch)
    kv = kv.contiguous()
    return _launch(q, kv, kv, idx, sink, float(scale), q.shape[-1], False, launch, fmt == "fp8")


def _ws_refusal(q, kv, idx, fmt) -> str | None:
    """Why the warp-specialized kernel cannot take these inputs (None: it can); ``fmt`` "fp8-kv" is the 584 B
    layout's kernel (``kernels/sparse_attention_ws_fp8kv.py``)."""
    if fmt == "fp8-kv":
        return ws_refusal("sparse_attention_ws_fp8kv", q, kv, idx)
    if fmt != "bf16":
        return f"fmt {fmt!r} (it runs the bf16 profile)"
    return ws_refusal("sparse_attention_ws", q, kv, idx)


# route ``cuda`` (the CUDA C++ kernel) is the FP8 KV layout's default for a multiple of this many heads (None: never)
CUDA_DEFAULT_HEADS: int | None = None
# the warp-specialized kernels' launch parameters: 1 or 2 consumer warpgroups; the FP8 layout's ring depths
WS_LAUNCH = {
    "bf16": ("consumers",),
    "fp8-kv": ("consumers", "slots", "prefetch", "ahead"),
}


def _cuda_refusal(q, kv, idx, fmt) -> str | None:
    """Why the CUDA C++ kernel (``kernels/sparse_attention_pair.py``) cannot take these inputs (None: it can); it
    runs the FP8 KV layout only."""
    if fmt != "fp8-kv":
        return f"fmt {fmt!r} (it runs the 584 B FP8 KV layout)"
    from fidelity.decoders.production.kernels.sparse_attention_pair import refusal
    return refusal(q, kv, idx)


def _cuda_default(q, kv, idx, fmt) -> bool:
    """Whether route ``cuda`` is the default for these inputs: the FP8 KV layout with a multiple of
    ``CUDA_DEFAULT_HEADS`` heads (the shapes where it measured faster than ``ws``, BENCHMARKS.md), where it runs."""
    return (CUDA_DEFAULT_HEADS is not None and fmt == "fp8-kv" and q.dim() == 3
            and q.shape[1] % CUDA_DEFAULT_HEADS == 0 and _cuda_refusal(q, kv, idx, fmt) is None)


def _route(q, kv, idx, fmt, config) -> tuple[str, dict | None]:
    """``("cuda", None)``, ``("ws", its launch parameters)`` or ``("triton", launch parameters)``.
    ``config={"route": "cuda" | "ws" | "triton"}`` picks one; without it, the CUDA C++ kernel runs where it is the
    default (:func:`_cuda_default`), else the warp-specialized kernel where it can (the faster route,
    BENCHMARKS.md) unless Triton launch parameters are given. ``WS_LAUNCH`` lists the ``ws`` kernels' own."""
    launch = dict(config or {})
    route = launch.pop("route", None)
    if route == "cuda" or (route is None and not launch and _cuda_default(q, kv, idx, fmt)):
        refusal = _cuda_refusal(q, kv, idx, fmt)
        if refusal or launch:
            raise ValueError(f"sparse_attention: route 'cuda' cannot run: "
                             f"{refusal or f'it takes no launch parameters, found {sorted(launch)}'}")
        return "cuda", None
    ws_launch = {k: launch.pop(k) for k in WS_LAUNCH.get(fmt, WS_LAUNCH["bf16"]) if k in launch}
    if route not in (None, "ws", "triton"):
        raise ValueError(f"sparse_attention: config route must be 'cuda', 'ws' or 'triton', found {route!r}")
    refusal = None if route == "triton" else _ws_refusal(q, kv, idx, fmt)
    if route == "ws" and (refusal or launch):
        raise ValueError(f"sparse_attention: route 'ws' cannot run: "
                         f"{refusal or f'it takes no Triton launch parameters, found {sorted(launch)}'}")
    if route != "triton" and refusal is None and not launch:
        return "ws", ws_launch
    if ws_launch:
        why = ("config route 'triton'" if route else f"Triton launch parameters {sorted(launch)} given" if launch
               else refusal)
        raise ValueError(f"sparse_attention: {sorted(ws_launch)} is a parameter of route 'ws', which does not run "
                         f"here ({why})")
    return "triton", launch or None


def route_sparse_attention(q, kv, idx, sink, scale, fmt="bf16") -> str:
    """The route :func:`sparse_attention_cuda` takes for these inputs: ``ws`` or ``triton``."""
    return _route(q, kv, idx, fmt, None)[0]


# ---------------------------------------------------------------------------------------------------------------
# FP8 KV cache layout (584 B per token: [448 e4m3 | 64 bf16 rope | 7 ue8m0 | 1 pad], ``kv_layout``)
# ---------------------------------------------------------------------------------------------------------------


def sparse_attention_fp8kv(q, kv_packed, idx, sink, scale, *, config=None):
    """``sparse_attention`` reading the 584 B/token FP8 cache (uint8 [m, 584], ``kv_layout.pack``);
    q [n, H, 512] bf16 on CUDA. Routes (:func:`_route`): ``cuda`` (``kernels/sparse_attention_pair.py``, CUDA C++
    CTA pairs sharing the dequantized rows; ``config={"route": "cuda"}``, or by default where
    ``CUDA_DEFAULT_HEADS`` says), ``ws`` (``kernels/sparse_attention_ws_fp8kv.py``, dequantizing in its producer
    partition; its outputs equal the bf16 ``ws`` kernel's on ``kv_layout.unpack(kv_packed, 512, 64)`` bit for bit)
    where it can, else the Triton kernel (same tile values; outputs equal up to the MMA's fp32 summation order)."""
    if kv_packed.dtype != torch.uint8 or kv_packed.dim() != 2 or kv_packed.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"kv_packed: expected uint8 [m, {FP8_ROW_BYTES}], found {kv_packed.dtype} "
                         f"{list(kv_packed.shape)}")
    if q.shape[-1] != 512:
        raise ValueError(f"q: the FP8 layout has head_dim 512, found {q.shape[-1]}")
    route, launch = _route(q, kv_packed, idx, "fp8-kv", config)
    if route == "cuda":
        from fidelity.decoders.production.kernels.sparse_attention_pair import sparse_attention_pair
        return sparse_attention_pair(q, kv_packed, idx, sink, scale)
    if route == "ws":
        from fidelity.decoders.production.kernels.sparse_attention_ws_fp8kv import sparse_attention_ws_fp8kv
        return sparse_attention_ws_fp8kv(q, kv_packed, idx, sink, scale, **launch)
    kv_packed = kv_packed.contiguous()
    return _launch(q, kv_packed, kv_packed.view(torch.bfloat16), idx, sink, float(scale), 512, True, launch)


def takes_sparse_attention_fp8kv(q, kv_packed, idx, sink, scale, rope_dims=FP8_ROPE) -> str | None:
    """Why :func:`sparse_attention_fp8kv_cuda` cannot take these inputs (None: it can): the 584 B layout, bf16 q
    [n, H, 512], 64 rope dims."""
    shaped = (on_device(q) and q.dim() == 3 and q.dtype == torch.bfloat16 and idx.dim() == 2
              and kv_packed.dtype == torch.uint8 and kv_packed.dim() == 2)
    if not shaped or (q.shape[-1], rope_dims, kv_packed.shape[1]) != (FP8_NOPE + FP8_ROPE, FP8_ROPE, FP8_ROW_BYTES):
        return UNSUPPORTED
    return None


def sparse_attention_fp8kv_cuda(q, kv_packed, idx, sink, scale, rope_dims=FP8_ROPE):
    """Same signature and result as ``ops.sparse_attention_fp8kv`` on the 584 B layout: :func:`sparse_attention_fp8kv`
    (its ``ws`` route on sm_90, else the Triton kernel)."""
    return sparse_attention_fp8kv(q, kv_packed, idx, sink, scale)


def route_sparse_attention_fp8kv(q, kv_packed, idx, sink, scale, rope_dims=FP8_ROPE) -> str:
    """The route :func:`sparse_attention_fp8kv_cuda` takes for these inputs: ``cuda``, ``ws`` or ``triton``."""
    return _route(q, kv_packed, idx, "fp8-kv", None)[0]
