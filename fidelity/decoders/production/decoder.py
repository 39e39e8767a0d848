"""The built-in production decoder (``fidelity.decoders.production``) as a decoder under test: every site, every
mode."""

from __future__ import annotations

import torch

from fidelity.decoders.base import Decoder
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.profiles import Profile, profile_dict
from fidelity.decoders.production.registry import implementations_used
from fidelity.model.sampling import Sampler, StopSet
from fidelity.model.sites import SITES


class ProductionDecoder(Decoder):
    """``ProductionModel(checkpoint, profile, max_context, device)`` and one session over it."""

    def __init__(self, checkpoint, profile: str | Profile = "reference", max_context: int = 4096,
                 device: str | torch.device = "cpu"):
        self.model = ProductionModel(checkpoint, profile, max_context, device)
        self.session = self.model.session()
        self.config = checkpoint.config
        self.profile = profile_dict(self.model.profile)
        self.label = f"production ({self.model.profile.name})"
        self.prompt_len = 0  # tokens prefilled (the prompt, however many chunks)
        self.used = False  # a call reached the session since it was made

    def reset(self) -> None:
        """A fresh session (new caches at position 0) once the current one was used; the old one is dropped first,
        so that the caches are never held twice."""
        if self.used:
            recorder, self.session = self.session.rec, None
            self.session = self.model.session(recorder)
            self.prompt_len, self.used = 0, False

    @property
    def rec(self):
        return self.session.rec

    @rec.setter
    def rec(self, recorder) -> None:
        self.session.rec = recorder

    @property
    def pos(self) -> int:
        return self.session.pos

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.used = True
        logits = self.session.prefill(ids)
        self.prompt_len += len(ids)
        return logits

    def step(self, token: int) -> torch.Tensor:
        self.used = True
        return self.session.step(token)

    def sites(self) -> frozenset[str]:
        return frozenset(SITES)

    def stop_set(self, reference: StopSet) -> StopSet:
        """The run's stop set (fault ``stop-missing-eot``: without the config's end-of-turn ids)."""
        if on("stop-missing-eot"):
            return StopSet.of(set(reference) - set(self.config.stop_token_ids))
        return reference

    def pick(self, sampler: Sampler, logits: torch.Tensor, history: torch.Tensor, step: int) -> int:
        """The run's sampler (fault ``rep-penalty-no-prompt``: the repetition penalty sees the generated ids only)."""
        if on("rep-penalty-no-prompt"):
            history = history[self.prompt_len :]
        return sampler.pick(logits, history, step)

    def cache_bytes(self) -> int:
        return self.session.cache_bytes()

    def info(self) -> dict:
        """Which implementation each op took, where a kernel fell back, the routes taken: this decoder's calls."""
        counts, taken = self.session.counts, self.session.counts.get("routes", {})
        return {
            "max_context": self.model.max_context,
            "implementations": implementations_used(counts.get("implementations", {})),
            "kernel_fallbacks": counts.get("kernel_fallbacks", {}),
            "topk_routes": taken.get("topk", {}),
            "index_routes": taken.get("index_scores_fp4", {}),
            "attention_routes": {**taken.get("sparse_attention", {}),  # the packed FP8 rows' op as "fp8 KV <route>"
                                 **{f"fp8 KV {r}": n for r, n in taken.get("sparse_attention_fp8kv", {}).items()}},
        }
