"""The lightning indexer of a CSA layer (spec §4): its query from the attention's q latent, its keys from its own
compressor (Hadamard + FP4), scores against the sequence's key store, and a stable top-k of the visible entries."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fidelity.decoders.production.cache import KeyStore
from fidelity.decoders.production.compressor import Compressor
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.shapes import pad, topk_cap, unrotated
from fidelity.decoders.production.sublayer import BF16, Model, Session, SubLayer
from fidelity.decoders.production.topk import stable_topk
from fidelity.model.sites import SITE

QUERY_CHUNK = 512  # prefill indexer queries per pass (bounds temporaries, not results)


class Indexer(SubLayer):
    """Layer i's indexer, its weights resolved when built; its methods take the sequence's session ``s``."""

    def __init__(self, model: Model, i: int):
        super().__init__(model, i)
        pre = f"layers.{i}.attn.indexer."
        self.wq_b, self.proj_name = pre + "wq_b.weight", pre + "weights_proj.weight"
        self.weights_proj = model.w(self.proj_name)
        self.compressor = Compressor(model, i, index=True)
        self.freqs = model.freqs[4]

    def query(self, s: Session, x: torch.Tensor, qr: torch.Tensor | Fp8Input,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [n, heads, d] rounded as the keys are, head weights [n, heads] bf16) of the call's rows."""
        cfg, prof = self.cfg, self.profile
        q = s.made.pop(self.wq_b, None)  # made with the attention's wq_b where both ran in one launch
        q = self.linear(qr, self.wq_b) if q is None else q
        q = self.op("apply_rope")(q.unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim)), positions, self.freqs)
        q = self.op("indexer_round")(q, prof.indexer_qk, prof.hadamard == "on")
        s.emit(SITE.indexer_q, self.i, lambda: unrotated(q, prof))
        projected = self.input_projection(s, x, (self.proj_name,))
        logits = projected[0].to(BF16) if projected else x @ self.weights_proj.to(BF16).T  # bf16 GEMM
        weights = logits * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        s.emit(SITE.indexer_weights, self.i, weights)
        return q, weights

    def scorer(self, store: KeyStore, n: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Scores (q [m, h, d], weights [m, h]) -> [m, n] against the first n cached keys: straight from the packed
        FP4 codes and scales (op ``index_scores_fp4``), else on the bf16 rows (``index_scores``)."""
        dtype = torch.float32 if self.profile.index_scores == "fp32" else BF16
        packed = store.fp4_slices(n)
        if packed is not None:
            op = self.op("index_scores_fp4")
            return lambda q, weights: op(q, *packed, weights, dtype)
        keys, op = store.read(slice(0, n)), self.op("index_scores")
        return lambda q, weights: op(q, keys, weights, dtype)

    def emit_keys(self, s: Session, new: torch.Tensor | None) -> None:
        """Site ``L{i}.indexer.keys``: the call's new keys unrotated (an empty [0, d] record where none)."""
        if new is None:
            new = torch.zeros(0, self.cfg.index_head_dim, device=self.model.device)
        s.emit(SITE.indexer_keys, self.i, lambda: unrotated(new, self.profile))

    @staticmethod
    def keys_visible(s: Session, end: int) -> int:
        """The indexer keys a call whose tokens end at position ``end`` (exclusive) scores: those of the blocks
        completed before ``end``. Fault ``batch-key-range``: the end another sequence of a batched call gives
        (``s.key_range_end``, set by ``batch.Batched``)."""
        if on("batch-key-range") and s.key_range_end is not None:
            end = s.key_range_end
        return end // 4

    def prefill(self, s: Session, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's picks [t, k] (-1 past the causal limit ``j < (p+1)//4``)."""
        cfg, cache = self.cfg, s.layers[self.i]
        q, weights = self.query(s, x, qr, positions)
        self.emit_keys(s, self.compressor(s, x, positions))
        t = len(positions)
        n = self.keys_visible(s, s.pos + t)
        score = self.scorer(cache.keys, n)
        k = min(topk_cap(cfg.index_topk), n)
        first = s.pos // 4 if on("indexer-chunk-local") else 0  # fault: keys written before this call unseen
        out = []
        for start in range(0, t, QUERY_CHUNK):
            sl = slice(start, start + QUERY_CHUNK)
            scores = score(q[sl], weights[sl])  # as the op returns them (bf16): no fp32 copy of the logits
            limit = ((positions[sl] + 1) // 4 + (1 if on("causal-off-by-one") else 0))[:, None]
            j = torch.arange(n, device=x.device)[None]
            scores = scores.masked_fill((j >= limit) | (j < first), float("-inf"))
            s.emit(SITE.indexer_scores, self.i, scores.float)
            picks = stable_topk(scores, k)
            out.append(torch.where((picks >= limit) | (picks < first), -1, picks))
        picks = torch.cat(out)
        s.emit(SITE.indexer_topk, self.i, pad(picks, cfg.index_topk))
        return picks

    def decode(self, s: Session, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decode token's picks [1, k] among the keys of the blocks completed so far (host position)."""
        cfg, cache = self.cfg, s.layers[self.i]
        q, weights = self.query(s, x, qr, positions)
        self.emit_keys(s, self.compressor(s, x, positions))
        n = self.keys_visible(s, s.pos + 1)
        scores = self.scorer(cache.keys, n)(q, weights)
        s.emit(SITE.indexer_scores, self.i, scores.float)
        picks = stable_topk(scores, min(topk_cap(cfg.index_topk), n))
        s.emit(SITE.indexer_topk, self.i, lambda: pad(picks, cfg.index_topk))
        return picks
