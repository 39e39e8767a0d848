"""Each op's contract: an :class:`OpContract` under the name ``registry.OPS[op].contract`` gives (resolved by
:func:`contract_of`): the expected result (the fp64 oracle, or a bit-exact reference) and the limits derived from
the rounding steps the official reference takes."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import strategies as st

from fidelity.model.formats import (
    FP8_AMAX_FLOOR,
    FP8_MAX,
    decode_e8m0,
    dequantize_fp8,
    fake_quant_fp4,
    fake_quant_fp8,
    hadamard,
    ue8m0_scale,
)
from fidelity.testing.cases import (
    BF16,
    FP32,
    FP32_REL,
    FP64,
    SLACK,
    U_BF16,
    U_FP8,
    Case,
    OpContract,
    Output,
    Tolerance,
    _rel,
)
from fidelity.testing.strategies import _fp4_keys_case
from oracles import attention as attention_oracle
from oracles import indexer as indexer_oracle
from oracles import linear as linear_oracle
from oracles import mhc as mhc_oracle
from oracles import moe as moe_oracle
from oracles import norms as norms_oracle
from oracles import rope as rope_oracle

# --------------------------------------------------------------------------------------------------------------
# expected results (oracle in fp64, or the bit-exact reference)
# --------------------------------------------------------------------------------------------------------------


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(FP64)


def _expected_act_linear(c: Case) -> tuple[torch.Tensor, ...]:
    return (linear_oracle.act_linear(_d(c["x"]), _d(c["weight"])),)


def _act_linear_bound(c: Case) -> torch.Tensor:
    return _linear_bound(_d(c["x"]), _d(c["weight"]), c["act"])


def _linear_bound(x: torch.Tensor, w: torch.Tensor, act: str) -> torch.Tensor:
    """|error| <= (u8 + k 2^-23) sum_k |x_k| |w_jk| + 1.25u |y_j|: the e4m3 rounding of each x_k (u8 = 2^-4;
    0 for act "bf16"), the fp32 accumulation, and the bf16 rounding of the output."""
    absdot = x.abs() @ w.abs().T
    u8 = U_FP8 if act == "fp8" else 0.0
    return ((u8 + x.shape[-1] * 2.0**-23) * absdot + _ONE * (x @ w.T).abs()).nan_to_num(0.0)


def _expected_rms_norm(c: Case) -> tuple[torch.Tensor, ...]:
    return (norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"]),)


def _rms_norm_fp8_exact(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 y [n, d] and the lowest / highest ue8m0 scale [n, d/128] a bf16-rounded y (+-1.25u) can give."""
    y = norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"])
    amax = y.unflatten(-1, (-1, 128)).abs().amax(-1)
    lo, hi = (ue8m0_scale(amax * (1 + k * _ONE), FP8_MAX, FP8_AMAX_FLOOR).to(FP64) for k in (-1, 1))
    return y, lo, hi


def _expected_rms_norm_fp8(c: Case) -> tuple[torch.Tensor, ...]:
    """(exact y, mid-point of the admissible scale bytes); compared after :func:`_dequantize_codes`."""
    y, lo, hi = _rms_norm_fp8_exact(c)
    return y, (torch.log2(lo) + torch.log2(hi)) / 2 + 127


def _rms_norm_fp8_value_bound(c: Case) -> torch.Tensor:
    """|code * s - y| <= half an e4m3 step (2^-4 |y|, or 2^-10 s among the subnormal codes) + 1.25u |y|."""
    y, _, hi = _rms_norm_fp8_exact(c)
    return torch.maximum(U_FP8 * y.abs(), 2.0**-10 * hi.repeat_interleave(128, -1)) + _ONE * y.abs()


def _rms_norm_fp8_scale_bound(c: Case) -> torch.Tensor:
    _, lo, hi = _rms_norm_fp8_exact(c)
    return (torch.log2(hi) - torch.log2(lo)) / 2


