"""Fault injection: run the clean decoder and every mutant against the oracle; record which probe caught each
mutant, where it was first detected, and whether that is where the fault was planted (``fidelity mutants``).

A mutant is a named fault patch point of the production path (``fidelity.decoders.production.faults``) plus where it
must be caught: the expected first site (regex) and layer (a function of the config: the first layer of the
kind the fault lives in), the scenario run it is caught in (a single-sequence run of ``fidelity.scenarios.
CATALOGUE``: its prompt of the default prompt's ids, prefill chunks and decode steps) and the run options it needs
on top to show (a sampler penalty, an end-of-turn token in the stream, the default text as the stream, a large
max_context). The clean decoder runs every scenario run the chosen mutants use.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from fidelity.atomic_write import write_dir_atomic
from fidelity.decoders import default_decoder
from fidelity.decoders.base import raised
from fidelity.decoders.production.faults import FAULTS, inject
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import TraceWriter
from fidelity.harness.runner import Runner, RunSpec
from fidelity.job import tidy
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt, prompt_for
from fidelity.model.sampling import SamplerConfig
from fidelity.outputs.report import Section, raised_in_call, render_html, render_markdown
from fidelity.outputs.rundir import check_output, new_run_id
from fidelity.scenarios import CATALOGUE as SCENARIOS
from fidelity.scenarios import USER_ERRORS, Run, Scenario, Script, play, tokens

if TYPE_CHECKING:
    from fidelity.decoders.base import Decoder
from fidelity.harness.judgement import rules_for
from fidelity.harness.thresholds import apply_thresholds, first_divergence, sort_divergence

PROBE_OF_METRIC = {
    "cos": "similarity", "calc_diff": "similarity", "nonfinite_mismatch": "similarity",
    "row_dev": "sinkhorn", "row_dev_excess": "sinkhorn", "col_dev": "sinkhorn", "min_value": "sinkhorn",
    "negative_count": "sinkhorn", "orientation_flip": "sinkhorn", "orientation_err": "sinkhorn",
    "range_excess": "sinkhorn",
    "recall": "indexer", "true_miss": "indexer", "miss_gap": "indexer", "size_mismatch": "indexer",
    "missing": "visible", "extra": "visible",
    "weight_max_err": "routing", "routing_gap": "routing",
    "rows_missing": "rows", "rows_extra": "rows", "shape_mismatch": "rows",
    "token_flip_with_margin": "tokens", "pick_flip_with_margin": "sampler", "sampler_impl_mismatch": "sampler",
    "stop_mismatch": "stops",
    "cache_growth": "memory",
    "reserved_growth": "memory",
    "retained_growth": "memory",
    "held_growth": "memory",
    "new_device_mallocs": "memory",
}  # fmt: skip
PROBES = ("similarity", "sinkhorn", "indexer", "visible", "routing", "rows", "tokens", "sampler", "stops", "memory")


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
    scenario: str  # a scenario of fidelity.scenarios.CATALOGUE ...
    run: str  # ... and the run the gate runs the mutant on: a run's label, or "<script> / seq <k>" (played)
    options: dict = field(default_factory=dict)  # what the fault needs on top of the run (OPTIONS)
    silent_in: tuple[tuple[str, str], ...] = ()  # scenario runs where it cannot show: the gate wants no alarm there
    requires: Callable[[ModelConfig], str | None] | None = None  # why a model cannot show it (None: it can)

    @property
    def description(self) -> str:
        return FAULTS[self.name]

    @property
    def where(self) -> tuple[str, str]:
        return self.scenario, self.run

    def decoder_options(self) -> dict:
        """The options that make its decoder (a profile, a capacity): the clean decoder's run takes them too."""
        return {k: v for k, v in self.options.items() if k in DECODER_OPTIONS}

    def cannot_show(self, cfg: ModelConfig) -> str | None:
        return self.requires(cfg) if self.requires is not None else None


# the scenario runs (fidelity.scenarios) the mutants are caught in
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
    """The run ``label`` of ``scenario`` (fidelity.scenarios.CATALOGUE): a run's label, or ``<script> / seq <k>``
    for a sequence of a script a multi-sequence scenario judges as played; ValueError naming the field, what was
    expected and what was found."""
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


CLEAN_RUN = ("chunks", "whole")  # the clean decoder's run when none is named: 300 tokens prefilled whole, 4 steps


