"""Named fault patch points in the production path (``fidelity mutants``): each is a known DSv4 port bug,
switched on by name for one run. The production code asks ``on(name)`` at the single place the bug lives;
no copy of the model per mutant. This module is the production catalogue; the switchboard (``on``, ``inject``) is
``fidelity.decoders.faults``, shared with the other decoders that plant the same faults."""

from __future__ import annotations

from fidelity.decoders.faults import active, inject, on, register

__all__ = ["FAULTS", "IN_EMULATION", "active", "in_emulation", "inject", "on"]

FAULTS: dict[str, str] = {
    "indexer-key-width": "indexer keys truncated to the nope width (rope dims lost: wrong key cache stride)",
    "indexer-key-stride": "a prefill's indexer keys written at the KV row stride (slot first + s * head_dim / "
                          "index_head_dim) in a key cache read one index_head_dim row per slot",
    "causal-off-by-one": "compressed entry j visible when j <= (t+1)//ratio instead of j < (t+1)//ratio",
    "window-127": "sliding window of 127 tokens instead of 128",
    "window-no-self": "sliding window excludes the current token",
    "no-inverse-rope": "attention output not de-rotated (no inverse RoPE)",
    "sink-value-row": "attention sink given a value row (the first visible KV row)",
    "sink-dropped": "attention sink dropped from the denominator",
    "sinkhorn-3-iters": "Sinkhorn with 3 iterations instead of 20",
    "comb-transposed": "mHC comb built transposed (applied untransposed); still doubly stochastic",
    "hadamard-q-only": "Hadamard applied to indexer queries but not keys",
    "fp4-scale-floor": "FP4 ue8m0 scale rounded down instead of up (block maximum saturates)",
    "compressed-rope-last": "compressed entry RoPE at the block's last position instead of its first",
    "yarn-on-swa": "YaRN / compressed-layer RoPE applied to sliding-window-only layers",
    "shared-clamp-missing": "shared expert SwiGLU clamp missing",
    "routing-bias-in-weights": "routing bias added to the expert weights, not only to the selection",
    "rep-penalty-no-prompt": "repetition penalty ignores prompt tokens",
    "rep-window-no-prompt": "repetition window over the generated ids only (the prompt's ids never in the window)",
    "stop-missing-eot": "stop set missing the end-of-turn token",
    "cache-concat-growth": "KV cache grows by concatenation every decode step",
    "decode-buffer-kept": "each decode step gathers into a fresh full-capacity buffer that stays referenced",
    "topk-cap-half": "indexer top-k capped at half of index_topk (only shows past topk/2 * ratio tokens)",
    "rollback-partial-carry": "a rollback restores only the previous-block rows of the overlap compressors' "
                              "carry; their current block stays as the rejected tokens left it",
    "fork-stale-ring": "a fork (reused prefix) does not restore the sliding-window ring: the child attends the "
                       "ring its own session holds",
    "fork-drops-carry": "a fork (reused prefix) restores the window ring but not the compressors' carries: the "
                        "child's first compressed block pools from an empty state",
    "batch-key-range": "in a batched call every sequence's indexer key range ends where the first sequence's does",
    "paged-flat-addressing": "decode gathers paged KV rows at their flat slot ids (the block table ignored)",
    "indexer-keys-planar": "packed FP8 indexer keys written block-planar (codes, then scales) and read back "
                           "interleaved per key (codes then scale of each key)",
    "indexer-chunk-local": "a prefill chunk's indexer scores only the keys its own chunk wrote (earlier keys unseen)",
    "index-topk-hardcoded": "indexer top-k hard-coded to twice index_topk (shows past 4 * index_topk tokens)",
    "compressor-no-used-length": "compressor called without the used length: a call at pos > 0 starts from an "
                                 "empty carry",
    "ue8m0-round-after": "KV FP8 codes quantized with the exact scale amax/448, dequantized with it rounded up to "
                         "a power of two (ue8m0) afterwards",
    "tid2eid-bf16": "hash-routing table tid2eid cast through bf16 (expert ids above 256 move to a bf16 neighbour)",
}

# faults planted inside an op's emulation that a GPU kernel fuses away, with the ops whose emulations reach it
# (``sparse_attention_fp8kv``'s calls ``sparse_attention``'s): while one is injected, the registry hands out those
# ops' emulations (``registry.implementation``), so kernels never look at faults
IN_EMULATION: dict[str, tuple[str, ...]] = {
    "sink-value-row": ("sparse_attention", "sparse_attention_fp8kv"),
    "sink-dropped": ("sparse_attention", "sparse_attention_fp8kv"),
    "sinkhorn-3-iters": ("hc_pre",),
    "comb-transposed": ("hc_pre",),
    "fp4-scale-floor": ("indexer_round",),
    "compressed-rope-last": ("compressor_decode",),
    "shared-clamp-missing": ("expert",),
    "ue8m0-round-after": ("kv_round", "kv_norm_rope_fp8"),
}

register(FAULTS)


def in_emulation(op: str) -> str | None:
    """The injected fault (if any) that lives in op ``op``'s emulation."""
    return next((f for f in sorted(active()) if op in IN_EMULATION.get(f, ())), None)
