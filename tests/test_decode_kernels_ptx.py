"""The decode step's element-wise kernels built for sm_90 without a GPU (Triton's own compiler): the RoPE kernel takes
cos / sin from libdevice (``__nv_cosf`` / ``__nv_sinf`` inlined, the CUDA ``cosf`` / ``sinf`` torch's ``polar``
calls, not the ``.approx`` instructions) and rounds the complex product with two explicit FMAs and nothing fused
besides; the indexer_round kernel builds at every supported width; the routed experts' FP4 kernels build reading the
stored e8m0 scale bytes (one byte load per scale, the value made by an exponent move, no conversion instruction)
and their input kernel quantizes only when asked; the mHC split-K finish kernels build at decode's and prefill's
tiles."""

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fidelity.decoders.production.kernels import grouped_expert, indexer_round, mhc, rope, weight_gemv  # noqa: E402


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


def _scale_reads(ptx: str) -> tuple[int, int]:
    """(byte loads, 4-byte float loads) from global memory in ``ptx``."""
    loads = r"ld\.global(?:\.\w+)*\."
    return len(re.findall(loads + r"(?:u8|b8)\b", ptx)), len(re.findall(loads + r"f32\b", ptx))


@pytest.mark.parametrize("final, even", [(True, True), (False, True), (True, False)])
def test_fp4_expert_gemv_builds_reading_e8m0_scale_bytes(final, even):
    ptx = _ptx(weight_gemv._fp4_expert_kernel,
               {"xp_ptr": "*fp32", "e_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*fp32"},
               ("n", "slots", "stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn"),
               {"k_split": 2048, "PLANE": 256, "BN": 16, "BB": 8, "EVEN": even, "FINAL": final})
    assert ".entry _fp4_expert_kernel" in ptx and _scale_reads(ptx)[0] > 0
    assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 23;", ptx)  # the e8m0 byte moved into the exponent


@pytest.mark.parametrize("block, quant", [(128, True), (128, False), (32, False)])
def test_fp4_gemv_input_kernel_builds_and_writes_fp32_planes(block, quant):
    ptx = _ptx(weight_gemv._fp4_input_kernel, {"x_ptr": "*bf16", "xp_ptr": "*fp32"}, ("k", "stride_x"),
               {"BLOCK": block, "QUANT": quant})
    assert ".entry _fp4_input_kernel" in ptx and re.search(r"st\.global(?:\.\w+)*\.b32", ptx)
    assert bool(re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == quant  # the e4m3 rounding only when asked


@pytest.mark.parametrize("bt, bd, sb", [(1, 512, 128), (4, 128, 32), (16, 256, 1)])
def test_mhc_finish_kernels_build_at_decode_and_prefill_tiles(bt, bd, sb):
    common = {"ws_ptr": "*fp32", "x_ptr": "*bf16", "scale_ptr": "*fp32", "base_ptr": "*fp32", "y_ptr": "*bf16"}
    ints = ("n", "dim", "n_splits", "stride_xn", "d_per_prog")
    floats = {"norm_eps": "fp32", "hc_eps": "fp32"}
    for kernel, pointers, more in ((mhc._hc_finish_kernel, {**common, "pre_ptr": "*fp32", "post_ptr": "*fp32",
                                                             "comb_ptr": "*fp32"}, ("iters",)),
                                   (mhc._hc_head_finish_kernel, common, ())):
        consts = {"BT": bt, "BD": bd, "SB": sb} if more else {"BD": bd, "SB": sb}
        sig = {**pointers, **floats, **{n: "i32" for n in ints + more}, **{n: "constexpr" for n in consts}}
        ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert f".entry {kernel.__name__}" in ptx


@pytest.mark.parametrize("kernel", ["_w13_kernel", "_w2_kernel"])
def test_grouped_expert_kernels_build_reading_e8m0_scale_bytes(kernel):
    common = {"tile_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8"}
    blocks = {"DIM": 4096, "F": 2048, "BM": 64, "BN": grouped_expert.BLOCK_N, "BK": grouped_expert.BLOCK_K,
              "F32": False}
    if kernel == "_w13_kernel":
        pointers = {"x_ptr": "*bf16", "token_ptr": "*i64", "weight_ptr": "*fp32", **common, "h_ptr": "*bf16"}
        ints = ("stride_x", "stride_ce", "stride_cr", "stride_se", "stride_sr", "stride_h")
        consts = {**blocks, "CLAMP": True, "QUANT": False, "LIBDEVICE": True}  # no e4m3 scale made here
        sig = {**pointers, "limit": "fp32", **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
        ptx = triton.compile(ASTSource(fn=grouped_expert._w13_kernel, signature=sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    else:
        pointers = {"h_ptr": "*bf16", "slot_ptr": "*i64", **common, "y_ptr": "*bf16"}
        ints = ("stride_h", "stride_ce", "stride_cr", "stride_se", "stride_sr", "stride_y")
        ptx = _ptx(grouped_expert._w2_kernel, pointers, ints, blocks)
    byte_loads, float_loads = _scale_reads(ptx)
    assert f".entry {kernel}" in ptx and byte_loads > 0
    assert float_loads <= (1 if kernel == "_w13_kernel" else 0)  # _w13: the rows' routing weights only
    assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 23;", ptx)
