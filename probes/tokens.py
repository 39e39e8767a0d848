"""token agreement: production vs oracle greedy token per step, with the logit margins around it."""

from __future__ import annotations

import torch


def _margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] float64: top-1 minus top-2 logit (+inf when V == 1)."""
    top = logits.to(torch.float64).topk(min(2, logits.shape[-1]), dim=-1).values
    pad = torch.full((*top.shape[:-1], 2 - top.shape[-1]), float("-inf"), dtype=top.dtype, device=top.device)
    top = torch.cat((top, pad), dim=-1)
    return top[..., 0] - top[..., 1]


def token_agreement(test_logits: torch.Tensor, ref_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """test_logits, ref_logits [V] (0-d metrics) or [n, V] ([n] metrics, one per position).

    agree (1 if the greedy argmax tokens are equal), ref_token, test_token, test_rank_of_ref_token (number of
    test logits strictly above the test logit of the ref token; 0 = it is test's top-1 or tied with it):
    int64; ref_margin, test_margin (top-1 minus top-2 logit): float64.
    """
    if test_logits.shape != ref_logits.shape:
        raise ValueError(f"token_agreement: test {tuple(test_logits.shape)} != ref {tuple(ref_logits.shape)}")
    test = test_logits.to(ref_logits.device)
    ref_tok, test_tok = ref_logits.argmax(dim=-1), test.argmax(dim=-1)
    at_ref = test.gather(-1, ref_tok.unsqueeze(-1))
    return {
        "agree": (ref_tok == test_tok).to(torch.int64),
        "ref_token": ref_tok,
        "test_token": test_tok,
        "ref_margin": _margin(ref_logits),
        "test_margin": _margin(test),
        "test_rank_of_ref_token": (test > at_ref).sum(dim=-1),
    }
