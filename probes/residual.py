"""residual norms: RMS of each mHC stream leaving a layer (docs/design.md "Probes"), to see growth across layers."""

from __future__ import annotations

import torch


def residual_norms(streams: torch.Tensor, per_position: bool = False) -> dict[str, torch.Tensor]:
    """streams [n, hc, dim] -> rms_stream{k} for k < hc and rms_max (float64).

    0-d over all tokens by default; [n] per token when ``per_position``.
    """
    if streams.ndim != 3:
        raise ValueError(f"residual_norms: expected [n, hc, dim], got {tuple(streams.shape)}")
    sq = streams.to(torch.float64).square()
    rms = sq.mean(dim=-1).sqrt().T if per_position else sq.mean(dim=(0, 2)).sqrt()  # [hc, n] or [hc]
    out = {f"rms_stream{k}": rms[k] for k in range(streams.shape[1])}
    out["rms_max"] = rms.amax(dim=0)
    return out