def _dequantize_codes(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(codes e4m3, scale bytes) -> (dequantized fp64 values, scale bytes); expected outputs pass unchanged."""
    codes, scales = outs
    if codes.dtype != torch.float8_e4m3fn:
        return outs
    return dequantize_fp8(codes, scales, 128).to(FP64), scales


def _expected_rms_norm_weightless(c: Case) -> tuple[torch.Tensor, ...]:
    return (norms_oracle.rms_norm_weightless(_d(c["q"]), c["eps"]),)


def _expected_apply_rope(c: Case) -> tuple[torch.Tensor, ...]:
    """The oracle rotation in fp64, at the reference's fp32 angles ``fp32(position) * fp32(freq)``
    (``precompute_freqs_cis``): at position 2^20 an fp32 angle is off the exact product by up to 2^-4 rad, and
    that rounding is part of the model's definition, not error (one oracle call per row, position 1)."""
    return (_rope_at_fp32_angles(_d(c["x"]), c["positions"], c["freqs"], c.get("inverse", False)),)


def _rope_at_fp32_angles(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                         inverse: bool = False) -> torch.Tensor:
    """The oracle rotation of fp64 x [n, ...] at the angles ``fp32(position) * fp32(freq)``."""
    angles = positions.to(FP32)[:, None] * freqs.to(FP32)[None, :]
    one = torch.ones(1, dtype=torch.int64)
    return torch.cat([rope_oracle.apply_rope(x[i : i + 1], one, _d(angles[i]), inverse) for i in range(x.shape[0])])


def _rope_bound(c: Case) -> torch.Tensor:
    """Elementwise limit: 0 on the nope dims (must pass through unchanged), unbounded on the rope dims."""
    bound = torch.zeros(c["x"].shape, dtype=FP64)
    bound[..., -2 * c["freqs"].numel() :] = math.inf
    return bound


def kv_round_reference(kv: torch.Tensor, rope_dims: int, fmt: str, scale_floor: str = "amax") -> torch.Tensor:
    """Bit-exact reference of ``kv_round``: the reference's in-place ``act_quant(kv[..., :-rope_dims], 64,
    "ue8m0")`` = :func:`fidelity.model.formats.fake_quant_fp8` in 1x64 blocks on the nope dims, its scale floored
    on the amax ("amax", official) or on the scale ("scale", FlashMLA's; profile field ``kv_scale_floor``); rope
    dims unchanged."""
    if fmt != "fp8":
        return kv
    return torch.cat((fake_quant_fp8(kv[..., :-rope_dims], 64, scale_floor), kv[..., -rope_dims:]), dim=-1)


def _expected_kv_round(c: Case) -> tuple[torch.Tensor, ...]:
    return (kv_round_reference(c["kv"], c["rope_dims"], c["fmt"], c.get("scale_floor", "amax")),)


def indexer_round_reference(x: torch.Tensor, fmt: str, rotate: bool) -> torch.Tensor:
    """Bit-exact reference of ``indexer_round``: ``rotate_activation`` (:func:`fidelity.model.formats.hadamard`,
    bf16 out) then ``fp4_act_quant(x, 32)`` in place (:func:`fidelity.model.formats.fake_quant_fp4`), or the FP8
    1x128 round (fmt "fp8"), or nothing (fmt "bf16")."""
    x = hadamard(x) if rotate else x
    if fmt == "fp4":
        return fake_quant_fp4(x, 32)
    return fake_quant_fp8(x, min(128, x.shape[-1])) if fmt == "fp8" else x


def _expected_compressor_decode(c: Case) -> tuple[torch.Tensor, ...]:
    """The carry slot written, the exact softmax pool of the slots (with overlap: the previous block's first halves,
    this block's second halves), the oracle RMSNorm and rotation at fp32(pos + 1 - r) angles; the overlap carry
    shifted where the block completes."""
    kv, score, ape, norm = _d(c["kv"]), _d(c["score"]), _d(c["ape"]), _d(c["norm"])
    carry_kv, carry_score = _d(c["carry_kv"]).clone(), _d(c["carry_score"]).clone()
    r, d, pos = ape.shape[0], norm.numel(), int(c["pos"][0])
    overlap = kv.shape[-1] == 2 * d
    slot = pos % r + (r if overlap else 0)
    carry_kv[slot], carry_score[slot] = kv[0], score[0] + ape[pos % r]
    if overlap:
        slots_kv = torch.cat((carry_kv[:r, :d], carry_kv[r:, d:]))
        slots_score = torch.cat((carry_score[:r, :d], carry_score[r:, d:]))
    else:
        slots_kv, slots_score = carry_kv, carry_score
    pooled = (slots_score.softmax(dim=0) * slots_kv).sum(dim=0, keepdim=True)
    entry = _rope_at_fp32_angles(norms_oracle.rms_norm(pooled, norm, c["eps"]), c["pos"] + 1 - r, c["freqs"])
    if overlap and pos % r == r - 1:
        carry_kv[:r], carry_score[:r] = carry_kv[r:].clone(), carry_score[r:].clone()
    return entry, carry_kv, carry_score


def _expected_kv_norm_rope_fp8(c: Case) -> tuple[torch.Tensor, ...]:
    """The exact kv_norm then RoPE (fp64, reference angles); exact math has no FP8 rounding."""
    y = norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"])
    return (_rope_at_fp32_angles(y, c["positions"], c["freqs"]),)


def _kv_norm_rope_fp8_bound(c: Case) -> torch.Tensor:
    """Elementwise: the bf16 rounding of the norm (1.25u |y|); on the nope dims under "fp8" the e4m3 step
    (half an ulp: 2^-4 |y|, or 2^-10 s on the subnormal codes of a 1x64 block whose ue8m0 scale s, by the case's
    ``scale_floor`` rule, may come from an amax 1.25u high); on the rope dims the norm's rounding carried through
    the rotation plus the output's rounding: 2 x 1.25u (|y_2i| + |y_2i+1|) for both elements of a pair."""
    y = norms_oracle.rms_norm(_d(c["x"]), _d(c["weight"]), c["eps"])
    rd = 2 * c["freqs"].numel()
    bound = _ONE * y.abs()
    nope = y[:, :-rd]
    if c["fmt"] == "fp8":
        amax = nope.unflatten(-1, (-1, 64)).abs().amax(-1)
        floor_on = c.get("scale_floor", "amax")
        hi = ue8m0_scale(amax * (1 + _ONE), FP8_MAX, FP8_AMAX_FLOOR, floor_on).to(FP64).repeat_interleave(64, -1)
        bound[:, :-rd] += torch.maximum(U_FP8 * nope.abs(), 2.0**-10 * hi)
    pairs = y[:, -rd:].abs().unflatten(-1, (-1, 2)).sum(-1, keepdim=True)
    bound[:, -rd:] = (2 * _ONE * pairs).expand(-1, -1, 2).flatten(1)
    return bound


def _expected_index_scores(c: Case) -> tuple[torch.Tensor, ...]:
    """``oracles.indexer.index_scores`` with nothing causally masked (every key visible)."""
    q, keys = _d(c["q"]), _d(c["keys"])
    positions = torch.full((q.shape[0],), keys.shape[0], dtype=torch.int64)
    return (indexer_oracle.index_scores(q, keys, _d(c["weights"]), positions, ratio=1),)


def _index_scores_bound(c: Case) -> torch.Tensor:
    """|error| <= 4u * sum_h |w_h| relu(q_h.k) + d 2^-23 * sum_h |w_h| (|q_h|.|k|): the bf16 dot, product and
    head-sum roundings (3u, +1u slack) of the terms, plus the fp32 dot accumulation (d 2^-24, x2)."""
    q, keys, w = _d(c["q"]), _d(c["keys"]), _d(c["weights"]).abs()
    terms = torch.einsum("nhd,ed->nhe", q, keys).relu()
    absdots = torch.einsum("nhd,ed->nhe", q.abs(), keys.abs())
    bound = 4 * U_BF16 * (terms * w[..., None]).sum(1) + q.shape[-1] * 2.0**-23 * (absdots * w[..., None]).sum(1)
    return bound.nan_to_num(0.0)


def _expected_sparse_attention(c: Case) -> tuple[torch.Tensor, ...]:
    """Gather ``kv[idx]``, rows of -1 zeroed (the kernel's ``if_then_else``) and masked, then
    ``oracles.attention.sparse_attention`` in fp64."""
    idx, kv = c["idx"].long(), _d(c["kv"])
    valid = idx >= 0
    rows = torch.where(valid[..., None], kv[idx.clamp(min=0)], 0.0)
    return (attention_oracle.sparse_attention(_d(c["q"]), rows, valid, _d(c["sink"]), c["scale"]),)


def _expected_sparse_attention_fp8kv(c: Case) -> tuple[torch.Tensor, ...]:
    """The packed rows decoded by their layout ([nope e4m3 codes | rope bf16 | nope/64 ue8m0 bytes | pad];
    ``dequantize_fp8`` of the codes, rounded to bf16 as the cache's readers round them), then
    :func:`_expected_sparse_attention`."""
    packed, d, rope = c["kv_packed"], c["q"].shape[-1], c["rope_dims"]
    nope = d - rope
    codes = packed[:, :nope].contiguous().view(torch.float8_e4m3fn)
    scales = packed[:, nope + 2 * rope : nope + 2 * rope + nope // 64]
    rows = torch.cat((dequantize_fp8(codes, scales, 64).to(torch.bfloat16),
                      packed[:, nope : nope + 2 * rope].contiguous().view(torch.bfloat16)), dim=1)
    return _expected_sparse_attention(Case({**c.args, "kv": rows}))


def _expected_hc_pre(c: Case) -> tuple[torch.Tensor, ...]:
    x = _d(c["x"])
    mixes = mhc_oracle.hc_mixes(x, _d(c["fn"]), c["norm_eps"])
    pre, post, comb = mhc_oracle.hc_split(mixes, _d(c["scale"]), _d(c["base"]), x.shape[1], c["iters"], c["hc_eps"])
    return mhc_oracle.hc_collapse(x, pre), pre, post, comb


def _expected_hc_post(c: Case) -> tuple[torch.Tensor, ...]:
    return (mhc_oracle.hc_post(_d(c["f"]), _d(c["residual"]), _d(c["post"]), _d(c["comb"])),)


def _expected_hc_head(c: Case) -> tuple[torch.Tensor, ...]:
    return (mhc_oracle.hc_head(_d(c["x"]), _d(c["fn"]), _d(c["scale"]), _d(c["base"]), c["norm_eps"], c["hc_eps"]),)


def _expected_sinkhorn_split(c: Case) -> tuple[torch.Tensor, ...]:
    return mhc_oracle.hc_split(_d(c["mixes"]), _d(c["scale"]), _d(c["base"]), c["hc"], c["iters"], c["eps"])


def _expected_gate(c: Case) -> tuple[torch.Tensor, ...]:
    return moe_oracle.gate(_d(c["x"]), _d(c["weight"]), _d(c["bias"]), c["tid2eid"], c["ids"], c["cfg"])


def _sort_topk(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(weights, indices) with each row sorted by expert id (top-k order is not part of the contract)."""
    weights, indices = outs
    indices, order = indices.long().sort(dim=-1)
    return weights.gather(-1, order), indices


def _expected_expert(c: Case) -> tuple[torch.Tensor, ...]:
    return (moe_oracle.expert(_d(c["x"]), _d(c["w1"]), _d(c["w2"]), _d(c["w3"]), c["limit"], _d(c["weight"])),)



def _stored_fp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp64 [..., out, in]: e2m1 codes (low nibble first; bit 3 the sign) times their 1x32 scales (e8m0 bytes)."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)
    mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=FP64)[codes & 7]
    values = torch.where(codes >= 8, -mag, mag)
    return (values.unflatten(-1, (-1, 32)) * decode_e8m0(scales).to(FP64)[..., None]).flatten(-2)


def _expected_grouped_expert(c: Case) -> tuple[torch.Tensor, ...]:
    """fp64 [n, k, dim]: the expert oracle of each (token, slot) on its expert's dequantized weights."""
    x, weights, f = _d(c["x"]), _d(c["weights"]), c["w13"].shape[1] // 2
    w13, w2 = _stored_fp4(c["w13"], c["w13_scales"]), _stored_fp4(c["w2"], c["w2_scales"])
    rows = [[moe_oracle.expert(x[t : t + 1], w13[e][:f], w2[e], w13[e][f:], c["limit"], weights[t, j].view(1, 1))[0]
             for j, e in enumerate(c["experts"][t].tolist())] for t in range(x.shape[0])]
    return (torch.stack([torch.stack(r) for r in rows]).reshape(*c["experts"].shape, -1),)

# --------------------------------------------------------------------------------------------------------------
# contracts
# --------------------------------------------------------------------------------------------------------------

_ONE = SLACK * U_BF16  # one bf16 rounding of an fp32 result
def _fp8_weight(c: Case) -> torch.Tensor:
    """fp64 [m, k]: each e4m3 code times its 128x128 block's scale."""
    s = c["scales"].to(FP64).repeat_interleave(128, 0).repeat_interleave(128, 1)
    return c["codes"].to(FP64) * s[: c["codes"].shape[0], : c["codes"].shape[1]]


def _fp4_picked_weights(c: Case) -> torch.Tensor:
    """fp64 [s, n, k]: row r's expert weight, e2m1 codes (low nibble first; bit 3 the sign) times 1x32 scales (e8m0
    bytes)."""
    return _stored_fp4(c["packed"].index_select(0, c["experts"]), c["scales"].index_select(0, c["experts"]))


def _per_group(c: Case, w: torch.Tensor, f) -> torch.Tensor:
    """f(x_g, w_g) for each of ``c["groups"]`` groups (x [n, groups * k], w [m, k]: group g is x's g-th k columns
    and w's g-th m / groups rows), concatenated over the output columns."""
    groups, x = c["groups"], _d(c["x"])
    xs, ws = x.unflatten(-1, (groups, -1)), w.unflatten(0, (groups, -1))
    return torch.cat([f(xs[:, g], ws[g]) for g in range(groups)], dim=-1)


def _expected_fp8_weight_linear(c: Case) -> tuple[torch.Tensor, ...]:
    return (_per_group(c, _fp8_weight(c), linear_oracle.act_linear),)


def _fp8_weight_linear_bound(c: Case) -> torch.Tensor:
    return _per_group(c, _fp8_weight(c), lambda x, w: _linear_bound(x, w, c["act"]))


def _expected_fp32_linear(c: Case) -> tuple[torch.Tensor, ...]:
    return (linear_oracle.act_linear(_d(c["x"]), _d(c["weight"])),)


def _fp32_linear_bound(c: Case) -> torch.Tensor:
    """|error| <= SLACK k 2^-23 sum_k |x_k| |w_jk|: fp32 accumulation of exact products, no output rounding."""
    x, w = _d(c["x"]), _d(c["weight"])
    return (SLACK * x.shape[-1] * 2.0**-23 * (x.abs() @ w.abs().T)).nan_to_num(0.0)


def _expected_fp4_picked_linear(c: Case) -> tuple[torch.Tensor, ...]:
    w, x = _fp4_picked_weights(c), _d(c["x"])
    return (torch.stack([linear_oracle.act_linear(x[r : r + 1], w[r])[0] for r in range(len(x))]),)


def _fp4_picked_linear_bound(c: Case) -> torch.Tensor:
    w, x = _fp4_picked_weights(c), _d(c["x"])
    return torch.cat([_linear_bound(x[r : r + 1], w[r], c["act"]) for r in range(len(x))])


_FP32_TOL = _rel(FP32_REL, "fp32 math throughout: roundoff 2^-24 grown by sums of <= 2^10 terms and 20 Sinkhorn "
                           "rounds stays under 2^-14 relative; a single bf16 rounding (2^-8) anywhere is 64x over")
def _expected_take(c: Case) -> tuple[torch.Tensor, ...]:
    return (c["stack"][int(c["index"][0])].clone(),)


def _expected_put_at_block_end(c: Case) -> tuple[torch.Tensor, ...]:
    p, ratio = int(c["pos"][0]), c["ratio"]
    store = c["store"].clone()
    if p % ratio == ratio - 1:
        slot = p // ratio + c["offset"]
        store[slot % c["ring"] if c["ring"] else slot] = c["row"][0]
    return (store,)


def _step_slots(c: Case) -> list[int]:
    """A decode step's store rows, stated plainly: the window's positions max(0, p - w + 1) .. p oldest first at
    their ring slot (position % w), -1 for the slots not filled yet, then the compressed entries it sees (CSA: each
    pick j with 0 <= j < (p + 1) // 4; HCA: each entry j < (p + 1) // ratio of n_compressed) at row w + j, else -1."""
    p, w, ratio = int(c["pos"][0]), c["window"], c["ratio"]
    seen = range(max(0, p - w + 1), p + 1)
    slots = [q % w for q in seen] + [-1] * (w - len(seen))
    limit = (p + 1) // ratio if ratio else 0
    entries = c["picks"].flatten().tolist() if ratio == 4 else list(range(c["n_compressed"])) if ratio else []
    return slots + [w + j if 0 <= j < limit else -1 for j in entries]


def _expected_decode_slots(c: Case) -> tuple[torch.Tensor, ...]:
    slots = _step_slots(c)
    rows = torch.tensor([max(s, 0) for s in slots], dtype=torch.int64)
    local = torch.tensor([[i if s >= 0 else -1 for i, s in enumerate(slots)]], dtype=torch.int64)
    return rows, local


def _expected_mask_past(c: Case) -> tuple[torch.Tensor, ...]:
    limit = (int(c["pos"][0]) + 1) // c["ratio"]
    scores = c["scores"].clone()
    scores[:, limit:] = float("-inf")
    return (scores,)


def _expected_radix_topk(c: Case) -> tuple[torch.Tensor, ...]:
    scores = c["scores"].float()  # bf16 -> fp32 is exact: the same order
    return (indexer_oracle.stable_topk_indices(scores.reshape(-1, scores.shape[-1]), c["k"]),)


def _expected_moe_sum(c: Case) -> tuple[torch.Tensor, ...]:
    out, y = c["out"], torch.zeros(c["shared"].shape, dtype=torch.float32)
    for j in range(out.shape[1]):
        y = y + out[:, j].float()
    return ((y + c["shared"].float()).to(torch.bfloat16),)


_ONE_ROUNDING = "fp32 math rounded once to bf16: relative error <= u = 2^-8 (x1.25 for fp32 noise)"

# one contract per op, under the name ``registry.OPS[op].contract`` gives (``fidelity.testing.contract_of``)

act_linear = OpContract(
    "tolerance", _expected_act_linear,
    (Output("y", BF16, Tolerance(bound=_act_linear_bound, why=(
        "elementwise forward-error bound: one e4m3 rounding per activation (2^-4, act 'fp8') times "
        "sum_k |x_k w_jk|, fp32 accumulation (k 2^-23), one bf16 rounding of y (1.25u): rows of signed "
        "products cancel, so a per-row relative limit cannot hold"))),),
    "The FP8 / FP4 GEMM of every linear layer: x quantized e4m3 in 1x128 blocks with ue8m0 scales (spec §3 "
    "act_quant; not for act 'bf16'), products with the exactly dequantized weight accumulated in fp32, output "
    "bf16 (spec §3 fp8_gemm / fp4_gemm).")
fp8_weight_linear = OpContract(
    "tolerance", _expected_fp8_weight_linear,
    (Output("y", BF16, Tolerance(bound=_fp8_weight_linear_bound, why=(
        "act_linear's bound with the weight dequantized from its codes and 128x128 scales"))),),
    "act_linear on a weight given as stored (e4m3 codes and 128x128 power-of-two scales, spec §2): each "
    "weight is its code times its block's scale exactly; the rest as act_linear (the decode GEMV path). With "
    "groups > 1, output row j multiplies x's group j // (m / groups) (wo_a's grouped projection, spec §4).")
fp32_linear = OpContract(
    "tolerance", _expected_fp32_linear,
    (Output("y", torch.float32, Tolerance(bound=_fp32_linear_bound, why=(
        "bf16 x bf16 products are exact in fp32; only the fp32 accumulation (k 2^-23 sum |x w|) rounds"))),),
    "The compressors' projections: x.float() @ W^T in fp32 with the bf16-stored weight's exact values, fp32 "
    "out (spec §4 Compressor; official fp32 Linear).")
fp4_picked_linear = OpContract(
    "tolerance", _expected_fp4_picked_linear,
    (Output("y", BF16, Tolerance(bound=_fp4_picked_linear_bound, why=(
        "act_linear's bound per row, with that row's expert weight dequantized from its e2m1 codes and 1x32 "
        "scales"))),),
    "Row r times the FP4 weight of expert experts[r] (e2m1 codes two per byte, low nibble first, 1x32 "
    "power-of-two scales, spec §2), as act_linear (graph decode's routed experts, picked on the device).")
rms_norm = OpContract(
    "tolerance", _expected_rms_norm,
    (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)),),
    "RMSNorm in fp32 with the fp32 weight, one bf16 rounding at the end (spec §3 'No fused RMSNorm kernel').")
rms_norm_fp8 = OpContract(
    "tolerance", _expected_rms_norm_fp8,
    (Output("codes", torch.float8_e4m3fn, Tolerance(bound=_rms_norm_fp8_value_bound, why=(
        "dequantized codes vs the exact y, elementwise: the e4m3 round-to-nearest step (half an ulp: "
        "<= 2^-4 |y|, or 2^-10 s on the subnormal codes) plus the bf16 rounding of y (1.25u |y|)"))),
     Output("scales", torch.uint8, Tolerance(bound=_rms_norm_fp8_scale_bound, why=(
         "the ue8m0 byte of 2^ceil(log2(max(amax, 1e-4) / 448)) per 1x128 block, for an amax within "
         "1.25u of the exact one (two bytes are admissible only where that straddles a power of two)")))),
    "RMSNorm (as rms_norm) then the 1x128 e4m3 activation quantization of every FP8 GEMM input "
    "(spec §3 act_quant, ue8m0 scales). Exact math has no FP8 rounding, so the codes are judged by the "
    "rounding step they may take from the exact y.", canonical=_dequantize_codes)
rms_norm_act_quant = OpContract(
    "tolerance", lambda c: (_rms_norm_fp8_exact(c)[0],) * 2,
    (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)),
     Output("xq", BF16, Tolerance(bound=_rms_norm_fp8_value_bound, why=(
         "y quantized-dequantized vs the exact y, elementwise: rms_norm_fp8's bound on code * scale")))),
    "RMSNorm (as rms_norm) and the same y quantized-dequantized in 1x128 e4m3 blocks with ue8m0 scales, bf16 "
    "(spec §3 act_quant in place): the input of every FP8 GEMM the norm feeds, made once.")
