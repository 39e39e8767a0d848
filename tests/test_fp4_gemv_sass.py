"""The routed experts' FP4 decode GEMV (``weight_gemv._fp4_expert_kernel``) as machine code, built for sm_90 without
a GPU (Triton's own ptxas, listed by nvdisasm). A decode step streams each picked expert's codes once, so the kernel
keeps pace with HBM only if its loop issues few instructions per weight: at 4.23 TB/s an H200 SM receives about 32
nibbles per clock and issues 4 x 32 lane-instructions, so about 4 per nibble is the balance. The checks pin the loop
of the default configuration: at most 4.5 instructions per nibble (4.33: the byte-wise kernel before this one issued
about 12), the codes decoded four at a time (one e4m3x2 -> f16x2 conversion per two weights), no shuffles, barriers
or shared memory inside the loop, 16-byte loads for the codes and x, and no local memory."""

import collections
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fidelity.decoders.production.kernels import weight_gemv  # noqa: E402
from fidelity.decoders.production.kernels._common import GLUON_VERSION  # noqa: E402

POINTERS = {"xp_ptr": "*fp32", "e_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*bf16"}
INTS = ("n", "slots", "stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn")
K = 4096  # V4-Flash's dim: w1 / w3's k


def _default(name: str) -> int:
    return weight_gemv.fp4_expert_linear.__kwdefaults__[name]


def _loop(tmp_path, bn: int, bb: int, warps: int) -> list[str]:
    """The opcodes of the kernel's main loop (the one backward branch's body) at ``bn`` rows, ``bb`` blocks."""
    if not triton.__version__.startswith(GLUON_VERSION):
        pytest.skip(f"instruction counts pinned for Triton {GLUON_VERSION}, found {triton.__version__}")
    consts = {"k_split": K, "PLANE": K // 8, "BN": bn, "BB": bb, "EVEN": True, "FINAL": True}
    sig = {**POINTERS, **{name: "i32" for name in INTS}, **{name: "constexpr" for name in consts}}
    aligned = [i for i, name in enumerate(sig) if name in POINTERS or name.startswith("stride")]
    src = ASTSource(fn=weight_gemv._fp4_expert_kernel, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    code, labels, pending = [], {}, []  # (address, opcode, operands); label -> address of its instruction
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        instr = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if label:
            pending.append(label.group(1))
        elif instr:
            code.append((int(instr.group(1), 16), instr.group(2), instr.group(3)))
            labels.update((name, code[-1][0]) for name in pending)
            pending = []
    assert not [op for _, op, _ in code if op.startswith(("LDL", "STL"))], "local memory (spills)"
    branches = [(addr, labels[m.group(1)]) for addr, op, rest in code if op.startswith("BRA")
                for m in [re.search(r"\((\.L_x_\d+)\)", rest)] if m and labels[m.group(1)] < addr]
    assert len(branches) == 1, f"expected one loop, found backward branches {branches}"
    end, start = branches[0]
    return [op for addr, op, _ in code if start <= addr <= end]


def test_the_default_fp4_gemv_loop_issues_about_four_instructions_per_weight(tmp_path):
    bn, bb, warps = _default("bn"), _default("bb"), _default("num_warps")
    loop = _loop(tmp_path, bn, bb, warps)
    nibbles_per_thread = bn * bb * 32 // (32 * warps)  # one loop step: bn rows x bb blocks of 32 weights
    per_nibble = len(loop) / nibbles_per_thread
    ops = collections.Counter(op.split(".")[0] for op in loop)
    assert per_nibble <= 4.5, f"{per_nibble:.2f} instructions per nibble: {dict(ops)}"
    assert ops["F2FP"] == nibbles_per_thread // 2  # e4m3x2 -> f16x2: two weights a conversion
    assert ops["HADD2"] == nibbles_per_thread  # f16 -> f32, exact
    assert not {"SHFL", "BAR", "LDS", "STS"} & set(ops), f"cross-thread traffic in the loop: {dict(ops)}"
    loads = [op for op in loop if op.startswith("LDG")]
    wide = [op for op in loads if op.startswith("LDG.E.128")]
    assert len(wide) == nibbles_per_thread // 32 + 8, loads  # the codes (32 nibbles a load) and x's 8 planes
