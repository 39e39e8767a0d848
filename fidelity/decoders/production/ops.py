"""Production ops, CPU emulation with the official rounding (spec §3 kernel.py, §4 model.py dtypes).

Signatures are the kernel signatures a port implements (batch dropped). Each op has an oracle function of
the same name in ``oracles/`` and is registered in ``fidelity.decoders.production.registry``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fidelity.decoders.production import kv_layout
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.op_spec import GEMV_ROWS as GEMV_ROWS  # noqa: F401 (re-exported)
from fidelity.decoders.production.op_spec import (
    check_fp4_picked_linear,
    check_grouped_expert,
    expert_range_error,
    rope_table,
)
from fidelity.model.formats import (
    FP8_AMAX_FLOOR,
    FP8_MAX,
    decode_e8m0,
    dequantize_fp4,
    encode_e8m0,
    fake_quant_fp4,
    fake_quant_fp8,
    fp4_code_values,
    hadamard,
    quantize_fp8,
    round_fp4_e2m1,
    round_fp8_e4m3,
    ue8m0_scale,
    unpack_fp4_codes,
)

BF16 = torch.bfloat16
ATTN_BLOCK = 64  # sparse_attn processes 64 indices per online-softmax step


ROW_STABLE_M = 4  # torch's CPU fp32 GEMM takes another kernel below 4 rows: their bits differ from a larger call's


def rows_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [n, k] @ w_t [k, m]`` whose rows do not depend on how many rows the call has: on the CPU a call of
    2-3 rows (a short prefill chunk) is computed padded to ``ROW_STABLE_M``, so chunked and whole prefills split on
    aligned boundaries give equal bits (``ProductionDecoder.same_bits``). One row (a decode step) is left as it is:
    no promise covers it."""
    n = x.shape[0]
    if x.device.type == "cpu" and x.dim() == 2 and 1 < n < ROW_STABLE_M:
        return (F.pad(x, (0, 0, 0, ROW_STABLE_M - n)) @ w_t)[:n]
    return x @ w_t


def act_linear(x: torch.Tensor, weight: torch.Tensor, act: str = "fp8") -> torch.Tensor:
    """FP8/FP4 GEMM ``x @ W^T``: x [n, k] bf16 is quantized e4m3 1x128 ue8m0 (``act == "fp8"``), W [m, k] holds
    the exactly dequantized FP8/FP4 weight (fp32); products accumulate in fp32; output bf16."""
    return quantized_linear(fake_quant_fp8(x, 128) if act == "fp8" else x, weight)


def fp8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, act: str = "fp8",
                      groups: int = 1) -> torch.Tensor:
    """``act_linear`` on a weight given as stored: e4m3 codes [m, k] and its 128x128 block scales decoded to fp32
    [ceil(m/128), k/128] (the decode GEMV path reads these 1-byte codes, not a dequantized fp32 copy). ``groups``
    > 1: x [n, groups * k] and output row j multiplies x's group j // (m / groups) (wo_a's grouped projection,
    ``grouped_out``, with ``act == "bf16"``)."""
    w = _block_dequantized(codes, scales)
    if groups == 1:
        return act_linear(x, w, act)
    xs, ws = x.unflatten(-1, (groups, -1)), w.unflatten(0, (groups, -1))
    return torch.cat([act_linear(xs[:, g], ws[g], act) for g in range(groups)], dim=-1)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The compressors' projections (spec §4 Compressor: an fp32 Linear of ``x.float()``; the weight is stored
    bf16 and held as its exact fp32 value): x [n, k] bf16 / fp32, weight [m, k] -> fp32 [n, m]."""
    return rows_mm(x.float(), weight.float().T)


def fp4_picked_linear(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                      act: str = "fp8") -> torch.Tensor:
    """Row r of x [s, k] times expert ``experts[r]``'s FP4 weight: ``act_linear(x[r], W[experts[r]])`` -> bf16 [s, n],
    W[e] from packed e2m1 codes uint8 [E, n, k/2] and its 1x32 scales as stored, e8m0 bytes uint8 [E, n, k/32]
    (decoded here with ``formats.decode_e8m0``: ``2^(b - 127)``, 255 NaN); the expert ids stay a device tensor (no
    host read). Inputs of a wrong dtype or shape raise (``check_fp4_picked_linear``)."""
    check_fp4_picked_linear(x, experts, packed, scales)
    w = _fp4_dequantized(packed.index_select(0, experts), scales.index_select(0, experts))  # [s, n, k]
    xq = fake_quant_fp8(x, 128) if act == "fp8" else x
    return (xq.float()[:, None, :] @ w.transpose(1, 2)).squeeze(1).to(BF16)


def _block_dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [m, k] = code x its 128x128 block's scale (exact)."""
    full = scales.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[: codes.shape[0], : codes.shape[1]]
    return codes.view(torch.float8_e4m3fn).float() * full


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(w_fp32 * (x_f32 * rsqrt(mean(x^2) + eps))).to(x.dtype)`` (model.py RMSNorm)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then the 1x128 e4m3 activation quantization of every FP8 GEMM input (spec §3 ``act_quant``):
    ``quantize_fp8(rms_norm(x, weight, eps), 128)`` -> (codes float8_e4m3fn, ue8m0 scale bytes uint8)."""
    return quantize_fp8(rms_norm(x, weight, eps), 128)


def rms_norm_act_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm and the FP8 GEMM input made from it, as one op (profile ``fused-norm``): (y = ``rms_norm(x, weight,
    eps)``, ``fake_quant_fp8(y, 128)``), both bf16 [..., d]; the second is what every FP8 GEMM this norm feeds
    multiplies (spec §3 ``act_quant`` in place), made once instead of once per GEMM."""
    y = rms_norm(x, weight, eps)
    return y, fake_quant_fp8(y, 128)