@dataclass
class MutantSettings:
    modes: tuple[str, ...] = ("layer", "op")
    seed: int = 0  # the random checkpoint's default prompt (and the end-of-turn stream's) seed
    device: str = "cpu"  # the production decoder's and the oracle's device
    decode_steps: int | None = None  # every run's decode steps instead of its scenario run's own (None: the run's)


def run_spec(checkpoint, s: MutantSettings, run: Run, options: dict) -> RunSpec:
    """``run`` as a RunSpec: its prompt of the default prompt's ids (``prompt_for``, seed ``s.seed``), its prefill
    chunks and decode steps (``s.decode_steps`` when set), then ``options`` on top."""
    cfg = checkpoint.config
    opts = dict(options)
    eot_at = opts.pop("eot_at", None)
    text_stream = opts.pop("text_stream", False)
    decode = run.decode_steps if s.decode_steps is None else s.decode_steps
    ids = prompt_for(checkpoint, run.prompt_len + decode + 1 + sum(o for o, _ in run.stream), s.seed)
    seq = tokens(ids, run.stream) if run.stream else ids  # the run's token stream: its prompt, then its text
    spec = RunSpec(prompt=run.prompt(ids), decode_steps=decode, modes=s.modes, device=s.device,
                   prefill_chunk=list(run.chunks) if run.chunks else None, **opts)
    if text_stream:  # decode through the prompt's own continuation (the default text), one token per step
        spec.stream, spec.continuation = "given", seq[run.prompt_len : run.prompt_len + decode + 1]
    if eot_at is not None:
        if not cfg.stop_token_ids:
            raise ValueError("stop-missing-eot: the config names no end-of-turn id (stop_token_ids)")
        cont = default_prompt(cfg.vocab_size, max(decode, eot_at) + 1, s.seed + 1)
        cont[eot_at] = cfg.stop_token_ids[0]
        spec.continuation = cont
    return spec


DecoderFactory = Callable[[], "Decoder"]


def run_one(checkpoint, mutant: Mutant | None, s: MutantSettings, decoder: DecoderFactory | None = None,
            where: tuple[str, str] | None = None, options: dict | None = None) -> pd.DataFrame:
    """Judged metric rows of one run (the clean decoder when ``mutant`` is None, with ``options``: a mutant's
    decoder options) on a fresh decoder from ``decoder()`` (default: the production decoder), on the scenario run
    ``where`` (scenario, run label; default: the mutant's, CLEAN_RUN for the clean decoder). A played sequence
    (``<script> / seq <k>``) is the script played on the decoder with the fault injected, recorded as a trace and
    replayed against the oracle."""
    where = where or (mutant.where if mutant else CLEAN_RUN)
    target = scenario_run(*where)
    opts = mutant.options if mutant else dict(options or {})
    names = (mutant.name,) if mutant else ()
    if isinstance(target, Played):
        try:
            spec, dec = _played(checkpoint, target, s, opts, names, decoder)
        except USER_ERRORS:  # what is asked cannot be done with this decoder or model: the user's to fix
            raise
        except Exception as err:
            raise PlayRaised(raised(err)) from err
    else:
        spec = run_spec(checkpoint, s, target, opts)
        dec = decoder() if decoder else None
        with inject(*names):  # the default decoder is made with the fault injected, as it runs
            dec = dec or default_decoder(checkpoint, spec.profile, spec.context(), spec.device)
    with inject(*names):
        df, manifest = Runner(checkpoint, spec, decoder=dec).run()
    df = tidy(df, mutant.name if mutant else "clean", str(manifest["profile"]["name"]))
    context = manifest["prompt_len"] + manifest["decode_steps"]
    judged = apply_thresholds(df, rules_for(manifest["profile"], checkpoint.config, dec.sites(), context=context))
    judged.attrs["decoder_raised"] = manifest.get("decoder_raised")  # what ended the run, if the decoder raised
    return judged