rms_norm_weightless = OpContract(
    "tolerance", _expected_rms_norm_weightless,
    (Output("q", BF16, _rel(3.5 * SLACK * U_BF16, cos_r=_ONE, why=(
        "every op in bf16: square (averaged in the mean), mean, +eps and rsqrt roundings give a per-row "
        "scale error <= 2.5u, plus u for the final product: |rel| <= 3.5u; the row scale does not move "
        "cos, so cos is held to one rounding (u)"))),),
    "q * rsqrt(mean(q^2) + eps) with each op rounding to bf16 (spec §4 Attention step 1).")
apply_rope = OpContract(
    "tolerance", _expected_apply_rope,
    (Output("x", BF16, replace(_rel(_ONE, _ONE_ROUNDING + "; the nope dims (all but the last 64) pass "
                                    "through: elementwise bound 0 there"), bound=_rope_bound)),),
    "Interleaved pairs (x[2i], x[2i+1]) of the last 64 dims rotated by fp32(position) * fp32(freq_i) (the "
    "reference's fp32 angle table: at 2^20 its rounding moves the phase by up to 2^-4 rad, so ports must "
    "reproduce it), cos/sin and the rotation in fp32, one bf16 rounding; inverse=True rotates by the "
    "conjugate (spec §4 Attention step 3).")
