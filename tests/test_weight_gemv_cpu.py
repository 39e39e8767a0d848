"""Op ``fp4_picked_linear`` (the decode step's routed experts on the stored FP4 weights) on the CPU: its inputs are
the experts as stored, packed e2m1 codes uint8 [E, n, k/2] and one e8m0 scale byte uint8 per 1x32 block
[E, n, k/32]. The emulation decodes the bytes as ``formats`` does (0 is 2^-127, 255 NaN), and the argument checks
of the emulation and of the GEMV kernel's entry points refuse fp32 (decoded) scales naming the tensor, expected vs
found. (The kernel's own reading of the bytes runs under Triton's CPU interpreter in
``tests/test_decode_kernels_interpreted.py``.)"""

import pytest
import torch

from fidelity.decoders.production import ops
from fidelity.model.formats import decode_e8m0, dequantize_fp4, fake_quant_fp8

BF16 = torch.bfloat16


def inputs(seed: int = 0, e_count: int = 3, n: int = 64, k: int = 256, slots: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(slots, k, generator=g).to(BF16),
            "experts": torch.randint(0, e_count, (slots,), generator=g),
            "packed": torch.randint(0, 256, (e_count, n, k // 2), generator=g, dtype=torch.uint8),
            "scales": (127 + torch.randint(-8, 3, (e_count, n, k // 32), generator=g)).to(torch.uint8)}


def test_emulation_dequantizes_the_scale_bytes_as_formats_does_at_the_ends_of_the_byte_range():
    """Bytes 0 (2^-127), 1, 127, 254 (2^127) and 255 (NaN) among the scales: the emulation's result is the same
    batched fp32 GEMM on the weights ``formats.dequantize_fp4`` makes of each slot's expert (codes and bytes), bit for
    bit, NaN where they make NaN."""
    args = inputs(1)
    flat = args["scales"].view(-1)
    picks = torch.arange(0, flat.numel(), 7)
    flat[picks] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)[torch.arange(len(picks)) % 5]
    w = torch.stack([dequantize_fp4(args["packed"][e], args["scales"][e], 32) for e in args["experts"].tolist()])
    for act in ("fp8", "bf16"):
        xq = fake_quant_fp8(args["x"], 128) if act == "fp8" else args["x"]
        want = (xq.float()[:, None, :] @ w.transpose(1, 2)).squeeze(1).to(BF16)
        got = ops.fp4_picked_linear(**args, act=act)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), act
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), act
        assert nan.any() and not nan.all()


def test_the_emulations_fp4_dequantization_is_formats_bit_for_bit():
    """``ops._fp4_dequantized`` (the grouped expert emulation's weights) on every byte 0..255 = ``dequantize_fp4``."""
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (256, 16), generator=g, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]
    got, want = ops._fp4_dequantized(packed, scales), dequantize_fp4(packed, scales, 32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got[255].isnan().all() and got[0].abs().max() == 6 * 2.0**-127


@pytest.mark.parametrize(("name", "bad", "match"), [
    ("scales", decode_e8m0,
     r"fp4_picked_linear: scales: expected e8m0 scale bytes uint8 \[3, 64, 8\], found torch.float32 \[3, 64, 8\]"),
    ("scales", lambda t: t[..., :4], r"scales: expected e8m0 scale bytes uint8 \[3, 64, 8\], found torch.uint8 "
                                     r"\[3, 64, 4\]"),
    ("packed", lambda t: t.view(torch.int8), r"packed: expected packed FP4 codes uint8 \[E, n, 128\]"),
    ("experts", lambda t: t[:2], r"experts: expected integer ids \[4\]"),
    ("x", lambda t: t[:, :200], r"x: expected \[s, k\] with 32 \| k"),
])
def test_emulation_refuses_inputs_that_are_not_the_stored_experts_naming_the_tensor(name, bad, match):
    args = inputs()
    args[name] = bad(args[name])
    with pytest.raises(ValueError, match=match):
        ops.fp4_picked_linear(**args)


def test_the_gemv_kernels_entry_points_refuse_fp32_scales_before_any_launch():
    """``fp4_expert_linear`` and ``takes_fp4_picked_linear`` (which the registry asks before the kernel) raise on
    decoded fp32 scales, naming them, expected vs found (no device needed: nothing is launched)."""
    pytest.importorskip("triton")
    from fidelity.decoders.production.kernels import weight_gemv

    args = inputs()
    args["scales"] = decode_e8m0(args["scales"])
    with pytest.raises(ValueError, match=r"fp4_expert_linear: scales: expected e8m0 scale bytes uint8 \[3, 64, 8\], "
                                         r"found torch.float32 \[3, 64, 8\]"):
        weight_gemv.fp4_expert_linear(args["x"], args["experts"], args["packed"], args["scales"])
    with pytest.raises(ValueError, match=r"fp4_picked_linear: scales: expected e8m0 scale bytes uint8 \[3, 64, 8\], "
                                         r"found torch.float32 \[3, 64, 8\]"):
        weight_gemv.takes_fp4_picked_linear(**args, act="fp8")


@pytest.mark.parametrize("weight, n, k, slices", [
    ("wo_b", 4096, 8192, 4), ("wq_a", 1024, 4096, 8), ("wkv", 512, 4096, 8), ("shared w1", 2048, 4096, 8),
    ("wq_b", 32768, 1024, 1), ("indexer wq_b", 8192, 1024, 1), ("shared w2", 4096, 2048, 1)])
def test_fp8_gemv_slices_rows_of_4096_columns_or_more_over_about_eight_programs_per_sm(weight, n, k, slices):
    """The FP8 GEMV's default k slices for a decode row on an H100's 132 SMs (16-row blocks, 512-column steps): the
    sweep's fastest for the k >= 4096 weights, none for the k = 1024 / 2048 ones; no SMs (the interpreter): none."""
    weight_gemv = pytest.importorskip("fidelity.decoders.production.kernels.weight_gemv")
    assert weight_gemv.fp8_gemv_slices(n // 16, k, 512, 132) == slices, weight
    assert weight_gemv.fp8_gemv_slices(n // 16, k, 512, 0) == 1
