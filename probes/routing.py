"""routing probe ``routing_agreement``: the decoder's routed experts against the oracle's, tie-aware.

Per token: the expert sets agree or the token flips. routing_gap is the largest oracle selection-score gap a flip
inverts (``probes.sets.inversion_gap``, in units of the token's largest |score|): a flip between near-tied
experts has a small gap, a misroute a large one. Without oracle scores (hash layers: a lookup has no near-tie)
every flip counts as +inf.
"""

from __future__ import annotations

import torch

from probes.sets import gather_or, inversion_gap


def routing_agreement(test: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor | None = None
                      ) -> dict[str, torch.Tensor]:
    """test [n, k'], ref [n, k] expert ids (widths may differ; -1 = none), scores [n, E] the oracle's selection
    scores or None -> 0-d metrics: routing_agree (float64 share of tokens with the same set), routing_flips,
    routing_gap (float64)."""
    width = max(ref.shape[-1], test.shape[-1])
    ref, test = (torch.nn.functional.pad(x.long(), (0, width - x.shape[-1]), value=-1) for x in (ref, test))
    ref_only = (ref[:, :, None] != test[:, None, :]).all(-1) & (ref >= 0)
    test_only = (test[:, :, None] != ref[:, None, :]).all(-1) & (test >= 0)
    flips = (ref_only | test_only).any(-1)
    if scores is None:
        gap = torch.where(flips, float("inf"), 0.0).double()
    else:
        scores = scores.double()
        unit = scores.abs().amax(-1) if scores.shape[-1] else scores.new_ones(len(scores))
        gap = inversion_gap(ref_only, gather_or(scores, ref), test_only,
                            gather_or(scores, torch.where(test < scores.shape[-1], test, -1), float("nan")), unit)
    agree = (~flips).double()
    return {"routing_agree": agree.mean() if len(agree) else torch.ones((), dtype=torch.float64),
            "routing_flips": flips.sum(), "routing_gap": torch.cat((gap, gap.new_zeros(1))).amax()}
