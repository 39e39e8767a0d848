"""sampler agreement: does the same seeded draw pick the same token from reference and test logits?"""

from __future__ import annotations

import torch

from fidelity.model.sampling import SamplerConfig, draw_noise, sample_scores


def _gap(scores: torch.Tensor) -> torch.Tensor:
    """[V] -> 0-d float64: winner minus runner-up (+inf with a single candidate)."""
    top = scores.to(torch.float64).topk(min(2, scores.shape[-1])).values
    return top[0] - top[1] if top.numel() == 2 else torch.full_like(top[0], float("inf"))


def sampler_agreement(
    ref_logits: torch.Tensor,
    test_logits: torch.Tensor,
    history: torch.Tensor | None,
    sampler_config: SamplerConfig,
    step: int,
) -> dict[str, torch.Tensor]:
    """ref_logits, test_logits [V]; history = prompt + generated ids; the draw of ``step`` (seeded noise).

    same_pick (1 if both picks are equal), ref_pick, test_pick: int64; pick_margin (the reference's winning
    log(p / E) minus the runner-up's; the logit gap at temperature 0; small = a flip is expected): float64.
    Computed on ref_logits' device; the only transfer is the CPU noise going to it.
    """
    if test_logits.shape != ref_logits.shape or ref_logits.ndim != 1:
        raise ValueError(
            f"sampler_agreement: expected equal [V] shapes, found ref {tuple(ref_logits.shape)} "
            f"and test {tuple(test_logits.shape)}"
        )
    cfg = sampler_config
    noise = None if cfg.temperature == 0 else draw_noise(ref_logits.shape[-1], cfg.seed, step)
    if noise is not None:
        noise = noise.to(ref_logits.device, non_blocking=True)
    ref = sample_scores(ref_logits, history, cfg, noise)
    test = sample_scores(test_logits.to(ref_logits.device), history, cfg, noise)
    ref_pick, test_pick = ref.argmax(), test.argmax()
    return {
        "same_pick": (ref_pick == test_pick).to(torch.int64),
        "ref_pick": ref_pick,
        "test_pick": test_pick,
        "pick_margin": _gap(ref),
    }
