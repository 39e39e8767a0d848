"""Checks of the decode step's element-wise kernels (``indexer_round``, ``apply_rope``) under Triton's CPU
interpreter; run as ``TRITON_INTERPRET=1 python -m tests.interpreted.decode_kernel_checks``
(``tests/test_decode_kernels_interpreted.py`` does so). Prints one JSON object: {check name: error text, empty when
the check passed}."""

from __future__ import annotations

import json

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.decode_slots import decode_idx_reference, decode_slots_reference
from fidelity.decoders.production.kernels import weight_gemv
from fidelity.decoders.production.kernels.act_quant import fake_quant_fp8
from fidelity.decoders.production.kernels.decode_slots import decode_idx_cuda, decode_slots_cuda, mask_past_cuda
from fidelity.decoders.production.kernels.expert import expert_cuda, swiglu, takes_expert
from fidelity.decoders.production.kernels.indexer_round import indexer_round_cuda
from fidelity.decoders.production.kernels.moe_sum import moe_sum
from fidelity.decoders.production.kernels.rope import apply_rope_cuda
from fidelity.decoders.production.kernels.take import put_at_block_end
from fidelity.decoders.production.moe import moe_sum as moe_sum_loop
from fidelity.decoders.production.registry import dispatch
from fidelity.model import formats
from tests import fp4_scale_bytes
from tests.interpreted import contract_error

BF16 = torch.bfloat16


def _bits_differ(x: torch.Tensor, rotate: bool) -> str:
    """'' when the kernel's bits equal the emulation's (signed zeros included), else a count."""
    want, got = ops.indexer_round(x, "fp4", rotate).view(torch.int16), indexer_round_cuda(x, "fp4", rotate).view(
        torch.int16)
    return "" if torch.equal(want, got) else f"{int((want != got).sum())} of {want.numel()} elements differ"


def expert_on_emulated_gemms(x, w1, w2, w3, limit, weight, act, linear=None):
    """The expert kernel's SwiGLU launch between the emulation's GEMMs (the interpreter's e4m3 conversion is not the
    hardware's, so the GEMMs' activation quantization stays in torch here)."""
    linear = linear or ops.act_linear
    if takes_expert(x, w1, w2, w3, limit, weight, act, linear):
        return ops.expert(x, w1, w2, w3, limit, weight, act, linear)
    return expert_cuda(x, w1, w2, w3, limit, weight, act, linear)


def fp4_gemv_on_torch_quantization(x, experts, packed, scales, act="fp8"):
    """The FP4 expert GEMV (its input preparation and word-wise decode) on x quantized by ``formats`` for act
    "fp8" (the interpreter's e4m3 rounding is not the hardware's), x as given for "bf16"."""
    return weight_gemv.fp4_expert_linear(formats.fake_quant_fp8(x, 128) if act == "fp8" else x, experts, packed,
                                         scales)


def _contract(op: str, fn) -> str:
    return contract_error(op, fn, 40)


