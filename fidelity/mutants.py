"""Fault injection: run the clean decoder and every mutant against the oracle; record which probe caught each
mutant, where it was first detected, and whether that is where the fault was planted (``fidelity mutants``).

A mutant is a named fault patch point of the production path (``fidelity.decoders.production.faults``) plus where it
must be caught: the expected first site (regex) and layer (a function of the config: the first layer of the
kind the fault lives in), and the run options it needs to show (a sampler penalty, an end-of-turn token in
the stream, a decode step, enough context past top-k * ratio).
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from fidelity.atomic_write import write_dir_atomic
from fidelity.decoders import default_decoder
from fidelity.decoders.production.faults import FAULTS, inject
from fidelity.harness.runner import Runner, RunSpec
from fidelity.job import tidy
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt, prompt_for
from fidelity.model.sampling import SamplerConfig
from fidelity.outputs.report import html_table, md_table
from fidelity.outputs.rundir import check_output, new_run_id

if TYPE_CHECKING:
    from fidelity.decoders.base import Decoder
from fidelity.harness.judgement import rules_for
from fidelity.harness.thresholds import apply_thresholds, first_divergence, sort_divergence

PROBE_OF_METRIC = {
    "cos": "similarity", "calc_diff": "similarity", "nonfinite_mismatch": "similarity",
    "row_dev": "sinkhorn", "row_dev_excess": "sinkhorn", "col_dev": "sinkhorn", "min_value": "sinkhorn",
    "negative_count": "sinkhorn", "orientation_flip": "sinkhorn", "orientation_err": "sinkhorn",
    "recall": "indexer", "true_miss": "indexer", "miss_gap": "indexer",
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


def _run_level(cfg: ModelConfig) -> set[int]:
    return {-1}


@dataclass(frozen=True)
class Mutant:
    name: str
    site: str  # regex the first detection's site (without the L{i}. prefix) must match
    layers: Callable[[ModelConfig], set[int]]  # where the fault is planted (-1: the decode loop, not a layer)
    options: dict = field(default_factory=dict)  # RunSpec overrides the fault needs to show

    @property
    def description(self) -> str:
        return FAULTS[self.name]


CATALOGUE: tuple[Mutant, ...] = (
    Mutant("indexer-key-width", r"indexer\.keys", _kind("csa")),
    Mutant("causal-off-by-one", r"indexer\.(scores|topk)|attn\.visible", _kind("csa", "hca")),
    Mutant("window-127", r"attn\.visible", _every_layer),
    Mutant("window-no-self", r"attn\.visible", _every_layer),
    Mutant("no-inverse-rope", r"attn\.out", _every_layer),
    Mutant("sink-value-row", r"attn\.core", _every_layer),
    Mutant("sink-dropped", r"attn\.core", _every_layer),
    Mutant("sinkhorn-3-iters", r"mhc_attn\.comb", _every_layer),
    Mutant("comb-transposed", r"mhc_attn\.comb", _every_layer),
    Mutant("hadamard-q-only", r"indexer\.keys", _kind("csa")),
    Mutant("fp4-scale-floor", r"indexer\.(q|keys)", _kind("csa")),
    Mutant("compressed-rope-last", r"attn\.compressed_kv", _kind("csa", "hca")),
    Mutant("yarn-on-swa", r"attn\.q", _kind("swa")),
    # The trained default's shared experts pass the clamp (10) by at most ~1.5x, so the fault moves one token's
    # moe.out by at most ~1.4% (cos 0.9857): decode through the default text past position 747, where layer 0 is
    # moved most (cos 0.9876), one token per step.
    Mutant("shared-clamp-missing", r"moe\.out", _every_layer, {"prompt_len": 740, "decode_steps": 12,
                                                               "text_stream": True}),
    Mutant("routing-bias-in-weights", r"moe\.weights", _routed),
    Mutant("rep-penalty-no-prompt", r"sampler", _run_level,
           {"sampler": SamplerConfig(repetition_penalty=2.0), "decode_steps": 24}),
    Mutant("stop-missing-eot", r"stops", _run_level, {"stream": "given", "eot_at": 3}),
    Mutant("cache-concat-growth", r"memory", _run_level),
    # a capacity-sized buffer shows in the allocator / RSS counters within a few steps
    Mutant("decode-buffer-kept", r"memory", _run_level, {"max_context": 65536, "decode_steps": 16}),
    Mutant("topk-cap-half", r"indexer\.topk", _kind("csa")),
)
BY_NAME = {m.name: m for m in CATALOGUE}


@dataclass
class MutantSettings:
    prompt_len: int = 300
    decode_steps: int = 8
    modes: tuple[str, ...] = ("layer", "op")
    seed: int = 0
    device: str = "cpu"  # the production decoder's and the oracle's device


def _spec(checkpoint, s: MutantSettings, options: dict) -> RunSpec:
    cfg = checkpoint.config
    opts = dict(options)
    eot_at = opts.pop("eot_at", None)
    decode = opts.pop("decode_steps", s.decode_steps)
    prompt_len = opts.pop("prompt_len", s.prompt_len)
    text_stream = opts.pop("text_stream", False)
    prompt = prompt_for(checkpoint, prompt_len, s.seed)
    spec = RunSpec(prompt=prompt, decode_steps=decode, modes=s.modes, device=s.device, **opts)
    if text_stream:  # decode through the prompt's own continuation (the default text), one token per step
        spec.stream, spec.continuation = "given", prompt_for(checkpoint, prompt_len + decode + 1, s.seed)[prompt_len:]
    if eot_at is not None:
        if not cfg.stop_token_ids:
            raise ValueError("stop-missing-eot: the config names no end-of-turn id (stop_token_ids)")
        cont = default_prompt(cfg.vocab_size, decode + 1, s.seed + 1)
        cont[eot_at] = cfg.stop_token_ids[0]
        spec.continuation = cont
    return spec


DecoderFactory = Callable[[], "Decoder"]


def run_one(checkpoint, mutant: Mutant | None, s: MutantSettings,
            decoder: DecoderFactory | None = None) -> pd.DataFrame:
    """Judged metric rows of one run (the clean decoder when ``mutant`` is None) on a fresh decoder from
    ``decoder()`` (default: the production decoder)."""
    spec = _spec(checkpoint, s, mutant.options if mutant else {})
    names = (mutant.name,) if mutant else ()
    dec = decoder() if decoder else None
    with inject(*names):  # the default decoder is made with the fault injected, as it runs
        dec = dec or default_decoder(checkpoint, spec.profile, spec.context(), spec.device)
        df, manifest = Runner(checkpoint, spec, decoder=dec).run()
    df = tidy(df, mutant.name if mutant else "clean", str(manifest["profile"]["name"]))
    return apply_thresholds(df, rules_for(manifest["profile"], checkpoint.config, dec.sites()))


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
        layers = sorted(mutant.layers(cfg))
        where = mutant.site.replace("\\", "")
        summary["expected"] = where if layers == [-1] else f"L{{{','.join(map(str, layers))}}}.{where}"
    return [summary] + rows


def check_names(names: list[str] | None, known: tuple[str, ...] | None = None) -> None:
    """Raise ValueError naming any mutant that is not in the catalogue (or not in ``known``, the faults a
    decoder can carry)."""
    known = tuple(BY_NAME) if known is None else known
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"mutants: unknown name(s) {unknown} for this decoder; expected some of {sorted(known)}")


def run_mutants(checkpoint, names: list[str] | None = None, settings: MutantSettings | None = None,
                progress: Callable[[int, int, str], None] | None = None, decoder: DecoderFactory | None = None,
                known: tuple[str, ...] | None = None) -> pd.DataFrame:
    """The detection matrix: the clean decoder first, then each mutant (``names`` = all of ``known`` by default:
    the faults the decoder can carry, the whole catalogue for the production decoder). ``decoder()`` makes a
    fresh decoder under test for each run."""
    s = settings or MutantSettings()
    check_names(names, known)
    chosen = [BY_NAME[n] for n in names] if names else [m for m in CATALOGUE if known is None or m.name in known]
    rows = []
    for k, mutant in enumerate([None, *chosen]):
        name = mutant.name if mutant else "clean"
        if progress:
            progress(k, len(chosen) + 1, name)
        t0 = time.perf_counter()
        judged = run_one(checkpoint, mutant, s, decoder)
        for r in detection_rows(name, judged, mutant, checkpoint.config):
            rows.append({**r, "seconds": round(time.perf_counter() - t0, 2)})
    return pd.DataFrame(rows)


def gate_failures(matrix: pd.DataFrame) -> list[str]:
    """Why ``--gate`` fails: the clean decoder alarmed, a mutant went undetected, or was found elsewhere."""
    first = matrix[matrix["probe"] == "first"]
    out = []
    for r in first.itertuples():
        if r.mutant == "clean":
            if r.detected:
                out.append(f"clean decoder raised an alarm: {r.site} {r.metric} {r.value:g} ({r.threshold})")
        elif not r.detected:
            out.append(f"{r.mutant}: not detected")
        elif not r.located:
            out.append(f"{r.mutant}: first detected at {r.site} (step {int(r.step)}, {r.mode} mode), "
                       f"expected {r.expected}")
    return out


def matrix_table(matrix: pd.DataFrame) -> pd.DataFrame:
    """mutant x probe table: first detection step/site per probe, '-' when the probe stayed silent."""
    probe_rows = matrix[matrix["probe"] != "first"]
    cell = probe_rows.apply(lambda r: f"step {int(r.step)} {r.site}" if r.detected else "-", axis=1)
    wide = probe_rows.assign(cell=cell).pivot(index="mutant", columns="probe", values="cell")
    first = matrix[matrix["probe"] == "first"].set_index("mutant")
    wide.insert(0, "first detection", first.apply(
        lambda r: f"step {int(r.step)} {r.site} {r.metric} {r['value']:.4g} ({r.threshold}, {r['mode']})"
        if r.detected else "none", axis=1))
    if "located" in first:
        wide.insert(1, "where planted", first["expected"].fillna("-"))
        wide.insert(2, "located", first["located"].map({True: "yes", False: "NO"}).fillna("-"))
    order = ["clean"] + [m.name for m in CATALOGUE]
    return wide.reindex([m for m in order if m in wide.index]).reset_index()


def write_matrix(matrix: pd.DataFrame, out_dir: str | Path, run_id: str | None = None,
                 overwrite: bool = False) -> Path:
    """detection.parquet, detection.md and detection.html under ``out_dir/<run_id>/`` (default id
    ``mutants-<UTC time>-<random>``), written atomically; an existing directory is replaced only with
    ``overwrite``."""
    target = check_output(out_dir, run_id or f"mutants-{new_run_id()}", overwrite)
    table = matrix_table(matrix)
    failures = gate_failures(matrix)
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)

    def fill(tmp: Path) -> None:
        matrix.to_parquet(tmp / "detection.parquet", index=False)
        (tmp / "detection.md").write_text(f"# Mutant detection matrix\n\ngate: {verdict}\n\n{md_table(table)}\n")
        (tmp / "detection.html").write_text(
            "<!doctype html><meta charset='utf-8'><title>mutants</title><h1>Mutant detection matrix</h1>"
            f"<p>gate: {html.escape(verdict)}</p>{html_table(table)}")

    return write_dir_atomic(target, fill, overwrite)