def _played(checkpoint, target: Played, s: MutantSettings, opts: dict, names: tuple[str, ...],
            decoder: DecoderFactory | None) -> tuple[RunSpec, TraceDecoder]:
    """The script of ``target`` played on a fresh decoder with ``names`` injected and recorded as a trace in a
    temporary folder, then sequence ``target.seq``'s view of it and the spec that replays it (the trace's
    steps are read into memory first, so the folder can go)."""
    script = target.script
    ids = prompt_for(checkpoint, max(o + n for _, segs in script.streams for o, n in segs), s.seed)
    profile = opts.get("profile", "reference")
    with tempfile.TemporaryDirectory() as tmp, inject(*names):
        dec = decoder() if decoder else default_decoder(checkpoint, profile, script.positions, s.device)
        writer = TraceWriter(Path(tmp) / "trace", checkpoint.config, decoder=dec.label, profile=dec.profile)
        try:
            play(dec, ids, script, writer)
        except BaseException:
            writer.abort()
            raise
        view = TraceDecoder(writer.finish(), target.seq).in_memory()
    spec = RunSpec(prompt=view.prompt, decode_steps=len(view.generated), modes=s.modes, device=s.device,
                   stream="given", continuation=torch.tensor(view.generated, dtype=torch.long),
                   prefill_chunk=view.chunks, profile=profile)
    return spec, view


def _split_site(site: str) -> tuple[int, str]:
    m = re.fullmatch(r"L(\d+)\.(.+)", site)
    return (int(m.group(1)), m.group(2)) if m else (-1, site)


def detection_rows(name: str, judged: pd.DataFrame, mutant: Mutant | None, cfg: ModelConfig) -> list[dict]:
    """One row per probe: detected?, first (step, layer, site), metric value vs threshold, located?"""
    failures = sort_divergence(judged[~judged["passed"]].drop(columns="passed"))
    first = first_divergence(failures)
    rows = []
    for probe in PROBES:
        hits = failures[failures["metric"].map(PROBE_OF_METRIC).eq(probe)]
        row = {"mutant": name, "probe": probe, "detected": not hits.empty}
        if not hits.empty:
            h = hits.iloc[0]
            row.update(step=int(h["step"]), layer=int(h["layer"]), site=str(h["site"]), metric=str(h["metric"]),
                       value=float(h["value"]), threshold=str(h["threshold"]), mode=str(h["mode"]))
        rows.append(row)
    summary = {"mutant": name, "probe": "first", "detected": first is not None}
    if first is not None:
        layer, site = _split_site(first.site)
        summary.update(step=first.step, layer=layer, site=first.site, metric=first.metric, value=first.value,
                       threshold=f"{first.op} {first.limit:g}", mode=first.mode)
        if mutant is not None:
            summary["located"] = bool(re.fullmatch(mutant.site, site)) and layer in mutant.layers(cfg)
    if mutant is not None:
        summary["expected"] = _expected_site(mutant, cfg)
    return [summary] + rows


def _expected_site(mutant: Mutant, cfg: ModelConfig) -> str:
    layers = sorted(mutant.layers(cfg))
    where = mutant.site.replace("\\", "")
    return where if layers == [-1] else f"L{{{','.join(map(str, layers))}}}.{where}"


def check_names(names: list[str] | None, known: tuple[str, ...] | None = None) -> None:
    """Raise ValueError naming any mutant that is not in the catalogue (or not in ``known``, the faults a
    decoder can carry)."""
    known = tuple(BY_NAME) if known is None else known
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"mutants: unknown name(s) {unknown} for this decoder; expected some of {sorted(known)}")


def _where(scenario: str, run: str, decode_steps: int | None = None) -> str:
    """'scenario / run', with '(N decode steps)' when N is not the run's own."""
    cut = decode_steps is not None and decode_steps != scenario_run(scenario, run).decode_steps
    return f"{scenario} / {run}" + (f" ({int(decode_steps)} decode steps)" if cut else "")


def _decode_steps(where: tuple[str, str], s: MutantSettings) -> int:
    """The decode steps a scenario run is run with: its own, or ``s.decode_steps`` (not for a played sequence)."""
    target = scenario_run(*where)
    return target.decode_steps if s.decode_steps is None or isinstance(target, Played) else s.decode_steps


