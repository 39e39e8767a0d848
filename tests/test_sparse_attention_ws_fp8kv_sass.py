"""The FP8-layout ``ws`` attention kernel's machine code, built without a GPU: Triton compiles both layouts
(one consumer warpgroup with 32 heads, two with 64) for sm_90a with its own ptxas, and nvdisasm lists the SASS.
The checks pin what the design relies on: the 584 B rows (8-byte aligned) are read with 8-byte loads (a 16-byte
load would fault on odd rows; the only 16-byte loads are Q's), the L2 prefetch only when asked for, and the
producers' loop-carried code words staying in registers (carried as bytes they took one register each and
spilled hundreds)."""

import re
import subprocess

import pytest

triton = pytest.importorskip("triton")
fp8kv = pytest.importorskip("fidelity.decoders.production.kernels.sparse_attention_ws_fp8kv")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fidelity.decoders.production.kernels._common import GLUON_VERSION  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kvi_ptr": "*i32", "kvw_ptr": "*i64", "idx_ptr": "*i32",
            "sink_ptr": "*fp32", "o_ptr": "*bf16"}
INTS = ("stride_qn", "stride_qh", "stride_in", "stride_on", "stride_oh")


def _sass(consumers: int, prefetch: int, tmp_path, ahead: bool = False) -> str:
    if not triton.__version__.startswith(GLUON_VERSION):
        pytest.skip(f"the kernel is written for Triton {GLUON_VERSION}'s Gluon, found {triton.__version__}")
    bh, ns, pregs, cregs = fp8kv._LAYOUT[consumers]
    kernel = fp8kv._one_consumer_fp8_kernel if consumers == 1 else fp8kv._two_consumer_fp8_kernel
    consts = dict(D=512, BH=bh, BN=64, NS=ns, PF=prefetch, PW=4, PREGS=pregs)
    if consumers == 2:
        if ahead:
            consts["PREGS"], cregs = fp8kv._AHEAD_REGS
        consts["CREGS"], consts["AHEAD"] = cregs, ahead
    consts["PARTS"] = fp8kv.GATHER | fp8kv.MATH | fp8kv.DEQUANT | fp8kv.FENCE
    sig = {**POINTERS, "topk": "i32", "scale": "fp32", **{name: "i32" for name in INTS},
           **{name: "constexpr" for name in consts}}
    aligned = [i for i, name in enumerate(sig) if name in POINTERS or name.startswith("stride")]
    src = GluonASTSource(kernel, sig, consts, {(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def _ops(sass: str, prefix: str) -> list[str]:
    return re.findall(rf"\b({prefix}[A-Z0-9_.]*)", sass)


@pytest.mark.parametrize("consumers, ahead", [(1, False), (2, False), (2, True)])
def test_the_rows_are_read_with_8_byte_loads_and_only_q_with_16(consumers, ahead, tmp_path):
    sass = _sass(consumers, fp8kv.PREFETCH, tmp_path, ahead)
    assert "HGMMA" in sass
    heads = fp8kv._LAYOUT[consumers][0]
    q_loads = heads * 512 * 2 // (128 * 16)  # Q [heads, 512] bf16 by one warpgroup, 16 B a load
    assert len(_ops(sass, "LDG.E.128")) == q_loads
    assert len(_ops(sass, "LDG.E.64")) >= 32  # a block's code, rope and scale words: 8 B a load
    assert "CCTL.E.PF2" in sass


def test_no_prefetch_without_a_distance_and_the_carried_words_stay_in_registers(tmp_path):
    assert "CCTL" not in _sass(1, 0, tmp_path)
    sass = _sass(1, fp8kv.PREFETCH, tmp_path)
    assert len(_ops(sass, "STL")) < 16


@pytest.mark.parametrize("ahead", [False, True])
def test_the_two_consumer_layout_fits_its_registers_with_either_fill_order(ahead, tmp_path):
    """12 warps share the register file; with the halves loaded one ahead the producer holds two halves' words
    (120 registers, the lead 176): a few spilled values, not the hundreds of a loop-carried tile."""
    assert len(_ops(_sass(2, fp8kv.PREFETCH, tmp_path, ahead), "STL")) < 24
