"""The mutant catalogue (``fidelity mutants``, docs/mutants.md): known DSv4 port bugs, each planted as a named fault
and caught where it was planted.

A mutant is a named fault patch point of a decoder (a fault of the switchboard ``fidelity.decoders.faults``, whose
catalogue the decoders register) plus where it must be caught: the expected first site (regex) and layer (a function
of the config: the first layer of the kind the fault lives in), the scenario run it is caught in (a run of
``fidelity.studies.catalogue.CATALOGUE``: its prompt of the default prompt's ids, prefill chunks and decode steps,
or a sequence of a played script) and the run options it needs on top to show (a sampler penalty, an end-of-turn
token in the stream, the default text as the stream, a large max_context). ``fidelity.studies.mutant_runs`` runs
them, ``fidelity.studies.detection`` judges where each was caught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fidelity.decoders import faults
from fidelity.model.config import ModelConfig
from fidelity.model.sampling import SamplerConfig
from fidelity.studies.catalogue import CATALOGUE as SCENARIOS
from fidelity.studies.catalogue import Run, Scenario, Script


def _kind(*kinds: str) -> Callable[[ModelConfig], set[int]]:
    """The layers of these kinds ('swa', 'csa', 'hca')."""
    return lambda cfg: {i for i, k in enumerate(cfg.layer_kinds) if k in kinds}


def _every_layer(cfg: ModelConfig) -> set[int]:
    return set(range(cfg.n_layers))


def _routed(cfg: ModelConfig) -> set[int]:
    return {i for i in range(cfg.n_layers) if not cfg.is_hash_layer(i)}


def _hash_layers(cfg: ModelConfig) -> set[int]:
    return {i for i in range(cfg.n_layers) if cfg.is_hash_layer(i)}


def _run_level(cfg: ModelConfig) -> set[int]:
    return {-1}


OPTIONS = ("eot_at", "text_stream", "sampler", "stream", "max_context", "stop_ids", "profile")  # added to its run
DECODER_OPTIONS = ("profile",)  # options that make another decoder: the clean one runs with them too


@dataclass(frozen=True)
class Mutant:
    name: str
    site: str  # regex the first detection's site (without the L{i}. prefix) must match
    layers: Callable[[ModelConfig], set[int]]  # where the fault is planted (-1: the decode loop, not a layer)
    scenario: str  # a scenario of fidelity.studies.catalogue.CATALOGUE ...
    run: str  # ... and the run the gate runs the mutant on: a run's label, or "<script> / seq <k>" (played)
    options: dict = field(default_factory=dict)  # what the fault needs on top of the run (OPTIONS)
    silent_in: tuple[tuple[str, str], ...] = ()  # scenario runs where it cannot show: the gate wants no alarm there
    requires: Callable[[ModelConfig], str | None] | None = None  # why a model cannot show it (None: it can)

    @property
    def description(self) -> str:
        return faults.catalogue()[self.name]

    @property
    def where(self) -> tuple[str, str]:
        return self.scenario, self.run

    def decoder_options(self) -> dict:
        """The options that make its decoder (a profile, a capacity): the clean decoder's run takes them too."""
        return {k: v for k, v in self.options.items() if k in DECODER_OPTIONS}

    def cannot_show(self, cfg: ModelConfig) -> str | None:
        return self.requires(cfg) if self.requires is not None else None


# the scenario runs (fidelity.studies.catalogue) the mutants are caught in
WINDOW_EDGE = ("lengths", "prompt 128")  # its last prefill query is the first whose window holds 128 keys
EVERYWHERE = WINDOW_EDGE  # a fault at every position: the shortest run with a full window and top-k (32) CSA entries
BLOCK_ENDS = ("decode-boundaries", "prompt 250, 10 steps")  # its decode steps close CSA blocks and the HCA block
LONG_TEXT = ("long-decode", "prompt 128, 512 steps")

