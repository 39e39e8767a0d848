"""One production decoder layer, built once per layer of a model: mHC around an attention and an MoE, each behind
its RMSNorm. ``Layer.__call__`` reads as the layer computes, top to bottom."""

from __future__ import annotations

import torch

from fidelity.decoders.production.attention import Attention
from fidelity.decoders.production.mhc import Mhc
from fidelity.decoders.production.moe import MoE
from fidelity.decoders.production.shapes import plain
from fidelity.decoders.production.sublayer import Model, Session, SubLayer
from fidelity.model.sites import SITE


class Layer(SubLayer):
    """Layer i of ``model``: ``mhc_attn``, ``attn_norm``, ``attn`` (with its compressor and indexer), ``mhc_ffn``,
    ``ffn_norm``, ``moe``; weights resolved when built. The sequence's state (caches, position, recorder, the
    decode / rows / stage policies) comes with each call as its session ``s``."""

    def __init__(self, model: Model, i: int):
        super().__init__(model, i)
        w = model.w
        self.mhc_attn, self.attn_norm = Mhc(model, i, "attn"), w(f"layers.{i}.attn_norm.weight")
        self.attn = Attention(model, i)
        self.mhc_ffn, self.ffn_norm = Mhc(model, i, "ffn"), w(f"layers.{i}.ffn_norm.weight")
        self.moe = MoE(model, i)

    def __call__(self, s: Session, x: torch.Tensor, positions: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        """Streams x [n, hc, dim] of ids [n] at positions [n] -> the streams leaving the layer."""
        i = self.i
        y, post, comb = self.mhc_attn.pre(s, x)
        h = self.norm(y, self.attn_norm)
        s.emit(SITE.attn_in, i, plain(h))
        f = self.attn(s, h, positions)
        s.emit(SITE.attn_out, i, f)
        x = self.mhc_attn.post(f, x, post, comb)
        y, post, comb = self.mhc_ffn.pre(s, x)
        h = self.norm(y, self.ffn_norm)
        s.emit(SITE.moe_in, i, plain(h))
        f = self.moe(s, h, ids)
        s.emit(SITE.moe_out, i, f)
        x = self.mhc_ffn.post(f, x, post, comb)
        s.emit(SITE.residual, i, x)
        return x
