"""The decode step's element-wise kernels built for sm_90 without a GPU (Triton's own compiler): the RoPE kernel takes
cos / sin from libdevice (``__nv_cosf`` / ``__nv_sinf`` inlined, the CUDA ``cosf`` / ``sinf`` torch's ``polar``
calls, not the ``.approx`` instructions) and rounds the complex product with two explicit FMAs and nothing fused
besides; the indexer_round kernel builds at every supported width."""

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fidelity.decoders.production.kernels import indexer_round, rope  # noqa: E402


def _ptx(fn, pointers: dict[str, str], ints: tuple[str, ...], consts: dict) -> str:
    sig = {**pointers, **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False}).asm["ptx"]


def _rope_ptx(inverse: bool, rotation: int) -> str:
    return _ptx(rope._rope_kernel, {"x_ptr": "*bf16", "pos_ptr": "*i64", "f_ptr": "*fp32", "y_ptr": "*bf16"},
                ("n_rows", "heads", "stride_x", "stride_y"),
                {"D": 512, "HALF": 256, "FIRST": 224, "ROWS": 4, "INVERSE": inverse, "ROTATION": rotation})


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_calls_libdevice_cos_sin_and_fuses_only_its_two_fmas(inverse):
    ptx = _rope_ptx(inverse, rope.ROTATION)
    cos_calls = len(re.findall(r"%__nv_cosf\.exit", ptx))  # libdevice's cosf inlined, once per pair a thread holds
    assert cos_calls > 0 and len(re.findall(r"%__nv_sinf\.exit", ptx)) == cos_calls
    assert not re.search(r"(sin|cos)\.approx", ptx)
    assert len(re.findall(r"\bfma\.rn\.f32", ptx)) == 2 * cos_calls  # per rotated pair: real and imaginary part
    assert not re.search(r"\bfma\.rn\.f32", _rope_ptx(inverse, 0))  # nothing else is fused


@pytest.mark.parametrize("d", [32, 64, 128, 256, 512])
def test_indexer_round_kernel_builds_at_every_supported_width(d):
    ptx = _ptx(indexer_round._indexer_round_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16"},
               ("n_rows", "stride_x", "stride_y"), {"ROWS": 4, "D": d, "SCALE": d**-0.5, "ROTATE": True})
    assert ".entry _indexer_round_kernel" in ptx