kv_round = OpContract(
    "bitexact", _expected_kv_round,
    (Output("kv", BF16, None),),
    "Exact math has no FP8 rounding, so the contract is bit-exactness (+0 == -0) against "
    "fake_quant_fp8(kv[..., :-64], 64, scale_floor) (the in-place act_quant, e4m3 RNE with 1x64 ue8m0 scales "
    "floored on the amax, or on the scale under scale_floor 'scale') with the 64 rope dims unchanged (spec §3 "
    "'Where quantization lives'). No NaN is planted: the CUDA amax may drop NaN (fmaxf), which the CPU "
    "reference cannot decide.")
indexer_round = OpContract(
    "bitexact",
    lambda c: (indexer_round_reference(c["x"], c["fmt"], c["rotate"]),),
    (Output("x", BF16, None),),
    "The indexer's query and key rounding (spec §3 rotate_activation, fp4_act_quant): the Walsh-Hadamard "
    "rotation in fp32 butterflies scaled by d^-0.5 and stored bf16, then e2m1 RNE in 1x32 blocks with ue8m0 "
    "scales (2^ceil(log2(max(amax, 6 * 2^-126) / 6)) from the bits). Exact math has no FP4 rounding, so the "
    "contract is bit-exactness (+0 == -0) against the formats module's hadamard and fake_quant_fp4.")
