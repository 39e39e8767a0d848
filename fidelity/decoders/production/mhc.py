"""Manifold-constrained hyper-connections around one sub-layer (spec §4): ``hc_pre`` mixes the residual streams
into the sub-layer's input (Sinkhorn-balanced comb), ``hc_post`` writes its output back into the streams."""

from __future__ import annotations

import torch

from fidelity.decoders.production.sublayer import Model, Session, SubLayer
from fidelity.model.sites import MHC_SITES


class Mhc(SubLayer):
    """Layer i's mHC around ``which`` (``attn`` or ``ffn``), its weights resolved when built; the residual streams
    kept in the profile's residual dtype for this layer."""

    def __init__(self, model: Model, i: int, which: str):
        super().__init__(model, i)
        p, w = f"layers.{i}.hc_{which}_", model.w
        self.which, self.fn, self.scale, self.base = which, w(p + "fn"), w(p + "scale"), w(p + "base")
        self.res_dtype = torch.float32 if self.profile.residual_fp32(i) else torch.bfloat16

    def pre(self, s: Session, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams x [n, hc, dim] -> (the sub-layer's input [n, dim], post [n, hc], comb [n, hc, hc]); the
        pre / post / comb mixes recorded at their sites."""
        cfg = self.cfg
        y, pre, post, comb = self.op("hc_pre")(x, self.fn, self.scale, self.base, cfg.norm_eps,
                                               cfg.hc_sinkhorn_iters, cfg.hc_eps)
        s.emit(MHC_SITES[self.which, "pre"], self.i, pre)
        s.emit(MHC_SITES[self.which, "post"], self.i, post)
        s.emit(MHC_SITES[self.which, "comb"], self.i, comb)
        return y, post, comb

    def post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The sub-layer's output f [n, dim] written back into the streams x -> new streams [n, hc, dim]."""
        return self.op("hc_post")(f, x, post, comb, self.res_dtype)
