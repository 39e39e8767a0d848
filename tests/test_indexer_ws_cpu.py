"""The warp-specialized FP4 indexer (``kernels/indexer_ws.py``) without a GPU: the reasons it gives for inputs it
cannot take, and the shape checks made before a launch. (Its query preparation runs inside the Gluon kernel, which
the CPU interpreter cannot run: tests/gpu/test_kernels.py covers it.)"""

import pytest
import torch

pytest.importorskip("triton")
indexer = pytest.importorskip("fidelity.production.kernels.indexer")
indexer_ws = pytest.importorskip("fidelity.production.kernels.indexer_ws")


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


def test_ws_refuses_a_consumer_count_it_has_no_build_for_before_launching():
    q, packed, scales, w = _inputs(n=2)
    with pytest.raises(ValueError, match="consumers must be 2, or 4 for one query, found 3 for 2 queries"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, consumers=3)
    with pytest.raises(ValueError, match="consumers must be 2, or 4 for one query, found 4 for 2 queries"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, consumers=4)


def test_ws_refuses_a_paths_counter_of_the_wrong_dtype_or_shape_before_launching():
    q, packed, scales, w = _inputs()
    with pytest.raises(ValueError, match=r"paths must be int32 \[2\] on cpu, found torch.int64 \[2\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"found torch.int32 \[3\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=torch.zeros(3, dtype=torch.int32))