def quantized_linear(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``act_linear``'s GEMM for an input already on its e4m3 1x128 grid (``rms_norm_act_quant``'s second output,
    or ``act == "bf16"``): ``xq.float() @ W^T`` -> bf16, W in fp32 (a checkpoint's bf16 weight: its exact fp32
    values)."""
    return rows_mm(xq.float(), weight.float().T).to(BF16)


def rms_norm_weightless(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head query norm computed with bf16 ops: ``q * rsqrt(mean(q^2) + eps)`` (each op rounds to bf16)."""
    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the last ``2 * len(freqs)`` dims as a complex64 multiply, written back in x's dtype."""
    rd = 2 * freqs.numel()
    cis = rope_table(freqs, positions)
    if inverse:
        cis = cis.conj()
    cis = cis.view((x.shape[0],) + (1,) * (x.ndim - 2) + (rd // 2,))
    z = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(z * cis).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], rotated), dim=-1)


def kv_norm_rope_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     freqs: torch.Tensor, fmt: str, scale_floor: str = "amax") -> torch.Tensor:
    """The attention KV path (spec §4 Attention steps 2-3) as the reference runs it, three ops: ``kv_norm``
    (rms_norm), RoPE on the last ``2 * len(freqs)`` dims, the 1x64 FP8 round of the nope dims (``kv_round``, scale
    rule ``scale_floor``). x [n, hd] bf16 (the wkv GEMM output) -> kv [n, hd] bf16. One fused kernel on CUDA
    (``kernels.kv_path``; the official rule only)."""
    return kv_round(apply_rope(rms_norm(x, weight, eps), positions, freqs), 2 * freqs.numel(), fmt, scale_floor)


