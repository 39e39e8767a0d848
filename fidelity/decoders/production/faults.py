"""Named fault patch points in the production path (``fidelity mutants``): each is a known DSv4 port bug,
switched on by name for one run. The production code asks ``on(name)`` at the single place the bug lives;
no copy of the model per mutant. This module is the production catalogue; the switchboard (``on``, ``inject``) is
``fidelity.decoders.faults``, shared with the other decoders that plant the same faults."""

from __future__ import annotations

from fidelity.decoders.faults import active, inject, on, register

__all__ = ["FAULTS", "IN_EMULATION", "active", "in_emulation", "inject", "on"]

FAULTS: dict[str, str] = {
    "indexer-key-width": "indexer keys truncated to the nope width (rope dims lost: wrong key cache stride)",
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
    "stop-missing-eot": "stop set missing the end-of-turn token",
    "cache-concat-growth": "KV cache grows by concatenation every decode step",
    "decode-buffer-kept": "each decode step gathers into a fresh full-capacity buffer that stays referenced",
    "topk-cap-half": "indexer top-k capped at half of index_topk (only shows past topk/2 * ratio tokens)",
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
}

register(FAULTS)


def in_emulation(op: str) -> str | None:
    """The injected fault (if any) that lives in op ``op``'s emulation."""
    return next((f for f in sorted(active()) if op in IN_EMULATION.get(f, ())), None)