compressor_decode = OpContract(
    "tolerance", _expected_compressor_decode,
    (Output("entry", BF16, _rel(3 * _ONE, (
        "the pool in fp32 (exp, sums: ~2^-20) rounded to bf16, then RMSNorm and RoPE, one bf16 rounding each: "
        "|rel| <= 3 x 1.25u"))),
     Output("carry_kv", FP32, _FP32_TOL), Output("carry_score", FP32, _FP32_TOL)),
    "A compressor's decode step after its projections (spec §4-§5 Compressor.forward): score + ape[pos % r] and "
    "kv into the carry's slot of pos, the per-channel softmax pool of the carried slots (overlap, r = 4: the "
    "previous block's first halves then this block's second halves), stored bf16, RMSNorm and RoPE at the "
    "block's first position; the overlap carry shifts where the block completes. The entry is the pool of the "
    "slots as they stand: the compressed entry where the block completes.")
kv_norm_rope_fp8 = OpContract(
    "tolerance", _expected_kv_norm_rope_fp8,
    (Output("kv", BF16, Tolerance(bound=_kv_norm_rope_fp8_bound, why=(
        "elementwise vs the exact norm + rotation: one bf16 rounding of the norm (1.25u |y|), then on the "
        "nope dims the e4m3 round-to-nearest step of 1x64 blocks (fmt 'fp8'), on the rope dims that rounding "
        "carried through the rotation plus the output's (2 x 1.25u over the pair)"))),),
    "The attention KV path (spec §4 Attention steps 2-3): kv_norm (RMSNorm with weight, bf16 out), "
    "interleaved RoPE on the last 64 dims at fp32 angles (bf16 out), and the 1x64 ue8m0 e4m3 round of the "
    "nope dims (act_quant in place; fmt 'fp8'; scale_floor: the scale rule, as kv_round's). Exact math has no "
    "FP8 rounding, so the nope dims are judged by the step they may take from the exact value.")
