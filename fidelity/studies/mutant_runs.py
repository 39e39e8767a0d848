"""Running the mutant gate (``fidelity mutants``): the clean decoder on every scenario run the chosen mutants use,
then each mutant injected on its own run and on the runs where it cannot show; a played sequence is the script
played with the fault injected, recorded as a trace and replayed against the oracle. ``fidelity.studies.detection``
turns each run's judged rows into the detection matrix."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from fidelity._version import __version__
from fidelity.atomic_write import write_into_atomic
from fidelity.decoders import default_decoder
from fidelity.decoders.base import Decoder, raised
from fidelity.decoders.faults import inject
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import TraceWriter
from fidelity.harness.judgement import rules_for
from fidelity.harness.runner import Runner, RunSpec, checkpoint_info
from fidelity.harness.thresholds import apply_thresholds
from fidelity.job import tidy
from fidelity.model.default import default_prompt, prompt_for
from fidelity.outputs.mutants_report import fill_matrix
from fidelity.outputs.report import raised_in_call
from fidelity.studies.catalogue import Run, tokens
from fidelity.studies.detection import crash_row, detection_rows, gate_failures, matrix_table
from fidelity.studies.jobdir import MISSING, Job, kept_job
from fidelity.studies.mutants import BY_NAME, CATALOGUE, Mutant, Played, check_names, scenario_run, where_label
from fidelity.studies.play import play
from fidelity.studies.scenarios import USER_ERRORS
from fidelity.studies.workers import open_plan, run_tasks

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


DecoderFactory = Callable[[], Decoder]


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


def _decode_steps(where: tuple[str, str], s: MutantSettings) -> int:
    """The decode steps a scenario run is run with: its own, or ``s.decode_steps`` (not for a played sequence)."""
    target = scenario_run(*where)
    return target.decode_steps if s.decode_steps is None or isinstance(target, Played) else s.decode_steps


def run_mutants(checkpoint, names: list[str] | None = None, settings: MutantSettings | None = None,
                progress: Callable[[int, int, str], None] | None = None, decoder: DecoderFactory | None = None,
                known: tuple[str, ...] | None = None, job: Job | None = None, jobs: int = 1,
                reopen: dict | None = None) -> pd.DataFrame:
    """The detection matrix: the clean decoder on every scenario run the chosen mutants use (with their decoder
    options), then each mutant on its own run (``expect`` caught) and on the runs where it cannot show (silent);
    a mutant the model cannot show is listed (cannot show) and not run. ``names`` = all of ``known`` by default
    (the faults the decoder can carry; the whole catalogue for the production decoder); ``decoder()`` makes a
    fresh decoder under test for each run. A row per (mutant, scenario run) and probe, plus its "first" row. With
    ``job`` each run is kept there as it finishes, and one kept with the same inputs is reused; with ``jobs`` > 1
    (and ``job``) the runs not kept yet run first in that many worker processes, each opening the checkpoint and
    decoder ``reopen`` describes (``workers.worker_spec``)."""
    s = settings or MutantSettings()
    check_names(names, known)
    chosen = [BY_NAME[n] for n in names] if names else [m for m in CATALOGUE if known is None or m.name in known]
    cfg = checkpoint.config
    able = [m for m in chosen if m.cannot_show(cfg) is None]
    clean = {(w, tuple(sorted(m.decoder_options().items()))): None for m in able for w in (m.where, *m.silent_in)}
    runs = [(None, where, dict(opts), "clean") for where, opts in clean]
    runs += [(m, w, None, expect) for m in able for w, expect in ((m.where, "caught"),
                                                                  *((x, "silent") for x in m.silent_in))]
    rows = [{"scenario": m.scenario, "run": m.run, "decode_steps": _decode_steps(m.where, s),
             "profile": m.options.get("profile", "reference"),
             "mutant": m.name, "probe": "first", "detected": False, "expect": "cannot show", "note": m.cannot_show(cfg),
             "seconds": 0.0}
            for m in chosen if m not in able]
    if jobs > 1 and job is not None:
        _in_workers(runs, s, job, jobs, reopen, progress)
    for k, (mutant, where, opts, expect) in enumerate(runs):
        name = mutant.name if mutant else "clean"
        key, inputs = _unit_key(name, where, opts, expect), _unit_inputs(mutant, where, opts, expect, s)
        found = job.lookup(key, inputs) if job is not None else MISSING
        if progress and (job is None or key not in job.fresh):
            progress(k, len(runs), f"{name} on {where_label(*where)}" + (" (kept)" if found is not MISSING else ""))
        if found is MISSING:
            found = _judge_one(checkpoint, mutant, s, decoder, where, opts, expect)
            found = job.keep(key, inputs, found) if job is not None else found
        rows += found
    return pd.DataFrame(rows)


def _in_workers(runs: list[tuple], s: MutantSettings, job: Job, jobs: int, reopen: dict | None,
                progress: Callable[[int, int, str], None] | None) -> None:
    """The runs not kept in ``job`` yet, kept by ``jobs`` worker processes (their names noted in ``job.fresh``)."""
    if reopen is None:
        raise ValueError(f"jobs={jobs}: the worker processes need ``reopen`` (``worker_spec``) to open the model")
    tasks = []
    for mutant, where, opts, expect in runs:
        name = mutant.name if mutant else "clean"
        key, inputs = _unit_key(name, where, opts, expect), _unit_inputs(mutant, where, opts, expect, s)
        if not job.kept(key, inputs):
            tasks.append((mutant.name if mutant else None, where, opts, expect, key, inputs))
    job.fresh.update(t[4] for t in tasks)
    run_tasks(_mutant_task, tasks, jobs, _init_worker, (reopen, s, str(job.path), job.common),
              lambda lines, k, n: progress(k - 1, n, f"{lines[0]} ({jobs} worker processes)") if progress else None)


_WORKER: dict = {}  # a worker process's own checkpoint, decoder factory, settings and job (``_init_worker``)


def _init_worker(reopen: dict, s: MutantSettings, path: str, common: dict) -> None:
    torch.set_num_threads(reopen["threads"])
    _, ckpt = open_plan(reopen["plan"])
    factory = None
    if reopen["decoder"] == "transformers":
        from fidelity.decoders.transformers import TransformersDecoder

        def factory():
            return TransformersDecoder.from_checkpoint(ckpt, reopen["decoder_dtype"], reopen["device"])
    _WORKER.update(ckpt=ckpt, factory=factory, settings=s, job=Job(Path(path), common, resumed=True))


def _mutant_task(task: tuple) -> list[str]:
    """One run of the gate in a worker, kept in the job; the line saying it finished."""
    name, where, opts, expect, key, inputs = task
    w = _WORKER
    found = _judge_one(w["ckpt"], BY_NAME[name] if name else None, w["settings"], w["factory"], where, opts, expect)
    w["job"].keep(key, inputs, found)
    return [f"{key}: done in {sum(r['seconds'] for r in found[:1]):.1f} s"]


def _judge_one(checkpoint, mutant: Mutant | None, s: MutantSettings, decoder: DecoderFactory | None,
               where: tuple[str, str], opts: dict | None, expect: str) -> list[dict]:
    """The matrix rows of one run: the clean decoder (``mutant`` None, with ``opts``) or a mutant on ``where``."""
    name, cfg = (mutant.name if mutant else "clean"), checkpoint.config
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
    return [{"scenario": where[0], "run": where[1], "decode_steps": decode, "profile": profile, **r,
             "expect": expect, "seconds": round(time.perf_counter() - t0, 2)} for r in found]


def _unit_key(name: str, where: tuple[str, str], opts: dict | None, expect: str) -> str:
    """The name a run of the gate is kept under: who, where, its decoder options, and what is expected there."""
    extra = f" {json.dumps(opts, sort_keys=True)}" if opts else ""
    return f"{name} on {where_label(*where)}{extra} ({expect})"


def _unit_inputs(mutant: Mutant | None, where: tuple[str, str], opts: dict | None, expect: str,
                 s: MutantSettings) -> dict:
    """What a run of the gate depends on besides the job's checkpoint and decoder: the mutant as planted and
    judged, its run, the settings."""
    planted = {"site": mutant.site, "options": mutant.options} if mutant else {"options": opts or {}}
    return {"mutant": mutant.name if mutant else "clean", **planted, "where": list(where), "expect": expect,
            "modes": list(s.modes), "seed": s.seed, "device": s.device, "decode_steps": _decode_steps(where, s)}


@dataclass
class MutantsJob:
    """A finished ``fidelity mutants`` job: its directory, the matrix (a row per run and probe), the table (a row
    per run), the gate's failures and what a resumed job reused and redid ('' when not resumed)."""

    out_dir: Path
    matrix: pd.DataFrame
    table: pd.DataFrame
    failures: list[str]
    resumed: str