def main() -> dict[str, str]:
    g = torch.Generator().manual_seed(0)
    out = {"indexer_round_contract": _contract("indexer_round", dispatch("indexer_round")),
           "apply_rope_contract": _contract("apply_rope", dispatch("apply_rope")),
           "expert_contract": _contract("expert", expert_on_emulated_gemms),
           "gate_contract": _contract("gate", dispatch("gate")),
           "compressor_decode_contract": _contract("compressor_decode", dispatch("compressor_decode")),
           "fp4_picked_linear_contract": _contract("fp4_picked_linear", fp4_gemv_on_torch_quantization)}
    q = torch.randn(2, 64, 128, generator=g) * torch.exp2(torch.randint(-30, 30, (2, 64, 1), generator=g).float())
    out["queries_64_heads"] = _bits_differ(q.to(BF16), True)
    key = torch.randn(1, 128, generator=g)
    key[0, :32] = -0.0  # a block of negative zeros, unrotated: -0 codes
    out["key_signed_zeros_unrotated"] = _bits_differ(key.to(BF16), False)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 16).mul(torch.tensor([1.0, -1.0]).repeat(64))
    out["e2m1_ties_to_even"] = _bits_differ(ties[None].to(BF16), False)
    big = torch.randn(3, 128, generator=g)
    big[0, 5], big[1, 7], big[2, :] = 3.0e38, 1e-38, 0.0  # a scale at 2^127, one of tiny values, a zero row
    out["extreme_scales"] = _bits_differ(big.to(BF16), False) or _bits_differ(big.to(BF16), True)
    x = torch.randn(2, 8, 512, generator=g).to(BF16)
    rotated = apply_rope_cuda(x, torch.tensor([5, 70000]), torch.rand(32, generator=g), inverse=True)
    out["rope_keeps_the_nope_dims"] = "" if torch.equal(rotated[..., :448], x[..., :448]) else "nope dims changed"
    out["gemvs_quantize_in_kernel_as_the_separate_launch"] = _gemv_quantize_differs(g)
    out["k_sliced_gemv_adds_the_slices_in_order_and_resets_its_counts"] = _k_slices_differ(g)
    out["expert_w1_w3_in_one_launch_give_the_two_launches_bits"] = _expert_pair_differs(g)
    out["e8m0_scale_decodes_every_byte_as_formats"] = fp4_scale_bytes.decode_differs()
    out["fp4_gemv_scale_bytes_0_1_127_254_255_give_the_emulations_bits"] = _fp4_scale_bytes_differ()
    out["decode_slots_give_the_references_integers"] = _decode_slots_differ(g)
    out["put_at_block_end_writes_the_row_only_where_the_block_completes"] = _put_at_block_end_differs(g)
    out["mask_past_hides_the_entries_past_the_limit"] = _mask_past_differs(g)
    out["rms_norm_weightless_contract"] = _contract("rms_norm_weightless", dispatch("rms_norm_weightless"))
    slots, shared = (torch.randn(3, 6, 700, generator=g) * 100).to(BF16), torch.randn(3, 700, generator=g).to(BF16)
    out["moe_sum_gives_the_loops_bits"] = "" if torch.equal(moe_sum(slots, shared), moe_sum_loop(slots, shared)) else \
        "differs from the torch loop"
    gu = (torch.randn(2, 5, 300, generator=g) * 8).to(BF16)
    weight = torch.rand(5, 1, generator=g)
    same = [torch.equal(swiglu(gu[0], gu[1], 7.0, w, clamp).float(), ops.swiglu(gu[0], gu[1], 7.0, w, clamp).float())
            for w in (weight, None) for clamp in (True, False)]
    out["swiglu_close_to_the_emulation"] = "" if _swiglu_close(gu, weight) else f"bit-equal cases {same}"
    return out


def _decode_slots_differ(g: torch.Generator) -> str:
    """Positions around the window filling and the compression boundaries; CSA picks past the causal limit. The
    store indices (``decode_idx``) name the rows the gather puts at each local index, -1 where none."""
    bad = []
    for ratio, n_comp in ((0, 0), (4, 37), (128, 5)):
        for t in (0, 1, 5, 126, 127, 128, 129, 130, 255, 256, 511, 640):
            pos = torch.tensor([t])
            picks = torch.randperm(n_comp + 20, generator=g)[:n_comp][None] if ratio == 4 else None
            want = decode_slots_reference(pos, picks, 128, ratio, n_comp)
            got = decode_slots_cuda(pos, picks, 128, ratio, n_comp)
            if not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
                bad.append(f"ratio {ratio} t {t}")
            idx = decode_idx_cuda(pos, picks, 128, ratio, n_comp)
            if not torch.equal(idx, decode_idx_reference(pos, picks, 128, ratio, n_comp)):
                bad.append(f"idx ratio {ratio} t {t}")
            rows, local = want  # the store rows the gathered buffer holds at the local indices
            if not torch.equal(idx.long(), torch.where(local >= 0, rows[None], -1)):
                bad.append(f"idx against the gather, ratio {ratio} t {t}")
    return ", ".join(bad)