CATALOGUE: tuple[Mutant, ...] = (
    Mutant("indexer-key-width", r"indexer\.keys", _kind("csa"), *EVERYWHERE),
    # the key cache's row stride taken from head_dim: the scores read empty slots between the keys (head_dim /
    # index_head_dim - 1 of every head_dim / index_head_dim); the keys as computed stay right
    Mutant("indexer-key-stride", r"indexer\.(scores|topk)", _kind("csa"), *EVERYWHERE,
           requires=lambda cfg: _same_row_width(cfg)),
    # compressed entries visible one position early: in the prefill, and where decode steps complete an entry
    Mutant("causal-off-by-one", r"indexer\.(scores|topk)|attn\.visible", _kind("csa", "hca"), *BLOCK_ENDS),
    Mutant("window-127", r"attn\.visible", _every_layer, *WINDOW_EDGE),
    Mutant("window-no-self", r"attn\.visible", _every_layer, *WINDOW_EDGE),
    Mutant("no-inverse-rope", r"attn\.out", _every_layer, *EVERYWHERE),
    Mutant("sink-value-row", r"attn\.core", _every_layer, *EVERYWHERE),
    Mutant("sink-dropped", r"attn\.core", _every_layer, *EVERYWHERE),
    Mutant("sinkhorn-3-iters", r"mhc_attn\.comb", _every_layer, *EVERYWHERE),
    Mutant("comb-transposed", r"mhc_attn\.comb", _every_layer, *EVERYWHERE),
    Mutant("hadamard-q-only", r"indexer\.keys", _kind("csa"), *EVERYWHERE),
    Mutant("fp4-scale-floor", r"indexer\.(q|keys)", _kind("csa"), *EVERYWHERE),
    # every compressed entry's RoPE position, among them the entries decode steps complete
    Mutant("compressed-rope-last", r"attn\.compressed_kv", _kind("csa", "hca"), *BLOCK_ENDS),
    Mutant("yarn-on-swa", r"attn\.q", _kind("swa"), *EVERYWHERE),
    # The trained default's shared experts pass the clamp (10) by at most ~1.5x, on a few tokens of its text: the
    # fault moves one token's moe.out by ~1-2%, which only a decode step (one token) through the text shows. Of the
    # scenario runs only the 512 steps reach such a token (step 181, position 308: L5.moe.out).
    Mutant("shared-clamp-missing", r"moe\.out", _every_layer, *LONG_TEXT, {"text_stream": True}),
    Mutant("routing-bias-in-weights", r"moe\.weights", _routed, *EVERYWHERE),
    # a penalty below 1 favours seen ids: the reference doubles every prompt id's positive logit, which the fault
    # forgets, so the first pick differs once a prompt id's doubled logit passes the top one (a penalty above 1
    # shows only where the top id is a prompt id: the trained default at its second pick, random weights by chance)
    Mutant("rep-penalty-no-prompt", r"sampler", _run_level, *BLOCK_ENDS,
           {"sampler": SamplerConfig(repetition_penalty=0.5)}),
    # a recent-N-ids window kept as a ring of the generated ids only: until N ids are generated the window
    # lacks the prompt's last ids, whose doubled logits (penalty 0.5) the reference's first pick weighs
    Mutant("rep-window-no-prompt", r"sampler", _run_level, *BLOCK_ENDS,
           {"sampler": SamplerConfig(repetition_penalty=0.5, repetition_window=64)}),
    Mutant("stop-missing-eot", r"stops", _run_level, *BLOCK_ENDS, {"stream": "given", "eot_at": 3}),
    Mutant("cache-concat-growth", r"memory", _run_level, *BLOCK_ENDS),
    # a capacity-sized buffer kept per decode step (8.4 MiB at max_context 65536) passes the 50 MiB band at step 8
    Mutant("decode-buffer-kept", r"memory", _run_level, *BLOCK_ENDS, {"max_context": 65536}),
    Mutant("topk-cap-half", r"indexer\.topk", _kind("csa"), *EVERYWHERE),
    # Several sequences: each caught on a sequence of a played script (recorded, replayed against the oracle) and
    # silent where its path is not taken.
    # GDzhu01/vllm-ascend-deepseekv4#131: the overlap compressor's SaveState() kept only the tail-side window, so
    # a verifier's rollback lost the current block's state (MTP output degraded; fixed by #132)
    Mutant("rollback-partial-carry", r"attn\.compressed_kv|indexer\.keys", _kind("csa"), "verify", "verified / seq 0",
           silent_in=(("verify", "prompt 250, 22 steps"),)),  # the same tokens, never proposed
    # ROCm/ATOM#1417: on a cross-request prefix-cache hit the sliding-window rows were read from a stale
    # per-request ring, not from the cached prefix. A fork at a parent's call end restores the snapshot; one
    # inside a call replays the prefix from position 0, which rebuilds the ring
    Mutant("fork-stale-ring", r"attn\.core", _every_layer, "prefix", "fork 201 / seq 1",
           silent_in=(("prefix", "fork 130, 256 / seq 1"),)),
    # sgl-project/sglang#34562 (RFC): a hierarchical prefix hit does not reproduce a cold run unless the
    # sliding-window and compressor state are restored with the prefix
    Mutant("fork-drops-carry", r"attn\.compressed_kv|indexer\.keys", _kind("csa", "hca"), "prefix",
           "fork 201 / seq 1", silent_in=(("prefix", "fork 130, 256 / seq 1"),)),
    # sgl-project/sglang#12583: the V3.2 indexer built every sequence's key range (ks, ke) from one offset
    # where two were needed, so a batched sequence's queries scored another range of keys
    Mutant("batch-key-range", r"indexer\.(scores|topk)|attn\.visible", _kind("csa"), "batch", "batched / seq 2",
           silent_in=(("batch", "batched / seq 0"), ("batch", "seq 2: prompt 255"))),
    # Cache layouts: each needs its profile (the layout exists only there), which the clean decoder runs too.
    # vllm-project/vllm#47783 (fix #47493; flashinfer-ai/flashinfer#3856): after the DSv4 KV caches were packed per
    # block (#44577) the FlashInfer sparse-MLA decode still addressed the pool by flat token id times the token
    # stride, ignoring the block stride, so rows past a block boundary were read from the wrong address. Here the
    # decode gather reads storage rows at the flat slot ids; the reversed block table moves every block but a
    # middle one. Every decode step of every layer gathers (a run without decode steps would stay silent: none is
    # in the catalogue); prefill reads are untouched. A full window alone (a sliding-window layer past 127 tokens)
    # is read permuted, which attention does not see: the compressed layers' rows show it (L2 on tiny and default).
    Mutant("paged-flat-addressing", r"attn\.core", _every_layer, *EVERYWHERE,
           {"profile": "reference:kv_cache=paged:16"}),
    # vllm-project/vllm#40991 (comment "Indexer KV Cache Layout Mismatch on SM120"; also #50576 on SM8x): the
    # compressor writes each block of 64 FP8 indexer keys planar (all values, then all scales) while the Triton
    # fallback reads it interleaved per key, so keys drift and scales are value bytes. Here the key store's codes
    # and scales are laid out planar per block of 64 keys and parsed interleaved on read (cache.
    # planar_read_interleaved); the keys as written (indexer.keys) stay right, the scores on them do not.
    Mutant("indexer-keys-planar", r"indexer\.(scores|topk)", _kind("csa"), *EVERYWHERE,
           {"profile": "reference:indexer_qk=fp8,indexer_storage=packed"}),
    # ml-explore/mlx-lm#1189 (DSv4 needle retrieval): in a chunked prefill the indexer scored only the compressed
    # keys of the current chunk, so entries written by earlier chunks were never picked. The second chunk of 130
    # (position 130) is the first call that has earlier keys; a whole prefill has none.
    Mutant("indexer-chunk-local", r"indexer\.(scores|topk)|attn\.visible", _kind("csa"), "chunks", "chunk 130",
           silent_in=(("chunks", "whole"),)),
    # ROCm/ATOM#1591: the SGLang bridge hard-coded index_topk=1024 (metadata and graph buffers) for a 512 model;
    # the extra picks only exist past 4 * index_topk tokens (128 on index_topk 32: prompt 125 never gets there)
    Mutant("index-topk-hardcoded", r"indexer\.topk|attn\.visible", _kind("csa"), "lengths", "prompt 257",
           silent_in=(("lengths", "prompt 125"),)),
    # GDzhu01/vllm-ascend-deepseekv4#76 (fix #77): DSA called the compressor op with seqused=None, which gave NaN
    # or zero-like compressed rows at the C4 boundary. Here a call at pos > 0 pools from an empty carry, so every
    # entry a later call completes is wrong (first in decode at t = 251); prompt 261's two steps complete none.
    Mutant("compressor-no-used-length", r"attn\.compressed_kv|indexer\.keys", _kind("csa"), *BLOCK_ENDS,
           silent_in=(("decode-boundaries", "prompt 261"),)),
    # sgl-project/sglang#28418 (also huggingface/transformers#46763): FP8 codes quantized with the exact amax/448
    # scale, then the scale rounded up to ue8m0 for the GEMM / stored inverse: dequantized values grow by
    # s_pow2/s_exact (mean 1.31 there). Planted in the window / compressed KV round: every run, first at L0.attn.kv.
    Mutant("ue8m0-round-after", r"attn\.kv", _every_layer, *EVERYWHERE),
    # verl-project/verl-ascend-recipe#126 (root cause ISEEKYAN/mbridge#159): mbridge's blanket bf16 cast took the
    # integer tid2eid along: ids 257..383 moved to even neighbours, 383 to 384 (out of range). Only a model with
    # more than 257 routed experts has an id that bf16 cannot hold.
    Mutant("tid2eid-bf16", r"moe\.experts", _hash_layers, *EVERYWHERE, requires=lambda cfg: _bf16_ids(cfg)),
)
BY_NAME = {m.name: m for m in CATALOGUE}