def run_mutants_job(checkpoint, target: Path, names: list[str] | None = None,
                    settings: MutantSettings | None = None, progress: Callable[[int, int, str], None] | None = None,
                    decoder: DecoderFactory | None = None, known: tuple[str, ...] | None = None, *,
                    decoder_label: str = "production", resume: bool = False, overwrite: bool = False,
                    jobs: int = 1, reopen: dict | None = None) -> MutantsJob:
    """``run_mutants`` in the job directory ``target`` (checked before: ``check_output``, or ``open_job`` with
    ``resume``), each run kept in it as it finishes, then detection.parquet/.md/.html; ``decoder_label`` names the
    decoder ``decoder()`` makes, in each run's input key; ``jobs`` / ``reopen``: ``run_mutants``'s."""
    common = {"version": __version__, "checkpoint": checkpoint_info(checkpoint)["hash"], "decoder": decoder_label}
    with kept_job(target, "mutants", common, resume, overwrite) as job:
        matrix = run_mutants(checkpoint, names, settings, progress, decoder, known, job, jobs, reopen)
    resumed = job.summary(job.prune())
    table, failures = matrix_table(matrix), gate_failures(matrix)
    write_into_atomic(target, lambda tmp: fill_matrix(tmp, matrix, table, failures, target.name, resumed))
    return MutantsJob(target, matrix, table, failures, resumed)


class PlayRaised(Exception):
    """The decoder raised while a multi-sequence script played (outside a judged call); the cause is its error."""