def _k_slices_differ(g: torch.Generator) -> str:
    """A GEMV over 4 slices of k: the last slice to arrive adds the slices' fp32 partial sums in slice order, so the
    result is the fp32 sum of the four quarter-k GEMVs in that order, bit for bit; the arrival counts are back at
    zero afterwards (a CUDA-graph replay finds them as the capture did)."""
    k, n = 1024, 80
    x = (torch.randn(3, k, generator=g) * 4).to(BF16)
    w = torch.randn(n, k, generator=g).to(BF16)
    got = weight_gemv.bf16_weight_linear_f32(x, w, splits=4, bk=128)
    q = k // 4
    want = weight_gemv.bf16_weight_linear_f32(x[:, :q], w[:, :q], splits=1, bk=128)
    for i in range(1, 4):
        want = want + weight_gemv.bf16_weight_linear_f32(x[:, i * q:(i + 1) * q], w[:, i * q:(i + 1) * q], splits=1,
                                                        bk=128)
    counts = weight_gemv._split_counts(x.device, 1)
    bad = [] if torch.equal(got, want) else ["sum of the slices"]
    if counts.any():
        bad.append(f"counts left at {counts.nonzero().flatten().tolist()}")
    return ", ".join(bad)


def _expert_pair_differs(g: torch.Generator) -> str:
    """The routed experts on FP4 stacks (w1 and w3 as views of one stacked pair): ``expert_cuda`` with a linear
    offering ``pair`` (w1 and w3 in one launch) gives the bits of the two separate launches."""
    e_count, n, k, slots = 3, 128, 256, 4
    stack = torch.randint(0, 256, (e_count, 2 * n, k // 2), generator=g, dtype=torch.uint8)
    scales = (127 + torch.randint(-8, 2, (e_count, 2 * n, k // 32), generator=g)).to(torch.uint8)  # e8m0 bytes
    w2 = (torch.randint(0, 256, (e_count, k, n // 2), generator=g, dtype=torch.uint8),
          (127 + torch.randint(-8, 2, (e_count, k, n // 32), generator=g)).to(torch.uint8))
    w1, w3 = (stack[:, :n], scales[:, :n]), (stack[:, n:], scales[:, n:])
    picks = torch.tensor([2, 0, 1, 2])
    x = (torch.randn(1, k, generator=g) * 4).to(BF16).expand(slots, -1)
    weight = torch.rand(slots, 1, generator=g)

    def linear(xs, w, act):
        return weight_gemv.fp4_picked_linear_cuda(xs, picks, *w, act)

    two = expert_cuda(x, w1, w2, w3, 7.0, weight, "fp8", linear)
    linear.pair = lambda xs, act: linear(xs, (stack, scales), act).split(n, dim=-1)
    one = expert_cuda(x, w1, w2, w3, 7.0, weight, "fp8", linear)
    return "" if torch.equal(one, two) else "differ"


def _fp4_scale_bytes_differ() -> str:
    """The FP4 expert GEMV on e8m0 scale bytes 0, 1, 2, 127, 250, 253, 254, 255 (``tests/fp4_scale_bytes.py``: exact
    by construction) gives the emulation's bits, NaN rows where the emulation has them: x as given, over 1 and 2
    slices of k, and quantized in the launch (act "fp8")."""
    case = fp4_scale_bytes.gemv_case()
    want = ops.fp4_picked_linear(**case, act="fp8")
    lost = fp4_scale_bytes.gemv_case_lost(want)
    if lost:
        return lost
    bad, args = [], (case["x"], case["experts"], case["packed"], case["scales"])
    for name, got in (("x as given", weight_gemv.fp4_expert_linear(*args)),
                      ("2 slices", weight_gemv.fp4_expert_linear(*args, splits=2)),
                      ("quantized in the launch", weight_gemv.fp4_picked_linear_cuda(**case, act="fp8"))):
        differ = fp4_scale_bytes.nan_aware_differs(want, got)
        if differ:
            bad.append(f"{name}: {differ}")
    return ", ".join(bad)


def _put_at_block_end_differs(g: torch.Generator) -> str:
    """The row lands at pos // ratio + offset exactly where pos completes a block, nowhere otherwise; with a ring,
    at pos % ring."""
    bad = []
    for dtype in (BF16, torch.float8_e4m3fn, torch.uint8):
        store = torch.randn(9, 3, 40, generator=g).to(dtype) if dtype != torch.uint8 else \
            torch.randint(0, 256, (9, 3, 40), generator=g, dtype=torch.uint8)
        row = torch.randn(1, 3, 40, generator=g).to(dtype) if dtype != torch.uint8 else store[:1] ^ 0x5A
        for pos, ratio, offset in ((3, 4, 0), (7, 4, 2), (4, 4, 0), (6, 4, 1), (0, 1, 3), (255, 128, 5), (254, 128, 5)):
            want, got = store.clone(), store.clone()
            if pos % ratio == ratio - 1:
                want[pos // ratio + offset] = row[0]
            put_at_block_end(got, torch.tensor([pos]), ratio, offset, row)
            if not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
                bad.append(f"{dtype} pos {pos} ratio {ratio} offset {offset}")
        for pos in (0, 8, 9, 130):  # a window of 9 slots: the row at pos % 9
            want, got = store.clone(), store.clone()
            want[pos % 9] = row[0]
            put_at_block_end(got, torch.tensor([pos]), 1, 0, row, ring=9)
            if not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
                bad.append(f"{dtype} pos {pos} ring 9")
    return ", ".join(bad)


def _mask_past_differs(g: torch.Generator) -> str:
    bad = []
    for t, ratio, n in ((0, 4, 40), (2, 4, 40), (3, 4, 40), (155, 4, 40), (9, 4, 1), (1000, 128, 9)):
        scores = torch.randn(1, n, generator=g).to(BF16)
        want = scores.masked_fill(torch.arange(n)[None] >= (t + 1) // ratio, float("-inf"))
        if not torch.equal(mask_past_cuda(scores.clone(), torch.tensor([t]), ratio), want):
            bad.append(f"t {t} ratio {ratio} n {n}")
    return ", ".join(bad)


def _swiglu_close(gu: torch.Tensor, weight: torch.Tensor) -> bool:
    """The interpreter's exp is numpy's, not libdevice's expf (the GPU test pins the bits): within one bf16 ulp."""
    a, b = swiglu(gu[0], gu[1], 7.0, weight, True).float(), ops.swiglu(gu[0], gu[1], 7.0, weight, True).float()
    return bool(((a - b).abs() <= 2.0**-7 * b.abs() + 1e-30).all())


def _gemv_quantize_differs(g: torch.Generator) -> str:
    """The decode GEMVs with the activation quantized in their own launch (``quantize=True``) give the bits of the
    separate quantization kernel followed by the GEMV (the interpreter's e4m3 conversion is not the hardware's,
    so both sides run the same kernels here; the GPU test compares with the emulation); a token's row repeated
    for its expert slots as a stride-0 view gives the bits of the copied rows."""
    k, n, experts = 512, 256, 3
    x = (torch.randn(2, k, generator=g) * torch.exp2(torch.randint(-8, 8, (2, k), generator=g).float())).to(BF16)
    codes = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-8, 2, (n // 128, k // 128), generator=g).float())
    packed = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
    fp4_scales = (127 + torch.randint(-8, 2, (experts, n, k // 32), generator=g)).to(torch.uint8)  # e8m0 bytes
    picks = torch.tensor([2, 0])
    same = [torch.equal(weight_gemv.fp8_weight_linear(fake_quant_fp8(x, 128), codes, scales),
                        weight_gemv.fp8_weight_linear(x, codes, scales, quantize=True)),
            torch.equal(weight_gemv.fp4_expert_linear(fake_quant_fp8(x, 128), picks, packed, fp4_scales),
                        weight_gemv.fp4_expert_linear(x, picks, packed, fp4_scales, quantize=True)),
            torch.equal(weight_gemv.fp4_expert_linear(x[:1].expand(2, -1), picks, packed, fp4_scales, quantize=True),
                        weight_gemv.fp4_expert_linear(x[:1].repeat(2, 1), picks, packed, fp4_scales, quantize=True))]
    return "" if all(same) else f"equal (fp8, fp4, fp4 on one row repeated as a stride-0 view): {same}"


if __name__ == "__main__":
    print(json.dumps(main()))
