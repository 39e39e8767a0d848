"""mHC probes. ``sinkhorn``: is the production comb doubly stochastic, non-negative, and oriented like the
oracle's? (Same name as ``oracles.mhc.sinkhorn``.) A transposed doubly-stochastic matrix is still doubly
stochastic, so row/column sums cannot catch an orientation bug; only the comparison with the oracle can.
``gate_range``: do the ``pre`` / ``post`` weights stay in the ranges their sigmoids allow?
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
    if ref_comb is not None and ref_comb.shape != test_comb.shape:
        raise ValueError(f"sinkhorn: ref_comb {tuple(ref_comb.shape)} != test_comb {tuple(test_comb.shape)}")
    out = sinkhorn_batch(test_comb[None], None if ref_comb is None else ref_comb[None])
    return {k: v[0] for k, v in out.items()}


def sinkhorn_batch(test_comb: torch.Tensor, ref_comb: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """B matrices' stacks at once (a site of B layers), test_comb [B, n, hc, hc] (and ref_comb the same shape)
    -> :func:`sinkhorn`'s metrics as [B] tensors, each over its own [n, hc, hc]."""
    c = test_comb.to(torch.float64)
    b = c.shape[0]

    def most(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, -1).amax(dim=1)

    row_dev = (c.sum(dim=-1) - 1).abs()
    out = {
        "row_dev": most(row_dev),
        "col_dev": most((c.sum(dim=-2) - 1).abs()),
        "min_value": c.reshape(b, -1).amin(dim=1),
        "negative_count": (c < 0).reshape(b, -1).sum(dim=1),
        "nonfinite": (~c.isfinite()).reshape(b, -1).sum(dim=1),
    }
    if ref_comb is not None:
        r = ref_comb.to(device=c.device, dtype=torch.float64)
        out["orientation_err"] = most((c - r).abs())
        out["transposed_err"] = most((c - r.transpose(-1, -2)).abs())
        out["orientation_flip"] = (out["transposed_err"] < out["orientation_err"]).to(torch.int64)
        out["row_dev_excess"] = most(row_dev - (r.sum(dim=-1) - 1).abs())
    return out


def gate_range(test: torch.Tensor, low: float, high: float) -> dict[str, torch.Tensor]:
    """test [n, hc] mHC ``pre`` or ``post`` weights (any float dtype) -> {"range_excess": 0-d float64}: how far the
    values reach outside [low, high] (0 when inside; +inf for a non-finite value). ``pre`` is sigmoid + hc_eps,
    in [0, 1 + hc_eps]; ``post`` is 2 sigmoid, in [0, 2]."""
    x = test.to(torch.float64)
    if x.numel() == 0:
        return {"range_excess": torch.zeros((), dtype=torch.float64, device=x.device)}
    excess = torch.maximum(low - x.amin(), x.amax() - high).clamp(min=0)
    return {"range_excess": torch.where(x.isfinite().all(), excess, torch.inf)}