def _same_row_width(cfg: ModelConfig) -> str | None:
    """Why ``indexer-key-stride`` cannot show on ``cfg`` (None: it can): KV rows as wide as the indexer keys."""
    if cfg.head_dim == cfg.index_head_dim:
        return f"head_dim = index_head_dim = {cfg.head_dim}: the KV row stride is the key row stride"
    return None


def _bf16_ids(cfg: ModelConfig) -> str | None:
    """Why ``tid2eid-bf16`` cannot show on ``cfg`` (None: it can): every id exact in bf16 (at most 257 experts), or
    the largest id rounding up out of the range (384 experts, V4-Pro's: 383 -> 384), which no decoder can run
    (it indexes past the expert table: a crash, not a numerical fault for the probes)."""
    n = cfg.n_routed_experts
    if n <= 257:
        return f"{n} routed experts: every id (<= 256) is exact in bf16"
    top = int(torch.tensor(n - 1).to(torch.bfloat16).item())
    if top >= n:
        return f"{n} routed experts: id {n - 1} becomes {top} in bf16, past the expert table (a crash, not a fault " \
               "the probes can locate)"
    return None


@dataclass(frozen=True)
class Played:
    """Sequence ``seq`` of ``script`` of a multi-sequence scenario, as played and recorded (a trace), judged on its
    own timeline."""

    scenario: Scenario
    script: Script
    seq: int

    @property
    def decode_steps(self) -> int:
        return 0  # a played sequence's steps are the script's; no override applies


