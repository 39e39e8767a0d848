"""mHC probe ``sinkhorn``: is the production comb doubly stochastic, non-negative, and oriented like the
oracle's? (Same name as ``oracles.mhc.sinkhorn``.) A transposed doubly-stochastic matrix is still doubly
stochastic, so row/column sums cannot catch an orientation bug; only the comparison with the oracle can.
"""

from __future__ import annotations

import torch


def sinkhorn(test_comb: torch.Tensor, ref_comb: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """test_comb [n, hc, hc] (C[j, k], any float dtype) -> 0-d float64 / int64 metrics.

    row_dev = max |sum_k C[j, k] - 1|, col_dev = max |sum_j C[j, k] - 1|, min_value, negative_count,
    nonfinite. With ref_comb [n, hc, hc]: orientation_err = max |C - R|, transposed_err = max |C - R^T|,
    orientation_flip = 1 if transposed_err < orientation_err else 0 (a symmetric R never flips), and
    row_dev_excess = max over rows of |row sum of C - 1| - |row sum of R - 1|: 20 iterations end on a column
    normalisation, so the oracle's own rows of a peaky (near-permutation) matrix stay off by up to ~0.1 on a
    trained model; only a deviation beyond the oracle's is the decoder's.
    """
    c = test_comb.to(torch.float64)
    out = {
        "row_dev": (c.sum(dim=-1) - 1).abs().amax(),
        "col_dev": (c.sum(dim=-2) - 1).abs().amax(),
        "min_value": c.amin(),
        "negative_count": (c < 0).sum(),
        "nonfinite": (~c.isfinite()).sum(),
    }
    if ref_comb is not None:
        if ref_comb.shape != test_comb.shape:
            raise ValueError(f"sinkhorn: ref_comb {tuple(ref_comb.shape)} != test_comb {tuple(test_comb.shape)}")
        r = ref_comb.to(device=c.device, dtype=torch.float64)
        out["orientation_err"] = (c - r).abs().amax()
        out["transposed_err"] = (c - r.transpose(-1, -2)).abs().amax()
        out["orientation_flip"] = (out["transposed_err"] < out["orientation_err"]).to(torch.int64)
        out["row_dev_excess"] = ((c.sum(dim=-1) - 1).abs() - (r.sum(dim=-1) - 1).abs()).amax()
    return out