index_scores = OpContract(
    "tolerance", _expected_index_scores,
    (Output("scores", BF16, Tolerance(bound=_index_scores_bound, why=(
        "elementwise forward-error bound 4u * sum_h |w_h| relu(q_h.k) + d 2^-23 * sum_h |w_h| |q_h|.|k|: "
        "signed head weights cancel, so a per-row relative (cos / calc_diff) limit cannot hold when a "
        "score is near 0; the bound is relative to the terms instead"))),),
    "sum_h w_h * relu(q_h . k_j) with the einsum, ReLU, product and head sum each rounding to bf16 "
    "(spec §4 Indexer), no causal mask (the caller masks).")
index_scores_fp4 = OpContract(
    "tolerance",
    lambda c: _expected_index_scores(_fp4_keys_case(c)),
    (Output("scores", BF16, Tolerance(bound=lambda c: _index_scores_bound(_fp4_keys_case(c)), why=(
        "index_scores' elementwise bound on the dequantized keys (dequantization is exact)"))),),
    "index_scores against the packed FP4 key cache (codes: low nibble = element 2i; ue8m0 scale byte per "
    "32 dims; spec §3 fp4_act_quant, §4 Indexer), the keys' values e2m1 * 2^(b-127).")
sparse_attention = OpContract(
    "tolerance", _expected_sparse_attention,
    (Output("o", BF16, _rel(2 * SLACK * U_BF16, (
        "two bf16 roundings: P is cast to bf16 before P.V (the denominator keeps fp32 P), and the output; "
        "|rel| <= 2u per (query, head) row"))),),
    "Online softmax over idx (-1: row zeroed, logit -inf), sink in the denominator only "
    "(exp(sink - m), no value row), fp32 logits x scale, P rounded to bf16 for P.V, bf16 output "
    "(spec §3 sparse_attn). Expected: oracles.attention.sparse_attention in fp64 on the gathered rows.")