def scenario_run(scenario: str, label: str) -> Run | Played:
    """The run ``label`` of ``scenario`` (``fidelity.studies.catalogue.CATALOGUE``): a run's label, or ``<script> /
    seq <k>`` for a sequence of a script a multi-sequence scenario judges as played; ValueError naming the field,
    what was expected and what was found."""
    found = SCENARIOS.get(scenario)
    if found is None:
        raise ValueError(f"scenario: expected one of {sorted(SCENARIOS)}, found {scenario!r}")
    runs = {r.label: r for r in found.runs} | {f"{label} / seq {k}": Played(found, found.script(label), k)
                                               for label in found.judged for _, k in found.checks_of(label)}
    if label not in runs:
        raise ValueError(f"run: expected a run of {scenario!r} ({list(runs)}), found {label!r}")
    return runs[label]


def check_catalogue(mutants: tuple[Mutant, ...] = CATALOGUE) -> list[str]:
    """What is wrong with ``mutants``: a scenario run (caught or silent) that is not in the catalogue, an option
    that is not one of OPTIONS (the prompt, chunks and decode steps are the run's)."""
    bad = []
    for m in mutants:
        for where in (m.where, *m.silent_in):
            try:
                scenario_run(*where)
            except ValueError as err:
                bad.append(f"{m.name}: {err}")
        if extra := sorted(set(m.options) - set(OPTIONS)):
            bad.append(f"{m.name}: options: expected some of {list(OPTIONS)}, found {extra}")
    return bad


def check_names(names: list[str] | None, known: tuple[str, ...] | None = None) -> None:
    """Raise ValueError naming any mutant that is not in the catalogue (or not in ``known``, the faults a
    decoder can carry)."""
    known = tuple(BY_NAME) if known is None else known
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"mutants: unknown name(s) {unknown} for this decoder; expected some of {sorted(known)}")


def where_label(scenario: str, run: str, decode_steps: int | None = None) -> str:
    """'scenario / run', with '(N decode steps)' when N is not the run's own."""
    cut = decode_steps is not None and decode_steps != scenario_run(scenario, run).decode_steps
    return f"{scenario} / {run}" + (f" ({int(decode_steps)} decode steps)" if cut else "")