def run_mutants(checkpoint, names: list[str] | None = None, settings: MutantSettings | None = None,
                progress: Callable[[int, int, str], None] | None = None, decoder: DecoderFactory | None = None,
                known: tuple[str, ...] | None = None) -> pd.DataFrame:
    """The detection matrix: the clean decoder on every scenario run the chosen mutants use (with their decoder
    options), then each mutant on its own run (``expect`` caught) and on the runs where it cannot show (silent);
    a mutant the model cannot show is listed (cannot show) and not run. ``names`` = all of ``known`` by default
    (the faults the decoder can carry; the whole catalogue for the production decoder); ``decoder()`` makes a
    fresh decoder under test for each run. A row per (mutant, scenario run) and probe, plus its "first" row."""
    s = settings or MutantSettings()
    check_names(names, known)
    chosen = [BY_NAME[n] for n in names] if names else [m for m in CATALOGUE if known is None or m.name in known]
    cfg = checkpoint.config
    able = [m for m in chosen if m.cannot_show(cfg) is None]
    clean = {(w, tuple(sorted(m.decoder_options().items()))): None for m in able for w in (m.where, *m.silent_in)}
    jobs = [(None, where, dict(opts), "clean") for where, opts in clean]
    jobs += [(m, w, None, expect) for m in able for w, expect in ((m.where, "caught"),
                                                                  *((x, "silent") for x in m.silent_in))]
    rows = [{"scenario": m.scenario, "run": m.run, "decode_steps": _decode_steps(m.where, s),
             "profile": m.options.get("profile", "reference"),
             "mutant": m.name, "probe": "first", "detected": False, "expect": "cannot show", "note": m.cannot_show(cfg),
             "seconds": 0.0}
            for m in chosen if m not in able]
    for k, (mutant, where, opts, expect) in enumerate(jobs):
        name = mutant.name if mutant else "clean"
        if progress:
            progress(k, len(jobs), f"{name} on {_where(*where)}")
        t0 = time.perf_counter()
        try:
            judged = run_one(checkpoint, mutant, s, decoder, where, opts)
        except PlayRaised as err:  # the decoder raised while a script played: recorded, and the matrix goes on
            found = [crash_row(name, err.__cause__, mutant if expect == "caught" else None, cfg)]
        else:
            found = detection_rows(name, judged, mutant if expect == "caught" else None, cfg)
            if ended := judged.attrs.get("decoder_raised"):  # the run ended where the decoder raised
                found[0]["crash"] = raised_in_call(ended)
        decode = _decode_steps(where, s)
        profile = (mutant.options if mutant else opts).get("profile", "reference")
        for r in found:
            rows.append({"scenario": where[0], "run": where[1], "decode_steps": decode, "profile": profile, **r,
                         "expect": expect, "seconds": round(time.perf_counter() - t0, 2)})
    return pd.DataFrame(rows)


class PlayRaised(Exception):
    """The decoder raised while a multi-sequence script played (outside a judged call); the cause is its error."""


def crash_row(name: str, err: BaseException, mutant: Mutant | None, cfg: ModelConfig) -> dict:
    """The "first" row of a run whose decoder raised outside a judged call (a script as it played): detected (the
    run stopped) but located by no probe; ``crash`` holds the exception's type and first line. (A raise inside a
    judged call ends the run there: ``Runner.run``; its rows up to that call are judged as usual.)"""
    row = {"mutant": name, "probe": "first", "detected": True, "crash": raised(err)}
    if mutant is not None:
        row.update(located=False, expected=_expected_site(mutant, cfg))
    return row


def gate_failures(matrix: pd.DataFrame) -> list[str]:
    """Why ``--gate`` fails: the clean decoder alarmed on a scenario run, a mutant went undetected on its run or
    was found elsewhere than planted, or it alarmed on a run where it cannot show; a run whose decoder raised,
    unless a probe had located the mutant where planted before the raise."""
    first = matrix[matrix["probe"] == "first"]
    out = []
    for r in first.itertuples():
        where = _where(r.scenario, r.run, r.decode_steps)
        expect = getattr(r, "expect", "clean" if r.mutant == "clean" else "caught")
        crash = getattr(r, "crash", None)
        if isinstance(crash, str) and not (expect == "caught" and r.located):  # caught where planted, then raised
            who = "clean decoder" if expect == "clean" else r.mutant
            out.append(f"{who}: the decoder raised on {where} ({crash})"
                       + (", where it cannot show" if expect == "silent" else "")
                       + ("; no probe located it" if expect == "caught" else ""))
        elif expect == "clean":
            if r.detected:
                out.append(f"clean decoder raised an alarm on {where}: {r.site} {r.metric} {r.value:g} "
                           f"({r.threshold})")
        elif expect == "silent":
            if r.detected:
                out.append(f"{r.mutant}: detected on {where}, where it cannot show: {r.site} {r.metric} "
                           f"{r.value:g} ({r.threshold})")
        elif expect == "caught" and not r.detected:
            out.append(f"{r.mutant}: not detected on {where}")
        elif expect == "caught" and not r.located:
            out.append(f"{r.mutant}: first detected at {r.site} (step {int(r.step)}, {r.mode} mode) on {where}, "
                       f"expected {r.expected}")
    return out


