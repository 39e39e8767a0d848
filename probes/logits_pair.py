"""logits pair: one decoder's logits for the same positions after the same tokens, fed two ways (a scenario's
self-consistency pair, docs/scenarios.md): whether the values are equal, and how far apart they are where not."""

from __future__ import annotations

import torch

from probes.similarity import similarity_batch


def logits_pair(ref: torch.Tensor, test: torch.Tensor) -> dict[str, torch.Tensor]:
    """ref (the reference side of the pair), test: logits [n, vocab] of the same n positions.

    Per position [n] float64: cos, rel_l2 (|test - ref| / |ref|), over coordinates finite in both.
    Over the pair (0-d): unequal (int64: coordinates whose values differ, NaN unequal to itself; 0 = equal
    values), cos_min, rel_l2_mean (mean over positions), max_abs, rel_max (max_abs / the largest |ref|) in
    float64, nonfinite_mismatch (int64: coordinates whose NaN/+inf/-inf pattern differs).
    """
    if ref.ndim != 2 or ref.shape != test.shape:
        raise ValueError(f"logits_pair: expected two [n, vocab] tables of one shape, found {tuple(ref.shape)} and "
                         f"{tuple(test.shape)}")
    test = test.to(ref.device)
    per = similarity_batch(ref, test)
    finite = torch.where(ref.isfinite(), ref.abs().to(torch.float64), 0.0)
    max_abs = per["max_abs"].amax() if len(ref) else torch.zeros((), dtype=torch.float64)
    return {
        "cos": per["cos"], "rel_l2": per["rel_l2"],
        "unequal": (ref != test).sum(),
        "cos_min": per["cos"].amin() if len(ref) else torch.ones((), dtype=torch.float64),
        "rel_l2_mean": per["rel_l2"].mean() if len(ref) else torch.zeros((), dtype=torch.float64),
        "max_abs": max_abs,
        "rel_max": max_abs / finite.amax().clamp_min(1e-30) if ref.numel() else max_abs,
        "nonfinite_mismatch": per["nonfinite_mismatch"].sum(),
    }