def compressor_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, carry_kv: torch.Tensor,
                      carry_score: torch.Tensor, pos: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token through a compressor after its projections (spec §4-§5 ``Compressor.forward``, decode):
    kv, score fp32 [1, w] (w = coff * d; score without ape) at position ``pos`` (int64 [1], a device tensor: no host
    branch). ``score + ape[pos % r]`` and kv go to the carry's slot of pos (``carry_kv`` / ``carry_score`` fp32
    [coff * r, w], updated in place; r = ``ape.shape[0]``, overlap when w == 2 d); the carried slots are pooled
    (softmax over the slots per channel; with overlap the previous block's first halves, then this block's second
    halves), the pool is stored bf16, RMSNorm'd (``norm`` [d]) and rotated at the block's first position
    ``pos + 1 - r``; where the block completes (``pos % r == r - 1``) the overlap carry shifts (this block becomes
    the previous one). Returns (entry bf16 [1, d]: the compressed entry where the block completes, the pool of the
    slots as they stand elsewhere; carry_kv; carry_score)."""
    r, d = ape.shape[0], norm.numel()
    overlap = kv.shape[-1] == 2 * d
    phase = pos % r
    slot = phase + (r if overlap else 0)
    carry_kv.index_copy_(0, slot, kv)
    carry_score.index_copy_(0, slot, score + ape.index_select(0, phase))
    if overlap:
        slots_kv = torch.cat((carry_kv[:r, :d], carry_kv[r:, d:]))
        slots_score = torch.cat((carry_score[:r, :d], carry_score[r:, d:]))
    else:
        slots_kv, slots_score = carry_kv, carry_score
    pooled = (slots_kv * slots_score.softmax(dim=0)).sum(dim=0, keepdim=True)
    if overlap:
        complete = phase == r - 1
        for state in (carry_kv, carry_score):
            state[:r] = torch.where(complete, state[r:], state[:r])
    start = pos if on("compressed-rope-last") else pos + 1 - r
    entry = apply_rope(rms_norm(pooled.to(BF16), norm, eps), start, freqs)
    return entry, carry_kv, carry_score


def kv_round(kv: torch.Tensor, rope_dims: int, fmt: str, scale_floor: str = "amax") -> torch.Tensor:
    """Window / compressed KV [n, hd] bf16: nope dims FP8-rounded in 1x64 ue8m0 blocks (``act_quant(kv[..., :-rd],
    64, inplace=True)``) when ``fmt == "fp8"``, the scale floored on the amax (``scale_floor`` "amax", official) or
    on the scale ("scale", FlashMLA's; profile field ``kv_scale_floor``, ``formats.ue8m0_scale``); rope dims stay
    bf16."""
    if fmt != "fp8":
        return kv
    nope = _fp8_round_after(kv[..., :-rope_dims], 64) if on("ue8m0-round-after") else \
        fake_quant_fp8(kv[..., :-rope_dims], 64, scale_floor)
    return torch.cat((nope, kv[..., -rope_dims:]), dim=-1)


def _fp8_round_after(x: torch.Tensor, block: int) -> torch.Tensor:
    """Fault ``ue8m0-round-after``: codes ``e4m3(x / (amax/448))`` with the exact scale, dequantized with the scale
    rounded up to a power of two after quantizing (the stored ue8m0 one): each block grows by s_pow2/s_exact, in
    [1, 2)."""
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    codes = round_fp8_e4m3(blocks / (amax / FP8_MAX))
    return (codes * ue8m0_scale(amax, FP8_MAX, FP8_AMAX_FLOOR)).flatten(-2).to(x.dtype)


def indexer_round(x: torch.Tensor, fmt: str, rotate: bool) -> torch.Tensor:
    """Indexer q or key [..., d] bf16: Hadamard (``rotate_activation``) then FP4 1x32 / FP8 / none."""
    if rotate:
        x = hadamard(x)
    if fmt == "fp4":
        return _fake_quant_fp4_floor(x) if on("fp4-scale-floor") else fake_quant_fp4(x, 32)
    if fmt == "fp8":
        return fake_quant_fp8(x, min(128, x.shape[-1]))
    return x


def _fake_quant_fp4_floor(x: torch.Tensor) -> torch.Tensor:
    """Fault ``fp4-scale-floor``: scale 2^floor(log2(amax/6)), so the block maximum saturates at 6*s."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    s = torch.exp2(torch.floor(torch.log2(amax / 6)))
    s = decode_e8m0(encode_e8m0(s))
    return (round_fp4_e2m1(blocks / s) * s).flatten(-2).to(x.dtype)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype = BF16) -> torch.Tensor:
    """q [n, h, d], keys [e, d], weights [n, h] -> scores [n, e]: ``sum_h w_h * relu(q_h . k)``, every step in
    ``dtype`` (bf16 in the reference: einsum, ReLU, product and sum each round to bf16)."""
    s = torch.einsum("nhd,ed->nhe", q.to(dtype), keys.to(dtype)).relu()
    return (s * weights.to(dtype).unsqueeze(-1)).sum(dim=1)