def _first_cell(r) -> str:
    if r.get("expect") == "cannot show":
        return f"cannot show: {r['note']}"
    crash = r.get("crash") if isinstance(r.get("crash"), str) else None
    probe_first = isinstance(r.get("site"), str) and r.get("site") != "decoder"  # a probe's failure before the raise
    if crash and not probe_first:
        return f"the decoder raised: {crash}"
    if not r.detected:
        return "none"
    cell = f"step {int(r.step)} {r.site} {r.metric} {r['value']:.4g} ({r.threshold}, {r['mode']})"
    return cell + (f"; then the decoder raised: {crash}" if crash else "")


def matrix_table(matrix: pd.DataFrame) -> pd.DataFrame:
    """(mutant, scenario run) x probe table: first detection step/site per probe, '-' when the probe stayed
    silent; the clean decoder's runs first, then the mutants in catalogue order. A run given other decode steps
    than its own (``MutantSettings.decode_steps``) says so."""
    key = ["mutant", "scenario run"]
    profiles = matrix["profile"] if "profile" in matrix else pd.Series("reference", index=matrix.index)
    label = [_where(*w) + ("" if p in ("reference", None) or p != p else f" [profile {p}]")
             for *w, p in zip(matrix["scenario"], matrix["run"], matrix["decode_steps"], profiles, strict=True)]
    matrix = matrix.assign(**{"scenario run": label})
    probe_rows = matrix[matrix["probe"] != "first"]
    cell = [f"step {int(r.step)} {r.site}" if r.detected else "-" for r in probe_rows.itertuples()]  # none: cannot show
    wide = probe_rows.assign(cell=cell).pivot(index=key, columns="probe", values="cell")
    first = matrix[matrix["probe"] == "first"].set_index(key)
    wide = wide.reindex(first.index).fillna("-")  # a mutant listed as "cannot show" has no probe rows
    wide.insert(0, "first detection", first.apply(_first_cell, axis=1))
    if "located" in first:
        wide.insert(1, "where planted", first["expected"].fillna("-"))
        wide.insert(2, "located", first["located"].map({True: "yes", False: "NO"}).fillna("-"))
    if "expect" in first:
        wide.insert(3 if "located" in first else 1, "expect", first["expect"])
    order = {name: k for k, name in enumerate(["clean"] + [m.name for m in CATALOGUE])}
    keys = sorted(first.index, key=lambda mk: order.get(mk[0], len(order)))  # clean runs in run order
    return wide.reindex(keys).reset_index()


def write_matrix(matrix: pd.DataFrame, out_dir: str | Path, run_id: str | None = None,
                 overwrite: bool = False) -> Path:
    """detection.parquet, detection.md and detection.html under ``out_dir/<run_id>/`` (default id
    ``mutants-<UTC time>-<random>``), written atomically; an existing directory is replaced only with
    ``overwrite``."""
    target = check_output(out_dir, run_id or f"mutants-{new_run_id()}", overwrite)
    table = matrix_table(matrix)
    failures = gate_failures(matrix)
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)

    mutants = table.loc[table["mutant"] != "clean", "mutant"].nunique()
    head = f"gate: {verdict}" if failures else \
        f"gate: PASS: the clean decoder stays silent and each of the {mutants} mutants is caught where it was planted"
    sections = [Section("Verdict", [head], css="fail" if failures else "pass"),
                Section("Detection matrix", ["First detection step and site per probe; '-': the probe stayed "
                                             "silent."], table, na="-")]
    title = f"dsv4-fidelity mutant detection matrix: {target.name}"

    def fill(tmp: Path) -> None:
        matrix.to_parquet(tmp / "detection.parquet", index=False)
        (tmp / "detection.md").write_text(render_markdown(title, sections, tmp), encoding="utf-8")
        (tmp / "detection.html").write_text(render_html(title, sections), encoding="utf-8")

    return write_dir_atomic(target, fill, overwrite)
