"""Route ``cuda`` of ``sparse_attention_fp8kv`` where it cannot run: it says why and the op keeps its other routes;
its CUDA source compiles for sm_90a where nvcc is installed (no GPU needed)."""

import shutil
import subprocess

import pytest
import torch

from fidelity.decoders.production.kernels import sparse_attention_pair

BF16 = torch.bfloat16


def _inputs(heads: int = 64):
    return (torch.zeros(2, heads, 512, dtype=BF16), torch.zeros(5, 584, dtype=torch.uint8),
            torch.zeros(2, 3, dtype=torch.int32))


def test_the_cuda_route_says_why_it_cannot_run_on_cpu_tensors():
    q, kv, idx = _inputs()
    assert sparse_attention_pair.refusal(q, kv, idx) == "needs CUDA tensors q [n, H, d], kv [m, 584], idx [n, K]"
    assert sparse_attention_pair.device_refusal(torch.device("cpu")) == "needs a CUDA device"
    if torch.version.cuda is None:
        assert sparse_attention_pair.toolchain_refusal() == "torch was built without CUDA"


def test_the_op_falls_back_to_its_other_routes_without_the_cuda_route():
    """On CPU tensors the default route is not ``cuda``, and asking for it raises with the reason."""
    pytest.importorskip("triton")
    from fidelity.decoders.production.kernels import sparse_attention

    q, kv, idx = _inputs()
    assert sparse_attention._route(q, kv, idx, "fp8-kv", None)[0] != "cuda"
    with pytest.raises(ValueError, match="route 'cuda' cannot run: needs CUDA tensors"):
        sparse_attention._route(q, kv, idx, "fp8-kv", {"route": "cuda"})
    with pytest.raises(ValueError, match="route 'cuda' cannot run: fmt 'bf16'"):
        sparse_attention._route(q, kv, idx, "bf16", {"route": "cuda"})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_cuda_source_compiles_for_sm90a_without_spills(tmp_path):
    """The kernel source alone (no torch headers) through nvcc for sm_90a: it builds, with no local-memory spills
    and no wgmma serialization warnings from ptxas."""
    cu = sparse_attention_pair.SOURCES[1]
    done = subprocess.run(["nvcc", *sparse_attention_pair.NVCC_FLAGS, "-Xptxas", "-v", "-c", str(cu), "-o",
                           str(tmp_path / "pair.o")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = done.stdout + done.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in report and "spill stores" in report
    assert report.count("0 bytes spill stores") == report.count("spill stores"), report
    assert "wgmma" not in report.lower(), report
