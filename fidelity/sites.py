"""Sites: the stable names of the tensors both models emit (docs/design.md "Sites"). One table, one source of truth.

``{i}`` is the layer index. Shapes are per call: ``n`` new tokens, ``H`` heads, ``hc`` mHC streams,
``W`` window size, ``K`` index_topk (or the number of visible HCA entries), ``m`` new compressed entries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

SITES: dict[str, str] = {
    "embed": "[n, dim] token embeddings",
    "L{i}.mhc_attn.pre": "[n, hc] hc_pre collapse weights before attention",
    "L{i}.mhc_attn.post": "[n, hc] hc_post expand weights after attention",
    "L{i}.mhc_attn.comb": "[n, hc, hc] Sinkhorn-projected residual mixing matrix (applied transposed)",
    "L{i}.attn.in": "[n, dim] attention input (hc_pre collapse, then attn_norm)",
    "L{i}.attn.q": "[n, H, head_dim] queries after weightless norm and RoPE",
    "L{i}.attn.kv": "[n, head_dim] window KV rows after norm and RoPE",
    "L{i}.attn.compressed_kv": "[m, head_dim] compressed entries emitted by this call (after norm and RoPE)",
    "L{i}.indexer.q": "[n, index_n_heads, index_head_dim] indexer queries after RoPE",
    "L{i}.indexer.keys": "[m, index_head_dim] indexer keys emitted by this call",
    "L{i}.indexer.weights": "[n, index_n_heads] per-head index weights (weights_proj x scalings)",
    "L{i}.indexer.scores": "[n, entries] index scores, -inf where j >= (t+1)//4",
    "L{i}.indexer.topk": "[n, index_topk] selected compressed entries, -1 = none",
    "L{i}.attn.visible": "[n, W + K] window token positions then compressed entry ids, -1 = padding",
    "L{i}.attn.core": "[n, H, head_dim] attention output before inverse RoPE",
    "L{i}.attn.out": "[n, dim] attention sublayer output (after the grouped output projection)",
    "L{i}.mhc_ffn.pre": "[n, hc] hc_pre collapse weights before the MoE",
    "L{i}.mhc_ffn.post": "[n, hc] hc_post expand weights after the MoE",
    "L{i}.mhc_ffn.comb": "[n, hc, hc] Sinkhorn-projected residual mixing matrix before the MoE",
    "L{i}.moe.in": "[n, dim] MoE input (hc_pre collapse, then ffn_norm)",
    "L{i}.moe.experts": "[n, n_activated_experts] routed expert ids",
    "L{i}.moe.weights": "[n, n_activated_experts] routing weights (normalised, x route_scale)",
    "L{i}.moe.out": "[n, dim] MoE output (routed + shared)",
    "L{i}.residual": "[n, hc, dim] mHC streams leaving layer i",
    "final": "[n, dim] hc_head collapse followed by the final norm",
    "logits": "[n, vocab] output logits",
}


def trailing_shape(template: str, cfg) -> tuple[int, ...] | None:
    """The shape of a record of site ``template`` after its first (token or entry) dim, from ``cfg``
    (a ``ModelConfig``); None where it varies from call to call (index scores, visible sets)."""
    hd, ihd, hc, dim = cfg.head_dim, cfg.index_head_dim, cfg.hc_mult, cfg.dim
    shapes = {
        "attn.q": (cfg.n_heads, hd), "attn.core": (cfg.n_heads, hd), "attn.kv": (hd,), "attn.compressed_kv": (hd,),
        "indexer.q": (cfg.index_n_heads, ihd), "indexer.keys": (ihd,), "indexer.weights": (cfg.index_n_heads,),
        "indexer.topk": (cfg.index_topk,), "moe.experts": (cfg.n_activated_experts,),
        "moe.weights": (cfg.n_activated_experts,), "residual": (hc, dim), "mhc_attn.pre": (hc,),
        "mhc_attn.post": (hc,), "mhc_attn.comb": (hc, hc), "mhc_ffn.pre": (hc,), "mhc_ffn.post": (hc,),
        "mhc_ffn.comb": (hc, hc), "logits": (cfg.vocab_size,),
    }
    key = template.removeprefix("L{i}.")
    if key in shapes:
        return shapes[key]
    return (dim,) if key in ("embed", "final", "attn.in", "attn.out", "moe.in", "moe.out") else None


def site_name(template: str, layer: int | None = None) -> str:
    return template.replace("{i}", str(layer)) if layer is not None else template


def _template_regex(template: str) -> str:
    return re.escape(template).replace(re.escape("{i}"), r"\d+")


SITE_PATTERN = re.compile("^(" + "|".join(_template_regex(t) for t in SITES) + ")$")


def is_site(name: str) -> bool:
    return SITE_PATTERN.match(name) is not None


@dataclass
class Recorder:
    """Collects tensors at the sites whose names match any of ``patterns`` (regexes; default: all).

    Each call appends ``(step, tensor)``; ``step`` is the index of the model call (prefill = 0).
    Tensors are detached copies on ``device`` (None: on the device they come from, e.g. a GPU's memory).
    """

    patterns: Iterable[str] = (".*",)
    records: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    step: int = 0
    device: str | None = "cpu"

    def __post_init__(self) -> None:
        self._compiled = [re.compile(p) for p in self.patterns]

    def wants(self, site: str) -> bool:
        return any(p.fullmatch(site) for p in self._compiled)

    def __call__(self, site: str, tensor: torch.Tensor) -> None:
        if not is_site(site):
            raise KeyError(f"unknown site {site!r}; sites are listed in fidelity.sites.SITES")
        if self.wants(site):
            copy = tensor.detach().clone() if self.device is None else tensor.detach().to(self.device, copy=True)
            self.records.setdefault(site, []).append((self.step, copy))

    def get(self, site: str) -> torch.Tensor:
        """All records of ``site`` concatenated along dim 0 (tokens); ragged last dims are -1/-inf padded."""
        parts = [t for _, t in self.records.get(site, [])]
        if not parts:
            raise KeyError(f"site {site!r} was not recorded")
        if parts[0].ndim >= 2 and len({p.shape[-1] for p in parts}) > 1:
            width = max(p.shape[-1] for p in parts)
            fill = -1 if not parts[0].is_floating_point() else float("-inf")
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=fill) for p in parts]
        return torch.cat(parts, dim=0)
