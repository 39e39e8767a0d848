"""The warp-specialized FP4 indexer's machine code, built without a GPU: Triton compiles ``_index_ws_kernel`` for
sm_90a with its own ptxas, and nvdisasm lists the SASS. The builds checked are the ones a one-head launch makes
(Triton turns an int argument equal to 1 into a constant, so the 63 padded heads' query codes are constant
zeros). A draft of the kernel (2026-12-02, ``benchmarks/results/2026-12-02-h200-indexer-rega``) had ptxas pack
pairs of those zero codes with the 16-bit half of an unrelated register (one never written on that path, the
thread id, the stack pointer): stray codes, NaN ones among them, in heads of weight 0, and every score came out
NaN on the H200. The instruction it used, an e4m3 pack of one register twice merged into another register's half,
is what the test looks for; none of the tree's builds has one."""

import re
import subprocess

import pytest

triton = pytest.importorskip("triton")
indexer_ws = pytest.importorskip("fidelity.decoders.production.kernels.indexer_ws")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fidelity.decoders.production.kernels._common import GLUON_VERSION  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "used_ptr": "*i8", "w_ptr": "*bf16", "pos_ptr": "*i8", "out_ptr": "*bf16",
            "paths_ptr": "*i32", "k_ptr": "*u8", "ks_ptr": "*i32"}
INTS = ("n_keys", "n_heads", "n_tiles", "ratio", "stride_qn", "stride_qh", "stride_wn", "stride_on", "stride_k",
        "stride_ks")
# what a launch with one head, one tile of keys and contiguous inputs turns into constants
ONE_HEAD = {"n_heads": 1, "n_tiles": 1, "stride_wn": 1, "stride_ks": 1}


def _sass(n_q: int, count: bool, tmp_path) -> str:
    """SASS of the two-consumer build for ``n_q`` queries (no causal mask) with ``ONE_HEAD``'s constants (those the
    kernel does not exempt from specialization)."""
    if not triton.__version__.startswith(GLUON_VERSION):
        pytest.skip(f"the kernel is written for Triton {GLUON_VERSION}'s Gluon, found {triton.__version__}")
    runtime = {p.name for p in indexer_ws._index_ws_kernel.params if p.do_not_specialize}  # as a launch does
    consts = {k: v for k, v in ONE_HEAD.items() if k not in runtime}
    consts.update(NC=2, NS=indexer_ws.SLOTS, NQ=n_q, CAUSAL=False, COUNT=count, LW=indexer_ws.LOADER_WARPS,
                  LREGS=indexer_ws.LOADER_REGS, CREGS=indexer_ws.CONSUMER_REGS[2], PARTS=7)
    sig = {**POINTERS, **{name: "i32" for name in INTS}, **{name: "constexpr" for name in consts}}
    aligned = [i for i, name in enumerate(sig) if name in POINTERS or name in ("stride_qn", "stride_qh", "stride_k")]
    src = GluonASTSource(indexer_ws._index_ws_kernel, sig, consts, {(i,): [["tt.divisibility", 16]] for i in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def _stray_merges(sass: str) -> list[str]:
    """e4m3 packs of one register twice (a pair of equal, hence constant, values) merged into a register's half."""
    return re.findall(r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB_MERGE_C R\d+, (R\d+), \1, R\d+", sass)


@pytest.mark.parametrize("n_q, count", [(1, False), (2, True)])
def test_one_head_builds_store_only_computed_query_codes(n_q, count, tmp_path):
    sass = _sass(n_q, count, tmp_path)
    assert "QGMMA" in sass and "PACK_AB_MERGE_C" in sass  # the FP8 MMAs and the query coding were built
    assert _stray_merges(sass) == []


def test_the_check_finds_the_drafts_instruction():
    """The pattern, as nvdisasm printed it in the draft's failing builds, is what :func:`_stray_merges` matches."""
    draft = ("        /*1d60*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R22, R43, R43, R4 ;\n"
             "        /*1d70*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R21, R36, R21, R35 ;\n"
             "        /*1d80*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R35, R36, R35, RZ ;\n")
    assert _stray_merges(draft) == ["R43"]


def test_the_epilogue_takes_the_relu_in_its_bf16_rounding(tmp_path):
    """bf16(relu(s)) is one packed conversion with ReLU per two values (``cvt.rn.relu.bf16x2.f32``), not a rounding
    then a bf16 max with zero: 24 fewer instructions per 64-key half tile with the weights packed once per query
    (H200 1M context one query: 16.2 -> 15.4 us, 2026-12-02)."""
    sass = _sass(1, False, tmp_path)
    assert "F2FP.RELU.BF16.F32.PACK_AB" in sass
    assert "HMNMX2" not in sass
