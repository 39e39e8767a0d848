"""The production decoder's lightning indexer on given inputs, outside a session: its scores under a profile's
indexer fields and its top-k tie order. Exported as ``fidelity.decoders.indexer_scores`` and ``indexer_topk``, so
that a study (the indexer recall study) scores a precision the way the decoder does without reaching into the
decoder's ops, caches or top-k routes.

The scores come from the ops' emulations (``ops``), not from the op table's kernels."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.cache import KeyStore
from fidelity.decoders.production.topk import stable_topk
from fidelity.decoders.profiles import Profile

BF16 = torch.bfloat16


def indexer_scores(profile: Profile, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Index scores [n, e] of queries q [n, h, d] (after RoPE, not rotated) against keys [e, d] (the compressor's
    entries after norm and RoPE, not rotated) with head weights [n, h] (scale included), as the production decoder
    computes them under ``profile``: every input rounded to bf16 (the decoder's activations), q and keys
    Hadamard-rotated where ``profile.hadamard`` is on and rounded to ``profile.indexer_qk`` (``ops.indexer_round``),
    keys written to and read back from a ``KeyStore`` where ``profile.indexer_storage`` packs them (packed FP4:
    scored straight from codes and scales), scores in ``profile.index_scores``'s dtype (bf16: einsum, ReLU, product
    and head sum each rounded). No causal mask: every query scores every key."""
    rotate = profile.hadamard == "on"
    q = ops.indexer_round(q.to(BF16), profile.indexer_qk, rotate)
    keys = ops.indexer_round(keys.to(BF16), profile.indexer_qk, rotate)
    weights = weights.to(BF16)
    dtype = torch.float32 if profile.index_scores == "fp32" else BF16
    if profile.indexer_storage != "packed":
        return ops.index_scores(q, keys, weights, dtype)
    e = keys.shape[0]
    store = KeyStore(e, keys.shape[1], profile.indexer_qk, packed=True, device=keys.device)
    store.write(slice(0, e), keys)
    packed = store.fp4_slices(e)
    if packed is not None:
        return ops.index_scores_fp4(q, *packed, weights, dtype)
    return ops.index_scores(q, store.read(slice(0, e)), weights, dtype)


def indexer_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [..., k] int64 of the k highest ``scores`` [..., n] (fp32 or bf16, k <= n), highest first, ties to the
    lower id: the production decoder's top-k (``topk.stable_topk``, on the device's default route)."""
    return stable_topk(scores, k)
