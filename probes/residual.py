"""residual norms: RMS of each mHC stream leaving a layer (docs/design.md "Probes"), to see growth across layers."""

from __future__ import annotations

import torch


def residual_norms(streams: torch.Tensor, per_position: bool = False, prefix: str = "") -> dict[str, torch.Tensor]:
    """streams [n, hc, dim] -> rms_stream{k} for k < hc, rms_max (the largest of them) and rms (over every stream),
    float64, each name after ``prefix`` (``ref_`` for the oracle's).

    0-d over all tokens by default; [n] per token when ``per_position``.
    """
    if streams.ndim != 3:
        raise ValueError(f"residual_norms: expected [n, hc, dim], got {tuple(streams.shape)}")
    sq = streams.to(torch.float64).square()
    rms = sq.mean(dim=-1).sqrt().T if per_position else sq.mean(dim=(0, 2)).sqrt()  # [hc, n] or [hc]
    out = {f"{prefix}rms_stream{k}": rms[k] for k in range(streams.shape[1])}
    out[f"{prefix}rms_max"] = rms.amax(dim=0)
    out[f"{prefix}rms"] = sq.mean(dim=(1, 2)).sqrt() if per_position else sq.mean().sqrt()
    return out
