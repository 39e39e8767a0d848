"""Checks of the grouped expert kernels (``kernels/grouped_expert.py``) under Triton's CPU interpreter; run as
``TRITON_INTERPRET=1 python -m tests.interpreted.grouped_expert_checks`` (``tests/test_grouped_expert.py`` does
so). Prints one JSON object: {check name: error text, empty when the check passed}.

The interpreter's dot sums the exact products in numpy's fp32 order, and its e4m3 conversion is not the hardware's
(it differs from ``formats.fake_quant_fp8`` in a few percent of elements): so the kernel is held to the emulation's
bits, with the emulation's activation quantization taken from the interpreted quantizer for act "fp8"."""

from __future__ import annotations

import json

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.kernels import act_quant
from fidelity.decoders.production.kernels.grouped_expert import grouped_expert_cuda
from fidelity.model.formats import decode_e8m0
from fidelity.testing.strategies import _fp4_stored
from tests import fp4_scale_bytes

BF16 = torch.bfloat16


def _inputs(seed: int, n: int = 9, k: int = 2, e_count: int = 4, dim: int = 256, f: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    w13, s13 = _fp4_stored(g, e_count, 2 * f, dim, 4.0)
    w2, s2 = _fp4_stored(g, e_count, dim, f, 1.0)
    experts = torch.stack([torch.randperm(e_count, generator=g)[:k] for _ in range(n)])
    return {"x": (torch.randn(n, dim, generator=g) * 2).to(BF16), "weights": torch.rand(n, k, generator=g),
            "experts": experts, "w13": w13, "w13_scales": s13, "w2": w2, "w2_scales": s2, "limit": 10.0}


def _emulated(args: dict) -> torch.Tensor:
    """``ops.grouped_expert`` quantizing as the interpreted kernel does."""
    real = ops.fake_quant_fp8
    ops.fake_quant_fp8 = lambda x, block: act_quant.fake_quant_fp8(x, block)
    try:
        return ops.grouped_expert(**args)
    finally:
        ops.fake_quant_fp8 = real


def _bits(args: dict, block_m: int = 16) -> str:
    """'' when the kernel gives the emulation's bits (the emulation quantizing as the interpreted kernel does)."""
    want = _emulated(args)
    got = grouped_expert_cuda(**args, launch={"block_m": block_m})
    differ = int((want.view(torch.int16) != got.view(torch.int16)).sum())
    return "" if differ == 0 else f"{differ} of {want.numel()} elements differ"


def _scale_bytes_differ(act: str) -> str:
    """The kernels on e8m0 scale bytes 0, 1, 2, 127, 250, 253, 254, 255 (``tests/fp4_scale_bytes.py``) give the
    emulation's bits, NaN where the emulation has NaN."""
    args = {**fp4_scale_bytes.grouped_case(), "act": act}
    want = _emulated(args)
    # the interpreted quantizer's amax drops NaN (as fmaxf may on the GPU): expert 3's NaN g need not reach y
    lost = fp4_scale_bytes.grouped_case_lost(want, args["experts"], nan_h=act == "bf16")
    if lost:
        return lost
    return fp4_scale_bytes.nan_aware_differs(want, grouped_expert_cuda(**args, launch={"block_m": 16}))


def _raises(args: dict, match: str) -> str:
    try:
        grouped_expert_cuda(**args)
    except ValueError as exc:
        return "" if match in str(exc) else f"wrong message: {exc}"
    return "no error"


def main() -> dict[str, str]:
    uneven = _inputs(4, n=40, k=3, e_count=6, f=128)
    uneven["experts"][:, 0] = 2  # expert 2 in every token (three 16-row tiles), experts 0 and 5 never
    uneven["experts"][:, 1:] = torch.stack([torch.tensor([1, 3, 4])[torch.randperm(3)[:2]] for _ in range(40)])
    quantized = _inputs(3)
    quantized["x"] = act_quant.fake_quant_fp8(quantized["x"], 128)
    return {"bf16_bits": _bits({**_inputs(1), "act": "bf16"}),
            "fp8_bits_with_the_interpreters_quantizer": _bits({**_inputs(2), "act": "fp8"}),
            "quantized_input_bits": _bits({**quantized, "act": "fp8", "quantized": True}),
            "uneven_loads_over_several_tiles": _bits({**uneven, "act": "fp8"}),
            "bad_codes_raise_in_the_kernel_path": _raises({**_inputs(5), "w2": _inputs(5)["w2"][:, :, :64]}, "w2:"),
            "scale_bytes_0_1_127_254_255_give_the_emulations_bits": _scale_bytes_differ("fp8"),
            "scale_bytes_0_1_127_254_255_give_the_emulations_bits_bf16": _scale_bytes_differ("bf16"),
            "fp32_scales_raise_in_the_kernel_path": _raises(
                {**_inputs(5), "w13_scales": decode_e8m0(_inputs(5)["w13_scales"])},
                "w13_scales: expected e8m0 scale bytes uint8 [4, 512, 8], found torch.float32 [4, 512, 8]")}


if __name__ == "__main__":
    print(json.dumps(main()))