def index_scores_fp4(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor,
                     dtype: torch.dtype = BF16) -> torch.Tensor:
    """:func:`index_scores` straight from the packed FP4 key cache (spec §3 ``fp4_act_quant`` layout, §4
    Indexer): codes uint8 [e, d/2] (low nibble = element 2i), ue8m0 scale bytes uint8 [e, d/32]. The keys are
    dequantized exactly (``e2m1 * 2^(b-127)`` is a bf16 value), so this equals ``index_scores`` on
    ``KeyStore.read`` rows bit for bit."""
    return index_scores(q, dequantize_fp4(codes, scales, 32).to(BF16), weights, dtype)


FMHA_ROPE_DIMS = 64  # the rope dims close every q / KV row (qk_rope_head_dim; the cache's bf16 tail)


def fmha_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """An FMHA operand [..., d] as the attention core reads it: bf16 as is; ``fp8``: e4m3 in 1x64 ue8m0 blocks;
    ``fp8-nope``: the nope dims so, the last ``FMHA_ROPE_DIMS`` (rope) dims bf16."""
    if fmt == "fp8":
        return fake_quant_fp8(x, 64)
    if fmt == "fp8-nope":
        nope = x.shape[-1] - FMHA_ROPE_DIMS
        return torch.cat((fake_quant_fp8(x[..., :nope], 64), x[..., nope:]), dim=-1)
    if fmt != "bf16":
        raise ValueError(f"fmha: expected 'bf16', 'fp8' or 'fp8-nope', found {fmt!r}")
    return x


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                     fmt: str = "bf16") -> torch.Tensor:
    """``sparse_attn``: q [n, H, d] bf16, kv [m, d] bf16 (K = V), idx [n, K] int (-1 = masked), sink [H] fp32.

    Online softmax over blocks of 64 indices in idx order: fp32 logits x scale, running max and sum in fp32,
    P rounded to bf16 (``fmt == "fp8"``: Q, K/V and P rounded to e4m3; ``"fp8-nope"``: the same with the last
    ``FMHA_ROPE_DIMS`` dims of Q and K/V, the rope dims, left bf16) before P.V with fp32 accumulation; after the
    loop the sink adds ``exp(sink - m)`` to the denominator only. Output bf16 [n, H, d].
    """
    n, h, d = q.shape
    qf, kvf = fmha_round(q, fmt).float(), fmha_round(kv, fmt).float()
    m = torch.full((n, h), float("-inf"), device=q.device)
    total = torch.zeros(n, h, device=q.device)
    acc = torch.zeros(n, h, d, device=q.device)
    for b in range(0, idx.shape[1], ATTN_BLOCK):
        ids = idx[:, b : b + ATTN_BLOCK].long()
        valid = ids >= 0
        rows = torch.where(valid.unsqueeze(-1), kvf[ids.clamp(min=0)], 0.0)  # [n, B, d], masked rows selected 0
        logits = torch.einsum("nhd,nbd->nhb", qf, rows) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(m, logits.amax(dim=-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)  # m = -inf on a query's first block
        p = torch.exp(logits - m_new.unsqueeze(-1)).nan_to_num(0.0)
        total = total * alpha + p.sum(dim=-1)
        p_mma = round_fp8_e4m3(p) if fmt != "bf16" else p.to(BF16).float()
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("nhb,nbd->nhd", p_mma, rows)
        m = m_new
    share = torch.exp(sink.float().unsqueeze(0) - m)  # [n, H]
    if on("sink-value-row"):  # fault: the sink also carries a value (the query's first visible row)
        acc = acc + share.unsqueeze(-1) * kvf[idx[:, :1].long()]
    if not on("sink-dropped"):
        total = total + share
    return (acc / total.unsqueeze(-1)).to(BF16)


def sparse_attention_fp8kv(q: torch.Tensor, kv_packed: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                           scale: float, rope_dims: int = 64) -> torch.Tensor:
    """``sparse_attention`` over packed FP8 KV rows (``kv_layout``: uint8 [m, row bytes], 584 B at head_dim 512;
    q [n, H, d], idx [n, K] int, -1 = masked): the rows idx reads, unpacked exactly to bf16 (a -1 reads row 0,
    which the attention never uses), then ``sparse_attention`` with their local indices, so the bits equal
    ``sparse_attention`` on the dequantized rows in idx order."""
    n, k = idx.shape
    flat = idx.reshape(-1).long()
    rows = kv_layout.unpack(kv_packed[flat.clamp(min=0)], q.shape[-1], rope_dims)
    local = torch.where(flat >= 0, torch.arange(flat.numel(), device=idx.device), -1).view(n, k)
    return sparse_attention(q, rows, local, sink, scale)


def gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
         ids: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE gate in fp32 (spec §4 ``Gate``): x [n, dim] -> (routing weights [n, k], expert ids [n, k]).

    Scores: softmax, sigmoid or sqrt(softplus) of ``x W^T``. Experts: ``tid2eid[token]`` on hash layers, else the
    top-k of ``scores + bias`` (the bias only chooses). Weights: the chosen experts' unbiased scores, divided by
    their sum unless the scores are a softmax, times ``route_scale``.
    """
    logits = rows_mm(x, weight.to(x.dtype).T)
    if cfg.score_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif cfg.score_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.sqrt(F.softplus(logits))
    if tid2eid is None:
        choice = scores if bias is None else scores + bias.to(x.dtype)
        experts = torch.topk(choice, cfg.n_activated_experts, dim=-1).indices
    else:
        experts = tid2eid[ids].long()
    picked = torch.gather(scores, 1, experts)
    if cfg.score_func != "softmax":
        picked = picked / picked.sum(dim=-1, keepdim=True)
    return picked * cfg.route_scale, experts


def grouped_out(o: torch.Tensor, wo_a: torch.Tensor, n_groups: int) -> torch.Tensor:
    """o [n, H, hd] bf16 -> [n, G*o_lora] bf16: einsum with the bf16-dequantized wo_a, no activation quant."""
    o = o.flatten(1).unflatten(-1, (n_groups, -1))
    mid = torch.einsum("ngd,grd->ngr", o, wo_a.to(BF16).unflatten(0, (n_groups, -1)))
    return mid.flatten(1)


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """``hc_split_sinkhorn`` in fp32: mixes [n, (2+hc)*hc] -> pre [n, hc], post [n, hc], comb [n, hc, hc]."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range((3 if on("sinkhorn-3-iters") else iters) - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    if on("comb-transposed"):
        comb = comb.transpose(-1, -2)
    return pre, post, comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           iters: int, hc_eps: float):
    """x [n, hc, dim] (bf16 or fp32 streams) -> (collapsed bf16 [n, dim], post, comb); mixing in fp32."""
    hc = x.shape[1]
    xf = x.flatten(1).float()
    mixes = rows_mm(xf, fn.float().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = sinkhorn_split(mixes, scale.float(), base.float(), hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1)
    return y.to(BF16), pre, post, comb


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            out_dtype: torch.dtype = BF16) -> torch.Tensor:
    """``post_k * f + sum_j comb[j, k] * residual_j`` in fp32, stored as ``out_dtype`` (bf16 in the reference)."""
    y = post.unsqueeze(-1) * f.float().unsqueeze(-2) + (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(1)
    return y.to(out_dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final collapse of [n, hc, dim] streams in fp32 -> bf16 [n, dim]."""
    xf = x.flatten(1).float()
    mixes = rows_mm(xf, fn.float().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(BF16)


def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
           weight: torch.Tensor | None, act: str, linear: Callable | None = None) -> torch.Tensor:
    """SwiGLU expert: GEMM outputs bf16 -> fp32, clamp, ``weight * silu(g) * u`` in fp32 (weight BEFORE w2, so
    w2's activation quantization sees the weighted h), cast to bf16, w2 GEMM -> bf16 [n, dim]. ``linear``: the
    ``act_linear`` implementation to use (default: this module's); w1, w2, w3 are handed to it as given (weight
    tensors, or whatever the caller's ``linear`` takes: a weight's name, a stored form)."""
    linear = linear or act_linear
    g, u = linear(x, w1, act), linear(x, w3, act)
    return linear(swiglu(g, u, limit, weight, expert_clamps(limit, weight)), w2, act)


def expert_clamps(limit: float, weight: torch.Tensor | None) -> bool:
    """Whether ``expert`` clamps g and u: a positive ``swiglu_limit`` (the ``shared-clamp-missing`` fault drops it
    from the shared expert, the one called without a routing weight)."""
    return limit > 0 and not (weight is None and on("shared-clamp-missing"))


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None, clamp: bool) -> torch.Tensor:
    """``expert``'s middle: the w1 / w3 outputs g, u bf16 [n, f] -> h bf16 [n, f] = ``weight * silu(g) * u`` in
    fp32, u clamped to [-limit, limit] and g to at most limit first when ``clamp``."""
    g, u = g.float(), u.float()
    if clamp:
        u = u.clamp(min=-limit, max=limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:
        h = weight * h
    return h.to(BF16)


def grouped_expert(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                   w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor, limit: float,
                   act: str = "fp8", quantized: bool = False) -> torch.Tensor:
    """The routed experts of many tokens on the stored FP4 experts (spec §4 MoE, §2 formats): y bf16 [n, k, dim],
    y[t, j] = ``expert(x[t], W1, W2, W3, limit, weights[t, j], act)`` of expert ``experts[t, j]``, W1 / W3 the
    first / last f rows of w13 (packed e2m1 codes uint8 [E, 2 f, dim/2], 1x32 scales as stored: e8m0 bytes uint8
    [E, 2 f, dim/32]), W2 from w2 [E, dim, f/2] / [E, dim, f/32]. ``quantized``: x is already on its e4m3 1x128 grid
    (an ``Fp8Input``'s xq), so the w1 / w3 GEMMs multiply it as given. Expert by expert in ascending id, each on
    its rows in ascending order (the model's per-expert loop, the same GEMM calls: its bits)."""
    check_grouped_expert(x, weights, experts, w13, w13_scales, w2, w2_scales)
    (n, k), e_count, f = experts.shape, w13.shape[0], w13.shape[1] // 2
    flat = experts.flatten().long()
    out = torch.zeros((n * k, w2.shape[1]), dtype=BF16, device=x.device)
    if not flat.numel():
        return out.unflatten(0, (n, k))
    error = expert_range_error(int(flat.min()), int(flat.max()), e_count)
    if error:
        raise ValueError(error)
    order = flat.argsort(stable=True)  # slots grouped by expert, ascending token within each
    start, first_act = 0, "bf16" if quantized else act
    for e, size in enumerate(torch.bincount(flat, minlength=e_count).tolist()):
        if not size:
            continue
        slots, start = order[start : start + size], start + size
        xe, w = x[slots // k], _fp4_dequantized(w13[e], w13_scales[e])
        g, u = act_linear(xe, w[:f], first_act), act_linear(xe, w[f:], first_act)
        h = swiglu(g, u, limit, weights.flatten()[slots, None], limit > 0)
        out[slots] = act_linear(h, _fp4_dequantized(w2[e], w2_scales[e]), act)
    return out.unflatten(0, (n, k))


def _fp4_dequantized(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] = e2m1 code value x its 1x32 block's scale (exact) from packed uint8 [out, in/2] and e8m0
    scale bytes uint8 [out, in/32] (``decode_e8m0``: 2^(b - 127), a 255 byte makes its block NaN)."""
    w = fp4_code_values(unpack_fp4_codes(packed))
    return (w.unflatten(-1, (-1, 32)) * decode_e8m0(scales)[..., None]).flatten(-2)


# --------------------------------------------------------------------------------------------------------------
# decode-step plumbing: copies, slots and selections addressed by device-side indices (graph decode)
# --------------------------------------------------------------------------------------------------------------


def take(stack: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``stack[index[0]]`` as a new tensor, the index never read on the host: stack [E, ...], index int [1] on its
    device (graph decode's expert weights)."""
    return stack.index_select(0, index.reshape(1))[0]


def put_at_block_end(store: torch.Tensor, pos: torch.Tensor, ratio: int, offset: int, row: torch.Tensor,
                     ring: int = 0) -> torch.Tensor:
    """``store[pos // ratio + offset] = row[0]`` where the token at ``pos`` (int [1], on the device) completes a
    block of ``ratio`` (``pos % ratio == ratio - 1``), decided on the device; ``ring`` > 0: that slot modulo ``ring``
    (ratio 1, offset 0: a window's ring slot ``pos % ring``). store [capacity, ...] is written in place and
    returned; row [1, ...] of its row shape and dtype (graph decode's compressed entries and window rows)."""
    slot = pos // ratio + offset
    slot = slot % ring if ring else slot
    target, new = store, row
    if store.dtype.itemsize == 1 and store.dtype != torch.uint8:  # torch.where has no float8 kernels
        target, new = store.view(torch.uint8), row.view(torch.uint8)
    keep = (pos % ratio != ratio - 1).view(-1, *([1] * (new.dim() - 1)))
    target[slot] = torch.where(keep, target[slot], new)
    return store


def _decode_slot_rows(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                      n_compressed: int) -> torch.Tensor:
    """The store rows of the step's window slots, then its compressed entries, -1 where none: int64 [w + c]."""
    j = torch.arange(window, device=pos.device)
    ring = (j + pos % window + 1) % window
    rows = [torch.where(pos >= window - 1, ring, torch.where(j <= pos, j, -1))]
    if ratio:
        limit = (pos + 1) // ratio
        comp = picks.flatten().long() if ratio == 4 else torch.arange(n_compressed, device=pos.device)
        rows.append(torch.where((comp >= limit) | (comp < 0), -1, comp + window))
    return torch.cat(rows)


def decode_slots(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
                 n_compressed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows one decode step at ``pos`` (int64 [1], on the device) attends: the window ring's slots (oldest first,
    -1 before the window fills), then the compressed entries it sees (CSA, ``ratio`` 4: the indexer's ``picks`` int
    [1, k] below ``(pos + 1) // 4``; HCA: every entry ``j < (pos + 1) // ratio`` of ``n_compressed``; ``ratio`` 0:
    none). -> (gather rows into the store [window | compressed] int64 [w + c], a -1 slot reading row 0; the
    attention's local indices int64 [1, w + c], -1 where none)."""
    slots = _decode_slot_rows(pos, picks, window, ratio, n_compressed)
    local = torch.where(slots >= 0, torch.arange(len(slots), device=pos.device), -1)
    return slots.clamp(min=0), local[None]


def decode_idx(pos: torch.Tensor, picks: torch.Tensor | None, window: int, ratio: int,
               n_compressed: int) -> torch.Tensor:
    """:func:`decode_slots`' slots as the attention's indices into the layer's store itself (spec §4 attention step
    5: the decode cache [window | compressed], -1 where none): int32 [1, w + c], nothing gathered."""
    return _decode_slot_rows(pos, picks, window, ratio, n_compressed).to(torch.int32)[None]


def mask_past(scores: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """scores [1, n] with the entries a query at ``pos`` (int64 [1], on the device) may not see, ``j >= (pos + 1) //
    ratio``, set to -inf (a new tensor; the kernel writes them in place)."""
    return scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device)[None] >= (pos + 1) // ratio,
                              float("-inf"))


# bits and positive quiet NaN (above +inf in the integer order) of each supported score dtype
_INT_VIEW = {torch.float32: (torch.int32, 31, 0x7FFFFFFF, 0x7FC00000),
             torch.bfloat16: (torch.int16, 15, 0x7FFF, 0x7FC0)}


def ordered_scores(scores: torch.Tensor) -> torch.Tensor:
    """[..., n] fp32 / bf16 -> [..., n] int32 / int16 in the numbers' order (-0 == +0; NaNs equal, above +inf)."""
    if scores.dtype not in _INT_VIEW:
        raise TypeError(f"top-k: scores must be float32 or bfloat16, found {scores.dtype}")
    int_dtype, sign_shift, magnitude, nan = _INT_VIEW[scores.dtype]
    bits = (scores + 0.0).view(int_dtype)  # + 0.0 turns -0.0 into +0.0
    bits = torch.where(torch.isnan(scores), nan, bits)
    return bits ^ ((bits >> sign_shift) & magnitude)


def radix_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [..., k] int64 of the k highest ``scores`` [..., n] (bf16 or fp32), highest first, ties to the lower id:
    the CPU's stable descending sort, -0 == +0 and NaN above +inf (``ordered_scores``), on any device (the GPU
    kernel selects by radix passes instead of sorting)."""
    return ordered_scores(scores).sort(dim=-1, descending=True, stable=True).indices[..., :k]


def moe_sum(out: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Routed slot outputs bf16 [n, k, dim] (ascending expert id) added in fp32 in slot order, then the shared
    expert's bf16 [n, dim], rounded once to bf16 [n, dim]."""
    y = torch.zeros((out.shape[0], out.shape[-1]), dtype=torch.float32, device=out.device)
    for j in range(out.shape[1]):
        y += out[:, j].float()
    return (y + shared.float()).to(BF16)

