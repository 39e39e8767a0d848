"""The FP8-layout ``ws`` attention kernel's machine code, built without a GPU: Triton compiles both layouts
(one consumer warpgroup with 32 heads, two with 64) for sm_90a with its own ptxas, and nvdisasm lists the SASS.
The checks pin what the design relies on: the 584 B rows (8-byte aligned) are gathered with 8-byte ``cp.async``
(a 16-byte copy would fault on odd rows), 40 copies per thread and block (32 for bytes 0-511, 4 for the rope tail, 4
for the scale bytes) with no barrier between them, the L2 prefetch only when asked for, and no register spills in
the one-consumer build."""

import re
import subprocess

import pytest

triton = pytest.importorskip("triton")
fp8kv = pytest.importorskip("fidelity.decoders.production.kernels.sparse_attention_ws_fp8kv")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fidelity.decoders.production.kernels._common import GLUON_VERSION  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "sink_ptr": "*fp32", "o_ptr": "*bf16"}
INTS = ("topk", "stride_qn", "stride_qh", "stride_in", "stride_on", "stride_oh")


def _sass(consumers: int, prefetch: int, tmp_path) -> str:
    if not triton.__version__.startswith(GLUON_VERSION):
        pytest.skip(f"the kernel is written for Triton {GLUON_VERSION}'s Gluon, found {triton.__version__}")
    bh, ns, nr, pw, pregs, cregs = fp8kv._LAYOUT[consumers]
    kernel = fp8kv._one_consumer_fp8_kernel if consumers == 1 else fp8kv._two_consumer_fp8_kernel
    consts = dict(D=512, BH=bh, BN=64, NS=ns, NR=nr, PF=prefetch, PW=pw, PREGS=pregs)
    if consumers == 2:
        consts["CREGS"] = cregs
    consts["PARTS"] = fp8kv.GATHER | fp8kv.MATH | fp8kv.DEQUANT
    sig = {**POINTERS, "topk": "i32", "scale": "fp32", **{name: "i32" for name in INTS[1:]},
           **{name: "constexpr" for name in consts}}
    aligned = [i for i, name in enumerate(sig) if name in POINTERS or name.startswith("stride")]
    src = GluonASTSource(kernel, sig, consts, {(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def _gathers(sass: str) -> list[list[str]]:
    """The runs of consecutive LDGSTS instructions (a barrier or any other memory instruction ends a run)."""
    runs, run = [], []
    for line in sass.splitlines():
        op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if not op:
            continue
        if op.group(1).startswith("LDGSTS"):
            run.append(op.group(1))
        elif op.group(1).startswith(("BAR", "LDS", "STS", "SYNCS", "ARRIVES")) and run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("consumers", [1, 2])
def test_the_gathers_are_8_byte_copies_without_barriers_between_buffers(consumers, tmp_path):
    sass = _sass(consumers, fp8kv.PREFETCH, tmp_path)
    assert "HGMMA" in sass
    copies = re.findall(r"LDGSTS\.[A-Z0-9.]+", sass)
    assert copies and set(copies) == {"LDGSTS.E.64"}
    runs = _gathers(sass)
    assert [len(r) for r in runs] == [40, 40]  # the prologue's gather and the loop's, each in one run
    assert "CCTL.E.PF2" in sass


def test_no_prefetch_without_a_distance_and_no_spills_with_one_consumer(tmp_path):
    assert "CCTL" not in _sass(1, 0, tmp_path)
    sass = _sass(1, fp8kv.PREFETCH, tmp_path)
    assert "STL" not in sass and "LDL" not in sass
