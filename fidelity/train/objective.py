"""The training objective on one token window: next-token cross-entropy through the oracle's forward pass,
plus the lightning indexer's KL loss (DeepSeek-V3.2's recipe) and the routed-expert loads for balancing.

Indexer loss, per CSA layer: for sampled query rows t, the target p_t is the main attention's distribution
over the compressed entries visible to t (softmax of q.k * hd^-0.5 per head over those entries, summed over
heads, L1-normalised); the indexer's is softmax over its scores. KL(p_t || softmax(I_t)), averaged over rows.
The target and the indexer's inputs are detached: only the indexer's own weights learn from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fidelity.model.sites import SITE
from fidelity.train.trainable import TrainableWeights
from oracles import attention as attn
from oracles.compressor import CompressorState, compress, compressor_weights
from oracles.indexer import head_weights, index_queries, index_scores
from oracles.model import OracleModel

_CAPTURED = re.compile(r"L\d+\.(attn\.(in|q|compressed_kv)|moe\.experts)")


class Capture:
    """A recorder that keeps the live tensors (graph attached) of the sites the objective reads."""

    step = 0

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def wants(self, site: str) -> bool:
        return _CAPTURED.fullmatch(site) is not None

    def __call__(self, site: str, tensor: torch.Tensor) -> None:
        self.tensors[site] = tensor


@dataclass
class StepLosses:
    lm: torch.Tensor  # mean next-token cross-entropy (nats)
    indexer_kl: torch.Tensor  # mean over CSA layers (0 without any)
    loads: dict[int, torch.Tensor]  # non-hash MoE layer -> tokens per routed expert [n_routed_experts]


def step_losses(model: OracleModel, weights: TrainableWeights, ids: torch.Tensor, kl_rows: int,
                gen: torch.Generator) -> StepLosses:
    """ids [n+1] (a window of the token stream) -> the losses of predicting ids[1:] from ids[:-1]."""
    cfg = model.cfg
    cap = Capture()
    logits = model.session(cap).differentiable_forward(ids[:-1])  # [n, vocab]
    lm = F.cross_entropy(logits, ids[1:])
    positions = torch.arange(len(ids) - 1, device=ids.device)
    kls = []
    for i in range(cfg.n_layers):
        if cfg.ratio(i) == 4 and len(positions) > 4:
            rows = 3 + torch.randperm(len(positions) - 3, generator=gen)[:kl_rows].sort().values  # >= 1 entry
            kls.append(indexer_kl(model, weights, cap.tensors, i, positions, rows.to(ids.device)))
    kl = torch.stack(kls).mean() if kls else lm.new_zeros(())
    loads = {i: torch.bincount(cap.tensors[SITE.moe_experts.at(i)].flatten(),
                               minlength=cfg.n_routed_experts)
             for i in range(cfg.n_layers) if not cfg.is_hash_layer(i)}
    return StepLosses(lm, kl, loads)


def indexer_kl(model: OracleModel, weights: TrainableWeights, captured: dict[str, torch.Tensor], i: int,
               positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """KL(main attention over entries || indexer) for layer i at query rows ``rows`` [R]."""
    cfg, w = model.cfg, model.w
    p = f"layers.{i}.attn."
    h = captured[SITE.attn_in.at(i)].detach()  # [n, dim] the attention's normed input
    q = captured[SITE.attn_q.at(i)].detach()[rows]  # [R, H, hd]
    entries = captured[SITE.attn_compressed_kv.at(i)].detach()  # [E, hd]
    qpos, freqs = positions[rows], model.freqs[4]
    visible = torch.arange(entries.shape[0], device=h.device)[None, :] < ((qpos + 1) // 4)[:, None]  # [R, E]
    logits = torch.einsum("rhd,ed->rhe", q, entries) * cfg.head_dim**-0.5
    target = logits.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1).sum(dim=1)
    target = target / target.sum(dim=-1, keepdim=True)  # [R, E]

    def own(name: str) -> torch.Tensor:
        return weights.params[name]

    _, qr = attn.query(h[rows], w(p + "wq_a.weight").detach(), w(p + "q_norm.weight").detach(),
                       w(p + "wq_b.weight").detach(), qpos, freqs, cfg.n_heads, cfg.norm_eps)
    ip = p + "indexer."
    iq = index_queries(qr, own(ip + "wq_b.weight"), qpos, freqs, cfg.index_n_heads)
    keys = compress(h, positions, CompressorState(), compressor_weights(own, ip + "compressor."), freqs, cfg.norm_eps)
    iw = head_weights(h[rows], own(ip + "weights_proj.weight"), cfg.index_n_heads, cfg.index_head_dim)
    log_q = index_scores(iq, keys, iw, qpos, 4).log_softmax(dim=-1)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_q), 0.0)
    return terms.sum(dim=-1).mean()
