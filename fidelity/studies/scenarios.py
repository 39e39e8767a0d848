"""Scenarios (``fidelity scenarios``, docs/scenarios.md): the catalogue's scenarios played on a decoder under test,
judged against the oracle and against the decoder itself, in one report directory.

Each scenario (``fidelity.studies.catalogue``) is judged twice:

- against the oracle: every run through ``fidelity.run`` (the usual verdict and first divergence), and every
  sequence of a played script through its trace;
- against the decoder itself (no oracle): every run again on a fresh decoder (``fidelity.studies.play``), its
  pairs and checks judged by the logits-pair probe and rules (``fidelity.studies.judge``): equal bits where the
  decoder promises them (``Decoder.same_bits``), bounds on the logits' difference elsewhere.

A scenario whose capabilities (batch, fork, rollback) the decoder lacks is skipped with its reason (listed as
skipped, not passed). The report is written by ``fidelity.outputs.scenarios_report``.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from fidelity._version import __version__
from fidelity.api import CheckpointPlan, InputError, open_decoder, run, warn
from fidelity.atomic_write import write_into_atomic
from fidelity.decoders.base import ContextError, Decoder, DecoderError, raised
from fidelity.decoders.faults import active, inject
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import TraceWriter, read_trace
from fidelity.harness.runner import RunError, checkpoint_info
from fidelity.model.checkpoint import Checkpoint, CheckpointError
from fidelity.outputs.report import raised_in_call
from fidelity.outputs.rundir import RunDirError, check_output, new_run_id
from fidelity.outputs.scenarios_report import write_report
from fidelity.studies.catalogue import Run, Scenario, Script, check_names
from fidelity.studies.jobdir import Job, digest, kept_job, open_job
from fidelity.studies.judge import PAIR_COLUMNS, check_pair, check_script_pair, divergence_columns, worst_local_cos
from fidelity.studies.play import decoder_logits, missing, play
from fidelity.studies.workers import check_jobs, open_plan, run_tasks, worker_spec


def self_consistency(scenario: Scenario, ids: torch.Tensor, fresh: Callable[[int], Decoder],
                     writers: Callable[[Script, Decoder], TraceWriter | None] | None = None) -> list[dict]:
    """Every pair of ``scenario`` on decoders from ``fresh(max_context)`` (one per run or script); a script for
    which ``writers(script, decoder)`` gives a writer is recorded into it as it plays (finished by the caller)."""
    needed = {label for p in scenario.pairs for label in (p.a, p.b)}
    context = max([r.positions for r in scenario.runs] + [s.positions for s in scenario.scripts])
    logits, decoder = {}, None
    for r in scenario.runs:
        if r.label in needed:
            decoder = fresh(context)
            logits[r.label] = decoder_logits(decoder, ids, r)
    out = [check_pair(scenario, p, logits, decoder) for p in scenario.pairs]
    rows, sites = {}, {}
    for s in scenario.scripts:
        decoder = fresh(context)
        keep = sites.setdefault(s.label, {}) if scenario.site_pairs else None
        rows[s.label] = play(decoder, ids, s, writers(s, decoder) if writers else None, keep)
    return out + [check_script_pair(scenario, c, rows, decoder, sites if scenario.site_pairs else None)
                  for c in scenario.checks]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


@dataclass
class ScenarioResult:
    """``matrix`` (a row per run), ``pairs`` (a row per self-consistency pair), the report directory; ``skipped``:
    {scenario: why} for the scenarios the decoder lacks a capability for (not judged, so not passed); ``resumed``:
    what a resumed job reused and redid ('' when the job was not resumed)."""

    out_dir: Path
    matrix: pd.DataFrame
    pairs: pd.DataFrame
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)
    resumed: str = ""

    @property
    def passed(self) -> bool:
        """No judged run or pair fails (skipped scenarios are listed apart)."""
        runs = self.matrix["verdict"] if len(self.matrix) else pd.Series([], dtype=str)
        pairs = self.pairs["passed"] if len(self.pairs) else pd.Series([], dtype=bool)
        return bool((runs == "PASS").all() and pairs.all())

    def failures(self) -> list[str]:
        bad = [f"{r.scenario}/{r.run}: {r.first_divergence}" for r in self.matrix.itertuples()
               if r.verdict != "PASS"]
        return bad + [f"{r.scenario}/{r.pair} {r.b}" + (f" vs {r.a}" if r.a else "")
                      + (f" at {r.site} ({r.site_check})" if isinstance(r.site, str) and r.site else "")
                      for r in self.pairs.itertuples() if not r.passed]

    def verdict(self) -> str:
        """PASS / FAIL: the failures, then the skipped scenarios (SKIPPED when nothing was judged)."""
        skipped = "; ".join(f"{name} skipped ({why})" for name, why in self.skipped.items())
        if not len(self.matrix) and not len(self.pairs) and skipped:
            return f"SKIPPED: {skipped}"
        head = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures())
        return f"{head}; not judged: {skipped}" if skipped else head


def run_scenarios(plan: CheckpointPlan, names: Sequence[str | Scenario] | None = None,
                  decoder: Decoder | str = "production", out: str | Path = "runs", run_id: str | None = None, *,
                  modes: Sequence[str] = ("free", "layer", "op"),
                  profile: str = "reference", decoder_dtype: str = "bf16", device: str = "cpu",
                  overwrite: bool = False, progress: Callable[[str], None] | None = None,
                  notify: Callable[[str, str], None] = warn, faults: Sequence[str] = (),
                  resume: str | Path | None = None, jobs: int = 1) -> ScenarioResult:
    """Run ``names`` (default: the whole catalogue) on ``decoder`` against the oracle and against itself in one
    report directory ``out/<run_id>/`` (default id ``scenarios-<UTC time>-<random>``): runs/<scenario>-<run>/ (each
    run's own directory) and kept/ (``fidelity.studies.jobdir``) as each run finishes, then report.md/.html,
    matrix.csv, pairs.csv, plots/. ``resume``: continue the stopped job in that directory instead, reusing the
    runs it finished with the same inputs. ``jobs``: the runs and self-consistency plays not kept yet run in that
    many worker processes (``fidelity.studies.workers``; a named decoder only), the report the same as with one."""
    scenarios = check_names(names)
    check_jobs(jobs)
    if jobs > 1 and not isinstance(decoder, str):
        raise InputError(f"--jobs {jobs}: each worker process opens the decoder by name (production, transformers, "
                         f"...); found a {type(decoder).__name__} object: run it with jobs=1")
    target = open_job(resume, "scenarios") if resume is not None else \
        check_output(out, run_id or f"scenarios-{new_run_id()}", overwrite)
    ckpt = plan.open()
    ids = plan.prompt(_longest(scenarios))
    t0 = time.perf_counter()
    with inject(*faults):  # planted in the decoder for every run and play (the oracle never reads them)
        common = {"version": __version__, "checkpoint": checkpoint_info(ckpt)["hash"], "decoder": _label(decoder),
                  "decoder_dtype": decoder_dtype, "device": device, "profile": profile, "modes": list(modes)}
        with kept_job(target, "scenarios", common, resume is not None, overwrite) as job:
            runs = _Play(job, plan, ckpt, decoder, ids, tuple(modes), profile, decoder_dtype, device, notify,
                         progress or (lambda line: None))
            rows, pairs, skipped = runs.all(scenarios, jobs, list(faults))
        dropped = job.prune()
        _drop_other_runs(target, rows)
        result = ScenarioResult(target, pd.DataFrame(rows, columns=list(ROW_COLUMNS)),
                                pd.DataFrame(pairs, columns=list(PAIR_COLUMNS)), time.perf_counter() - t0, skipped,
                                job.summary(dropped))
        write_into_atomic(target, lambda tmp: write_report(tmp, result, plan.what, _label(decoder)))
    return result


def _longest(scenarios: Sequence[Scenario]) -> int:
    """The default prompt's ids ``scenarios`` read: their longest run or played stream."""
    return max([r.positions + sum(o for o, _ in r.stream) for s in scenarios for r in s.runs] +
               [o + n for s in scenarios for sc in s.scripts for _, segs in sc.streams for o, n in segs])


@dataclass
class _Play:
    """The scenarios job's runs, each kept in ``job`` as it finishes (or reused from it)."""

    job: Job
    plan: CheckpointPlan
    ckpt: Checkpoint
    decoder: Decoder | str
    ids: torch.Tensor
    modes: tuple[str, ...]
    profile: str
    decoder_dtype: str
    device: str
    notify: Callable[[str, str], None]
    tell: Callable[[str], None]

    def fresh(self, context: int) -> Decoder:
        return open_decoder(self.decoder, self.ckpt, self.profile, context, self.device, self.decoder_dtype)

    def all(self, scenarios: Sequence[Scenario], jobs: int = 1,
            faults: Sequence[str] = ()) -> tuple[list[dict], list[dict], dict[str, str]]:
        """(matrix rows, pairs rows, skipped) of every scenario; with ``jobs`` > 1 what is not kept yet runs first in
        that many worker processes (``faults`` planted in each)."""
        rows, pairs, skipped, playable = [], [], {}, []
        for s in scenarios:
            if s.needs and (why := missing(s, self.fresh(_context(s)))):
                skipped[s.name] = why
                self.tell(f"{s.name}: skipped: {why}")
            else:
                playable.append(s)
        if jobs > 1:
            tasks = [t for t in self.tasks(playable) if not self.job.kept(t[2], t[3])]
            self.job.fresh.update(t[2] for t in tasks)
            run_tasks(_play_task, tasks, jobs, _init_worker, (self.worker_spec(jobs, faults),),
                      partial(self._told, min(jobs, len(tasks))))
        for s in playable:
            mine = [self.job.once(f"{s.name} / {r.label}", self._run_inputs(r), partial(self.oracle_run, s, r),
                                  self.tell) for r in s.runs]
            got = self.job.once(f"{s.name} self-consistency", self._scenario_inputs(s),
                                partial(self.against_itself, s), self.tell)
            rows += _with_self_consistency(s, mine + got["rows"], got, pairs, skipped)
        return rows, pairs, skipped

    def _told(self, workers: int, lines: list[str], k: int, n: int) -> None:
        for line in lines:
            self.tell(line)
        self.tell(f"[{k} of {n} done in {workers} worker processes]")

    def tasks(self, scenarios: Sequence[Scenario]) -> list[tuple]:
        """Every run and self-consistency play of ``scenarios`` as a worker's task (kind, scenario, record name,
        inputs, run), the longest first (by decoder calls: decode steps and prefill chunks; a play as its runs
        twice)."""
        tasks = []
        for s in scenarios:
            for r in s.runs:
                tasks.append((_calls(r), ("run", s, f"{s.name} / {r.label}", self._run_inputs(r), r)))
            tasks.append((2 * sum(_calls(r) for r in s.runs) + 64 * len(s.scripts),
                          ("self", s, f"{s.name} self-consistency", self._scenario_inputs(s), None)))
        return [t for _, t in sorted(tasks, key=lambda t: -t[0])]

    def worker_spec(self, jobs: int, faults: Sequence[str]) -> dict:
        """What a worker process needs to rebuild this job (``_init_worker``): picklable inputs only."""
        return {**worker_spec(self.plan, self.ckpt, jobs, self.decoder, self.decoder_dtype, self.device),
                "path": str(self.job.path), "common": self.job.common, "ids": self.ids, "modes": self.modes,
                "profile": self.profile, "faults": list(faults)}

    def _run_inputs(self, r: Run) -> dict:
        return {"run": repr(r), "tokens": digest(r.prompt(self.ids).numpy().tobytes())}

    def _scenario_inputs(self, s: Scenario) -> dict:
        return {"scenario": digest(repr(s).encode()), "tokens": digest(self.ids[: _longest([s])].numpy().tobytes())}

    def oracle_run(self, s: Scenario, r: Run) -> dict:
        """A matrix row: run ``r`` of ``s`` through ``fidelity.run`` (its run directory replaced if a stopped job
        left one)."""
        t = time.perf_counter()
        res = run(self.decoder, self.plan, r.prompt(self.ids), r.decode_steps, self.modes, self.job.path / "runs",
                  run_id=_slug(f"{s.name}-{r.label}"), profile=self.profile, decoder_dtype=self.decoder_dtype,
                  device=self.device, notify=self.notify, prefill_chunk=list(r.chunks) if r.chunks else None,
                  overwrite=True)
        row = _row(s, r.label, r.param, (r.prompt_len, len(r.chunks or (1,)), r.decode_steps), res,
                   time.perf_counter() - t, self.job.path)
        self.tell(f"{s.name} / {r.label}: {res.verdict} ({row['seconds']:.1f} s)")
        return row

    def against_itself(self, s: Scenario) -> dict:
        """``s`` against itself: its pairs, the rows of its played sequences judged against the oracle, why it was
        skipped (a capability the decoder has only in part) or whether the decoder raised."""
        folder = self.job.path
        shutil.rmtree(_traces(folder, s), ignore_errors=True)
        writers: dict[str, TraceWriter] = {}
        done = {"pairs": [], "rows": [], "skipped": None, "crashed": False}
        try:
            got = self_consistency(s, self.ids, self.fresh, partial(_writer, writers, folder, s))
        except DecoderError as err:  # a capability the decoder has only in part (e.g. forks at call ends)
            _abort(writers, folder, s)
            self.tell(f"{s.name}: self-consistency skipped: {err}")
            return {**done, "skipped": str(err)}
        except USER_ERRORS:
            raise
        except Exception as err:  # the decoder raised while the scenario played against itself (a run's
            # own raise ends that run, judged up to the call: ``Runner.run``)
            _abort(writers, folder, s)
            self.tell(f"{s.name}: self-consistency: the decoder raised {raised(err)}")
            return {**done, "pairs": [_crash_pair(s, err)], "crashed": True}
        rows = []
        for label, w in writers.items():  # the scripts as played, each sequence against the oracle
            rows += judge_trace(s, label, w.finish(), self.plan, self.modes, folder, self.device, self.notify,
                                self.tell, overwrite=True)
        shutil.rmtree(_traces(folder, s), ignore_errors=True)  # judged: the run directories hold the metrics
        _remove_if_empty(folder / "traces")
        self.tell(f"{s.name}: self-consistency {sum(p['passed'] for p in got)}/{len(got)} pairs pass")
        return {**done, "pairs": got, "rows": rows}


def _with_self_consistency(s: Scenario, rows: list[dict], got: dict, pairs: list[dict],
                           skipped: dict[str, str]) -> list[dict]:
    """``s``'s matrix rows with their self-consistency column from its pairs ``got`` (added to ``pairs``; a
    self-consistency skipped goes to ``skipped``)."""
    if got["skipped"] is not None:
        skipped[f"{s.name} self-consistency"] = got["skipped"]
        return rows
    pairs += got["pairs"]
    played = {f"{label} / seq {seq}" for label in s.judged for _, seq in s.checks_of(label)}
    for row in rows:  # a run's own pairs; a played sequence's checks
        mine = [p["passed"] for p in got["pairs"]
                if got["crashed"] or p["b"] == row["run"] or (s.checks and row["run"] not in played)]
        if mine:
            row["self_consistency"] = "PASS" if all(mine) else "FAIL"
    return rows


def _drop_other_runs(folder: Path, rows: list[dict]) -> None:
    """Remove the run directories under ``folder/runs`` that no matrix row names (runs of a stopped job that
    this one did not ask for)."""
    named = {Path(r["run_dir"]).name for r in rows}
    for d in (folder / "runs").iterdir() if (folder / "runs").is_dir() else ():
        if d.name not in named:
            shutil.rmtree(d, ignore_errors=True)


def _traces(folder: Path, s: Scenario) -> Path:
    """Where ``s``'s played scripts are traced while they are judged (one folder a scenario: plays in parallel
    workers keep apart)."""
    return folder / "traces" / _slug(s.name)


def _abort(writers: dict[str, TraceWriter], folder: Path, s: Scenario) -> None:
    """Drop the traces of a play that ended early."""
    for w in writers.values():
        w.abort()
    shutil.rmtree(_traces(folder, s), ignore_errors=True)
    _remove_if_empty(folder / "traces")


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # absent, or another scenario's traces are still there
        pass


def _calls(r: Run) -> int:
    """A run's decoder calls: its decode steps and prefill chunks."""
    return r.decode_steps + len(r.chunks or (1,))


_WORKER: dict = {}  # a worker process's own job (``_init_worker``)


def _init_worker(spec: dict) -> None:
    """A worker process's context, built once: the job's checkpoint and ``_Play`` from ``spec`` (``worker_spec``),
    its faults planted for the process's life."""
    torch.set_num_threads(spec["threads"])
    stack = ExitStack()
    stack.enter_context(inject(*spec["faults"]))
    plan, ckpt = open_plan(spec["plan"])
    job = Job(Path(spec["path"]), spec["common"], resumed=True)
    _WORKER.update(stack=stack, play=_Play(job, plan, ckpt, spec["decoder"], spec["ids"], spec["modes"],
                                           spec["profile"], spec["decoder_dtype"], spec["device"], warn,
                                           lambda line: None))


def _play_task(task: tuple) -> list[str]:
    """A worker's task (``_Play.tasks``): the run or self-consistency play kept in the job; the lines it told."""
    play, lines = _WORKER["play"], []
    play.tell = lines.append
    kind, s, name, inputs, r = task
    compute = partial(play.oracle_run, s, r) if kind == "run" else partial(play.against_itself, s)
    play.job.once(name, inputs, compute, lines.append)
    return lines


def _context(s: Scenario) -> int:
    return max([r.positions for r in s.runs] + [sc.positions for sc in s.scripts])


def _row(s: Scenario, label: str, param: tuple[str, int], shape: tuple[int, int, int], res, seconds: float,
         tmp: Path) -> dict:
    """One matrix row: a run of ``s`` (``shape``: prompt length, prefill calls, decode steps) and its result."""
    first = str(res.first_divergence or "none")
    ended = res.manifest.get("decoder_raised")
    if ended and res.first_divergence is not None and res.first_divergence.site == "decoder":
        first = f"the decoder raised {raised_in_call(ended)}"
    return {**_run_columns(s, label, param, shape, seconds), "verdict": res.verdict, "first_divergence": first,
            "worst_local_cos": worst_local_cos(res.run_dir), "run_dir": str(res.run_dir.relative_to(tmp)),
            **divergence_columns(res.first_divergence)}


def _run_columns(s: Scenario, label: str, param: tuple[str, int], shape: tuple[int, int, int],
                 seconds: float) -> dict:
    prompt_len, chunks, decode_steps = shape
    return {"scenario": s.name, "run": label, "parameter": f"{param[0]}={param[1] or 'mixed'}",
            "prompt_len": prompt_len, "chunks": chunks, "decode_steps": decode_steps, "self_consistency": "-",
            "seconds": seconds, "param_name": param[0], "param_value": param[1]}


def _crash_pair(s: Scenario, err: Exception) -> dict:
    """The self-consistency row of a scenario whose decoder raised while playing it against itself: failed."""
    return {**dict.fromkeys(PAIR_COLUMNS, "-"), "scenario": s.name, "pair": "the decoder raised", "b": raised(err),
            "a": "", "passed": False}


def _writer(writers: dict[str, TraceWriter], tmp: Path, s: Scenario, script: Script,
            decoder: Decoder) -> TraceWriter | None:
    """A trace writer for ``script`` played on ``decoder`` when ``s`` judges it against the oracle (a script its
    checks exercise)."""
    if script.label not in s.judged:
        return None
    writers[script.label] = TraceWriter(_traces(tmp, s) / _slug(script.label), decoder.config,
                                        decoder=decoder.label, profile=decoder.profile)
    return writers[script.label]


def judge_trace(s: Scenario, label: str, trace: Path, plan: CheckpointPlan, modes: Sequence[str], tmp: Path,
                device: str, notify: Callable[[str, str], None], tell: Callable[[str], None],
                overwrite: bool = False) -> list[dict]:
    """Each sequence of the trace of script ``label`` as played against the oracle: a matrix row per sequence
    (``<label> / seq <k>``), its run directory under ``runs/`` (one there already replaced with ``overwrite``)."""
    rows = []
    for seq in read_trace(trace).sequences:
        t = time.perf_counter()
        view = TraceDecoder(trace, seq)
        res = run(view, plan, modes=modes, out=tmp / "runs", run_id=_slug(f"{s.name}-{label}-seq{seq}"),
                  device=device, notify=notify, overwrite=overwrite)
        rows.append(_row(s, f"{label} / seq {seq}", ("prompt_len", len(view.prompt)),
                         (len(view.prompt), len(view.chunks), len(view.generated)), res, time.perf_counter() - t,
                         tmp))
        tell(f"{s.name} / {label} / seq {seq}: {res.verdict} ({rows[-1]['seconds']:.1f} s)")
    return rows


# raised as they are: what is asked cannot be done with this model, decoder or folder (the user's to fix); anything
# else a decoder raises while a script plays fails that scenario's self-consistency (or that mutant's run), and the
# others go on
USER_ERRORS = (RunError, DecoderError, ContextError, InputError, CheckpointError, RunDirError, OSError)
ROW_COLUMNS = ("scenario", "run", "parameter", "prompt_len", "chunks", "decode_steps", "verdict", "first_divergence",
               "worst_local_cos", "self_consistency", "run_dir", "seconds", "param_name", "param_value", "first_step",
               "first_site", "first_layer")


def _label(decoder: Decoder | str) -> str:
    """The decoder as the report names it, with the faults planted in it."""
    label = decoder.label if isinstance(decoder, Decoder) else decoder
    return label + (f" with {', '.join(planted)} planted" if (planted := sorted(active())) else "")