sparse_attention_fp8kv = OpContract(
    "tolerance", _expected_sparse_attention_fp8kv,
    (Output("o", BF16, _rel(2 * SLACK * U_BF16, (
        "sparse_attention's: the packed rows decode exactly, so the same two bf16 roundings"))),),
    "sparse_attention over packed FP8 KV rows ([nope e4m3 codes | rope bf16 | ue8m0 scale bytes | pad], 584 B "
    "at head_dim 512; spec §3 kv_cache with FP8 nope dims). Expected: the rows decoded, then "
    "oracles.attention.sparse_attention in fp64 on the gathered rows.")
hc_pre = OpContract(
    "tolerance", _expected_hc_pre,
    (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)), Output("pre", FP32, _FP32_TOL),
     Output("post", FP32, _FP32_TOL), Output("comb", FP32, _FP32_TOL)),
    "mixes = (flatten(x) @ fn^T) * rsqrt(mean(x^2) + eps) in fp32, hc_split_sinkhorn (20 rounds), "
    "y = sum_i pre_i x_i in fp32 -> bf16 (spec §4 mHC block).")
hc_post = OpContract(
    "tolerance", _expected_hc_post,
    (Output("out", BF16, _rel(_ONE, _ONE_ROUNDING)),),
    "out_k = post_k f + sum_j comb[j, k] residual_j (comb transposed) in fp32 -> bf16 (spec §4 mHC block).")
hc_head = OpContract(
    "tolerance", _expected_hc_head,
    (Output("y", BF16, _rel(_ONE, _ONE_ROUNDING)),),
    "pre = sigmoid(mixes * scale + base) + eps, y = sum_i pre_i x_i in fp32 -> bf16 (spec §4 head).")
sinkhorn_split = OpContract(
    "tolerance", _expected_sinkhorn_split,
    (Output("pre", FP32, _FP32_TOL), Output("post", FP32, _FP32_TOL), Output("comb", FP32, _FP32_TOL)),
    "hc_split_sinkhorn in fp32: sigmoid pre (+eps), 2*sigmoid post, comb = softmax + eps, column division, "
    "then 19 row/column rounds, ending column-normalised (spec §3).")
