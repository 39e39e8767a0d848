"""The warp-specialized FP4 indexer (``kernels/indexer_ws.py``) without a GPU: its query preparation under Triton's
CPU interpreter (in a subprocess: the interpreter is chosen when the kernels are defined), and the reasons it
gives for inputs it cannot take."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
indexer = pytest.importorskip("fidelity.production.kernels.indexer")
indexer_ws = pytest.importorskip("fidelity.production.kernels.indexer_ws")


def test_query_preparation_makes_exact_e4m3_codes_and_flags_the_queries_it_cannot_code():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    run = subprocess.run([sys.executable, "-m", "tests.interpreted.indexer_ws_prep_checks"], env=env,
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    problems = json.loads(run.stdout.strip().splitlines()[-1])
    assert problems == {"exact_flags": [], "exponents": [], "codes": [], "padded_heads": []}


def _inputs(n=1, h=64, e=100):
    return (torch.zeros(n, h, 128, dtype=torch.bfloat16), torch.zeros(e, 64, dtype=torch.uint8),
            torch.zeros(e, 4, dtype=torch.uint8), torch.zeros(n, h, dtype=torch.bfloat16))


def test_ws_refuses_cpu_tensors_and_names_the_reason():
    q, packed, scales, w = _inputs()
    assert indexer_ws.takes(q, packed, scales) == "needs CUDA tensors q [n, H, d], packed [e, d/2], scales [e, d/32]"
    with pytest.raises(ValueError, match="mma 'ws' cannot run: needs CUDA tensors"):
        indexer.index_scores_fp4(q, packed, scales, w, mma="ws")


def test_an_unknown_mma_is_refused():
    with pytest.raises(ValueError, match="mma: expected 'auto', 'fp8', 'bf16' or 'ws', found 'tf32'"):
        indexer.index_scores_fp4(*_inputs(), mma="tf32")


def test_ws_refuses_weights_or_positions_of_the_wrong_shape_before_launching():
    q, packed, scales, w = _inputs(n=2)
    with pytest.raises(ValueError, match=r"weights \[2, 64\] and positions \[2\] expected .* found weights \[2, 32\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w[:, :32])
    with pytest.raises(ValueError, match=r"found weights \[2, 64\], positions \[3\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, torch.zeros(3, dtype=torch.int64))
