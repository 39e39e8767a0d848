"""The built-in production decoder (``fidelity.production``) as a decoder under test: every site, every mode."""

from __future__ import annotations

import torch

from fidelity.decoders.base import Decoder
from fidelity.production import ProductionModel, routes
from fidelity.production.kernels import fallbacks as kernel_fallbacks
from fidelity.production.profiles import Profile, profile_dict
from fidelity.production.registry import implementations_used, reset_used
from fidelity.sites import SITES


class ProductionDecoder(Decoder):
    """``ProductionModel(checkpoint, profile, max_context, device)`` and one session over it."""

    def __init__(self, checkpoint, profile: str | Profile = "reference", max_context: int = 4096,
                 device: str | torch.device = "cpu"):
        self.model = ProductionModel(checkpoint, profile, max_context, device)
        self.session = self.model.session()
        self.config = checkpoint.config
        self.profile = profile_dict(self.model.profile)
        self.label = f"production ({self.model.profile.name})"
        kernel_fallbacks.reset()
        routes.reset()
        reset_used()

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
        return self.session.prefill(ids)

    def step(self, token: int) -> torch.Tensor:
        return self.session.step(token)

    def sites(self) -> frozenset[str]:
        return frozenset(SITES)

    def cache_bytes(self) -> int:
        return self.session.cache_bytes()

    def info(self) -> dict:
        """Which implementation each op took, where a kernel fell back, the routes taken (since construction)."""
        return {
            "max_context": self.model.max_context,
            "implementations": implementations_used(),
            "kernel_fallbacks": kernel_fallbacks.counts(),
            "topk_routes": routes.counts("topk"),
            "index_routes": routes.counts("index_scores_fp4"),
            "attention_routes": routes.counts("sparse_attention"),
        }