gate = OpContract(
    "tolerance", _expected_gate,
    (Output("weights", FP32, _FP32_TOL), Output("indices", None, None)),
    "sqrt(softplus(x @ W^T)) in fp32, top-k of scores + bias (or tid2eid[ids]), unbiased scores gathered, "
    "normalised, x route_scale (spec §4 MoE). Indices must be the same set per row (compared sorted).",
    canonical=_sort_topk)
expert = OpContract(
    "tolerance", _expected_expert,
    (Output("y", BF16, _rel(2 * U_FP8 + 4 * U_BF16, (
        "two FP8 e4m3 activation roundings (x before w1/w3, the weighted h before w2; 2^-4 each) plus bf16 "
        "roundings of g, u, h and y: |rel| <= 2^-3 + 2^-6 per token row. Below this resolution: where "
        "the routing weight is applied (before/after w2 differ only by act-quant noise)"))),),
    "Clamped SwiGLU with FP8 (1x128 ue8m0) activation quantization before each GEMM, fp32 accumulation, "
    "routing weight applied to h before w2, bf16 output (spec §4 MoE).")
grouped_expert = OpContract(
    "tolerance", _expected_grouped_expert,
    (Output("y", BF16, _rel(2 * U_FP8 + 4 * U_BF16, (
        "expert's per (token, slot) row: the same roundings (two e4m3 activation roundings, bf16 g, u, h, y); "
        "the fp32 accumulation order of the grouped GEMM is far below them"))),),
    "expert for many tokens on the stored FP4 experts (e2m1 codes two per byte, low nibble first, 1x32 "
    "power-of-two scales, spec §2; w1 and w3 stacked): y[t, j] = expert experts[t, j] of x[t] with routing "
    "weight weights[t, j] (spec §4 MoE); quantized: x already on its e4m3 grid (not quantized again).")


def _record(op_name: str):
    from fidelity.decoders.production.registry import OPS

    if op_name not in OPS:
        raise KeyError(f"op {op_name!r}: no contract; expected one of {sorted(OPS)}")
    return OPS[op_name]


def contract_of(op_name: str) -> OpContract:
    """The contract of op ``op_name``: the attribute of this module its ``registry.OPS`` record names."""
    return globals()[_record(op_name).contract]


def strategy_of(op_name: str) -> st.SearchStrategy[Case]:
    """The default input strategy of op ``op_name``: the ``fidelity.testing.strategies`` function its
    ``registry.OPS`` record names, called with its defaults."""
    from fidelity.testing import strategies

    return getattr(strategies, _record(op_name).strategy)()
take = OpContract(
    "bitexact", _expected_take, (Output("y", BF16, None),),
    "stack[index[0]] copied, bit for bit, with the index read on the device only (graph decode's expert weights "
    "picked by a device-side expert id).")
decode_slots = OpContract(
    "bitexact", _expected_decode_slots, (Output("rows", None, None), Output("local", None, None)),
    "The rows one decode step at position p attends (spec §4 attention step 5: the sliding window of 128 incl. "
    "self, then the compressed entries j < (p + 1) // ratio the layer sees: the indexer's top-k on CSA layers, "
    "every one on HCA layers): the window's ring slots oldest first (-1 before it fills), then row window + j per "
    "visible entry (-1 past the causal limit or for a -1 pick); gather rows clamp -1 to row 0, the local indices "
    "keep -1. Integers: bit-exact.")
decode_idx = OpContract(
    "bitexact", lambda c: (torch.tensor([_step_slots(c)], dtype=torch.int32),),
    (Output("idx", None, None),),
    "decode_slots' rows as the attention's indices into the store itself (int32, -1 where none).")
mask_past = OpContract(
    "bitexact", _expected_mask_past, (Output("scores", BF16, None),),
    "Index scores [1, n] with every entry j >= (p + 1) // ratio set to -inf (causally invisible to the query at "
    "p, spec §4 Indexer), the rest unchanged.")
radix_topk = OpContract(
    "bitexact", _expected_radix_topk, (Output("ids", None, None),),
    "The k highest scores' ids per row, highest first, ties to the lower id (the oracle's stable descending "
    "sort: -0 == +0, NaN of either sign above +inf), bf16 or fp32 scores.")
moe_sum = OpContract(
    "bitexact", _expected_moe_sum, (Output("y", BF16, None),),
    "The MoE output: the routed slot outputs (ascending expert id) added in fp32 in slot order, then the shared "
    "expert's, rounded once to bf16 (spec §4 MoE; the order fixes the bits).")
put_at_block_end = OpContract(
    "bitexact", _expected_put_at_block_end, (Output("store", BF16, None),),
    "The row written to slot p // ratio + offset (modulo ring where ring > 0) only where the token at p completes a "
    "block of ratio (p % ratio == ratio - 1), every other row of the store unchanged (spec §5: a compressed entry "
    "is stored when its block completes; ratio 1: the window's ring slot p % ring).")

