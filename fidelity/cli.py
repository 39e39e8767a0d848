"""The ``fidelity`` command line. Bad inputs end in one clear line on stderr and exit code 2.

Help, the version and argument errors need no torch: every heavy module (torch, pandas, the harness) is imported
inside the command that uses it."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fidelity._version import __version__
from fidelity.model.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch

EXAMPLES = """examples:
  fidelity run                               the default: the trained default checkpoint (tiny shape), its own
                                             1.2K-token Python prompt, 64 decode steps, profile reference, modes
                                             free+layer+op; prints where the report is
  fidelity run --prompt-text-file my.py      text in (the checkpoint's tokenizer.json), continuations out as text
  fidelity run --preset tiny                 random weights of the tiny shape instead (synthesized, seed 0)
  fidelity run --profile fp8-fmha --decode 16 --mode layer --mode op --gate
  fidelity run --checkpoint ckpt/ --prompt-file ids.txt --profile my_profile.toml --thresholds th.toml
  fidelity report runs/<run-id>              re-render the report (optionally --thresholds)
  fidelity compare runs/<a> runs/<b> ...     profiles or versions side by side (runs/compare-<a>-vs-<b>/); run
                                             or scenario report directories
  fidelity run --decoder trace:DIR           judge a recorded trace, every sequence (docs/traces.md)
  fidelity memory --preset flash --context 1048576
  fidelity oracle                            the oracle alone on the trained default
  fidelity oracle --prompt-text-file f.py    mean NLL per token of a text, and the greedy continuation as text
  fidelity oracle --prompt-len 4096 --decode 32 --oracle-dtype fp64
  fidelity recall --contexts 16384           the indexer's top-k recall per precision against the exact fp32
                                             selection, at k 32/128/512/1024 (docs/recall.md)
  fidelity synth --preset tiny --seed 1 --out ckpt/ --layout deepseek
  fidelity oracle --checkpoint ckpt/         any checkpoint: deepseek, official or transformers layout
  fidelity inspect ckpt/                     validate a checkpoint and list what it holds
  fidelity config --preset flash --spelling hf
"""

OPTION_NAMES = {"checkpoint": "--checkpoint", "preset": "--preset", "max_context": "--max-context",
                "graphs": "--graphs"}
SAMPLER_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "repetition_penalty": "--repetition-penalty",
                 "seed": "--sample-seed", "repetition_window": "--repetition-window"}
DEFAULT_PROMPT_LEN = 1024  # fidelity.model.default.RANDOM_PROMPT_LEN, written out to keep torch out of --help
SMALL_MODEL_DIM = 1024  # --threads auto: one intra-op thread on the CPU up to this hidden size


class UsageError(Exception):
    """A user error reported as one line, exit code 2."""


def _plan(args, replay=None, notify=None):
    """The run's checkpoint from ``--checkpoint`` / ``--preset`` / ``--layers`` / ``--seed`` (``api.plan_checkpoint``:
    opened or planned, not yet synthesized, so that every argument is checked first)."""
    from fidelity.api import plan_checkpoint

    layers = getattr(args, "layers", None)
    if layers is not None and layers < 1:
        raise UsageError(f"--layers: expected >= 1, found {layers}")
    if layers is not None and getattr(args, "checkpoint", None):
        raise UsageError("--layers: cuts a --preset's layers; a --checkpoint keeps its own (leave --layers out)")
    return plan_checkpoint(args.checkpoint, replay, preset=args.preset, seed=args.seed,
                           layers=getattr(args, "layers", None), device=getattr(args, "device", "cpu") or "cpu",
                           names=OPTION_NAMES, notify=notify or _notify)


def _notify(kind: str, message: str) -> None:
    print(f"fidelity: {kind}: {message}", file=sys.stderr)


def _prompt(args, plan) -> torch.Tensor:
    """Token ids (``--prompt-file``), text (``--prompt-text`` / ``--prompt-text-file``, BOS + its ids), or the
    default prompt (``plan.prompt``: the trained default's own text, else random ids); ``--prompt-len`` cuts any."""
    from fidelity.model import text

    cfg = plan.config

    if args.prompt_len is not None and args.prompt_len < 1:
        raise UsageError(f"--prompt-len: expected >= 1, found {args.prompt_len}")
    if args.prompt_file:
        ids = _read_ids(args.prompt_file, cfg.vocab_size, "--prompt-file")
    elif args.prompt_text is not None or args.prompt_text_file:
        option = "--prompt-text" if args.prompt_text is not None else "--prompt-text-file"
        body = args.prompt_text if args.prompt_text is not None else text.read_text(args.prompt_text_file, option)
        tok = _text_tokenizer(args, plan.path)
        if tok is None:
            raise UsageError(f"{option}: needs a tokenizer: the checkpoint has no tokenizer.json beside its config "
                             "(a synthesized preset never has one); pass --checkpoint DIR with one, or --tokenizer "
                             "tokenizer.json")
        ids = text.encode_prompt(text.load(tok), body, cfg.bos_token_id, cfg.vocab_size, option)
    else:
        return plan.prompt(args.prompt_len)
    return ids if args.prompt_len is None else ids[: args.prompt_len]


def _given_prompt(args) -> bool:
    """Whether the prompt comes from ``--prompt-file`` / ``--prompt-text`` / ``--prompt-text-file``."""
    return bool(args.prompt_file or args.prompt_text is not None or args.prompt_text_file)


def _check_device(device: str | None, option: str = "--device") -> None:
    """A device this torch can run on, or one line naming the torch build and what to install (before any work)."""
    import torch

    if device is None or device == "cpu":
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind != "cuda":
        raise UsageError(f"{option}: expected cpu or cuda[:N] (the devices the decoders and the oracle run on), found "
                         f"{device!r}")
    if torch.version.cuda is None:
        raise UsageError(f"{option} {device}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                         "build (pip install torch --index-url https://download.pytorch.org/whl/cu128, "
                         "https://pytorch.org/get-started/locally/) or leave --device out to run on the CPU")
    if not torch.cuda.is_available():
        raise UsageError(f"{option} {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA "
                         "device on this machine (driver, CUDA_VISIBLE_DEVICES); leave --device out to run on the CPU")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise UsageError(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0..cuda:{torch.cuda.device_count() - 1}")


def _check_memory(args, plan, profile, prompt_len: int) -> None:
    """A run on the CPU whose estimated memory (``fidelity.budget``) exceeds what this machine has available is
    refused in one line that names the parts and what to change."""
    from fidelity import budget
    from fidelity.decoders.production.cache_sizes import profile_formats

    if args.device != "cpu" or (args.oracle_device or "cpu") != "cpu":  # the host's memory holds it all only here
        return
    steps = 64 if args.decode is None else args.decode
    kv_fmt, index_fmt = profile_formats(profile)
    need = budget.estimate(plan.config, prompt_len, steps,
                           tuple(args.mode or ("free", "layer", "op")), args.prefill_chunk, kv_fmt, index_fmt,
                           8 if args.oracle_dtype == "fp64" else 4)
    if why := budget.shortfall(need, budget.available_bytes()):
        raise UsageError(f"prompt {prompt_len} tokens + {steps} decode steps: "
                         f"the run {why}; shorten --prompt-len, or --mode op (the oracle then keeps no cache of its "
                         "own), or run on a larger machine")


def _given_tokenizer(args) -> Path | None:
    """``--tokenizer`` when it is a tokenizer.json (the others name stop ids only)."""
    given = getattr(args, "tokenizer", None)
    return Path(given) if given and Path(given).name == "tokenizer.json" else None


def _text_tokenizer(args, path) -> Path | None:
    """The tokenizer.json for text: ``--tokenizer`` when it is one, else the checkpoint's at ``path``, else None."""
    from fidelity.model import text

    return _given_tokenizer(args) or text.tokenizer_path(path)


def _jobs_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", default="1", metavar="N",
                        help="run the runs in N worker processes (default 1; each holds its own model: N times the "
                             "memory; --threads is shared among them)")


def _jobs(text: str) -> int:
    """``--jobs``: an integer worker count (``workers.check_jobs``), else a UsageError in one line."""
    from fidelity.studies.workers import MAX_JOBS, check_jobs

    try:
        return check_jobs(int(text))
    except ValueError:
        raise UsageError(f"--jobs: expected an integer from 1 to {MAX_JOBS}, found {text!r}") from None


def _threads(args, cfg: ModelConfig, device: str = "cpu") -> int:
    """Apply ``--threads`` (``auto``: 1 on the CPU for models up to SMALL_MODEL_DIM wide, where torch's intra-op
    threads cost more than they give on small tensors; torch's default otherwise). Returns the count."""
    import torch

    if args.threads == "auto":
        if torch.device(device).type != "cpu" or cfg.dim > SMALL_MODEL_DIM:
            return torch.get_num_threads()
        n = 1
    else:
        try:
            n = int(args.threads)
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"--threads: expected 'auto' or an integer >= 1, found {args.threads!r}")
    torch.set_num_threads(n)
    return n


def cmd_run(args) -> int:
    _check_device(args.device)
    _check_device(args.oracle_device, "--oracle-device")
    if args.scenario or args.scenario_file:
        if args.graphs is not None:
            raise UsageError(f"{'--graphs' if args.graphs else '--no-graphs'}: applies to a run's decoder, not to "
                             "--scenario (drop it; scenario runs take the default: graphs on CUDA)")
        return cmd_scenarios(args)
    from fidelity.api import check_graphs, run
    from fidelity.atomic_write import check_new_dir
    from fidelity.decoders.production import get_profile
    from fidelity.harness.thresholds import load_thresholds
    from fidelity.model.sampling import SamplerConfig, sampler_problems
    from fidelity.outputs.rundir import check_output, new_run_id
    from fidelity.progress import Progress

    try:  # everything a user can get wrong is checked before the checkpoint is synthesized or read
        profile = get_profile(args.profile)
    except ValueError as err:
        raise UsageError(str(err)) from None
    given = {"temperature": args.temperature, "top_p": args.top_p, "repetition_penalty": args.repetition_penalty,
             "seed": args.sample_seed, "repetition_window": args.repetition_window}
    if problems := sampler_problems(**given):
        raise UsageError("; ".join(f"{SAMPLER_FLAGS[field]}: {what}" for field, what in problems.items()))
    sampler = SamplerConfig(**given)
    if args.thresholds:
        load_thresholds(args.thresholds)
    run_id = new_run_id() if args.run_id is None else args.run_id
    check_output(args.out, run_id, args.overwrite)
    if args.write_trace:
        check_new_dir(args.write_trace, args.overwrite, "--write-trace")
    write_dump = _write_dump(args)
    if args.decode is not None and args.decode < 0:
        raise UsageError(f"--decode: expected >= 0, found {args.decode}")
    if args.oracle_block is not None and args.oracle_block < 1:
        raise UsageError(f"--oracle-block: expected >= 1 decode call, found {args.oracle_block}")
    if args.sample_queries is not None and args.sample_queries < 1:
        raise UsageError(f"--sample-queries: expected >= 1 prefill queries, found {args.sample_queries}")
    check_graphs(args.graphs, args.decoder, OPTION_NAMES["graphs"])
    _require_transformers(args)
    _check_trace_model(args)
    replays = _traces(args)  # every sequence to judge, each view checked before any run starts
    replay = replays[0] if replays else None
    if replay is not None and args.decode is not None:
        _notify("note", f"--decode {args.decode}: does not apply to --decoder trace:DIR (a trace replays its own "
                        "decode steps); ignored")
    plan = _plan(args, replay)
    if replay is None and args.prompt_len is not None and not _given_prompt(args):
        _check_memory(args, plan, profile, args.prompt_len)  # before the prompt: a long default one is built from text
    prompt = _run_prompt(args, plan, replay)
    if prompt is not None:
        _check_memory(args, plan, profile, len(prompt))
    continuation = _read_ids(args.continuation_file, plan.config.vocab_size, "--continuation-file") \
        if args.continuation_file else None
    threads = _threads(args, plan.config, args.device)
    tok = _given_tokenizer(args)
    extra = {} if replay is not None else {"stream": args.stream, "continuation": continuation,
                                           "prefill_chunk": args.prefill_chunk}
    run_ids = [run_id] if len(replays) < 2 else [f"{run_id}-seq{r.seq}" for r in replays]
    for rid in run_ids[1:]:
        check_output(args.out, rid, args.overwrite)
    failed = 0
    for decoder, rid in zip(replays or [args.decoder], run_ids, strict=True):
        t0 = time.perf_counter()
        progress = Progress()
        try:
            res = run(decoder, plan, prompt, None if replay is not None else args.decode,
                      tuple(args.mode or ("free", "layer", "op")), args.out, run_id=rid, profile=profile,
                      decoder_dtype=args.decoder_dtype, device=args.device, oracle_dtype=args.oracle_dtype,
                      thresholds=args.thresholds, trace=args.write_trace, write_dump=write_dump,
                      overwrite=args.overwrite,
                      progress=progress, notify=_notify, names=OPTION_NAMES, sampler=sampler,
                      stop_ids=_stops(args, plan.config), max_context=args.max_context,
                      sample_queries=args.sample_queries, oracle_device=args.oracle_device,
                      oracle_block=args.oracle_block,
                      tokenizer=str(tok) if tok else None, graphs=args.graphs, **extra)
        finally:
            progress.close()  # ends a bar (a run that stopped on a stop token, or one interrupted) on its own line
        failed += not res.passed
        _print_run(res, plan.what, time.perf_counter() - t0, threads)
    if len(run_ids) > 1:
        print(f"overall: {failed} of {len(run_ids)} sequences FAIL" if failed else
              f"overall: all {len(run_ids)} sequences PASS")
    if args.write_trace:
        print(f"trace: {args.write_trace}")
    if args.write_dump:
        print(f"dump: {write_dump}/oracle and {write_dump}/decoder (SGLang's dumper layout)")
    return 1 if args.gate and failed else 0


def _print_run(res, checkpoint: str, seconds: float, threads: int) -> None:
    """A run's summary: decoder, modes (and why any was skipped), prompt and steps, verdict, report."""
    from fidelity.api import plural
    from fidelity.outputs.report import decoder_raised_line

    steps, modes = res.manifest["decode_steps"], res.manifest["modes"]
    print(f"dsv4-fidelity {__version__}: {res.manifest['decoder']} vs oracle on {checkpoint}, modes {'+'.join(modes)}")
    for mode, why in res.manifest["modes_skipped"].items():
        print(f"skipped {mode} mode: {why}")
    print(f"prompt {plural(res.manifest['prompt_len'], 'token')}, {plural(steps, 'decode step')} "
          f"({res.manifest['stop_reason']}), {seconds:.1f} s, {plural(threads, 'thread')}")
    _print_verdict(res.judgement)
    if line := decoder_raised_line(res.manifest):
        print(line)
    if line := _known_cause(res):
        print(line)
    print(f"report: {res.run_dir / 'report.md'} (and report.html, metrics.parquet, plots/)")


def _known_cause(res) -> str | None:
    """The documented cause of a failure a new user meets first: transformers' bf16 router gate (README, "A live
    decoder"); None for any other run."""
    failures = res.judgement.failures
    if res.passed or res.manifest.get("decoder_dtype") not in ("bf16", "bfloat16") or \
            not str(res.manifest.get("decoder", "")).startswith("transformers"):
        return None
    if not failures["site"].str.fullmatch(r"L\d+\.moe\.weights").any():
        return None
    return ("cause (documented in README.md, \"A live decoder\"): transformers' router computes its gate logits in "
            "bf16 (the official gate is fp32), so its routing weights fail op mode's rule; --decoder-dtype fp32 "
            "judges the model without it")


def cmd_scenarios(args) -> int:
    """``fidelity scenarios`` (and ``fidelity run --scenario NAME``): the catalogue against the oracle and against
    the decoder itself, one combined report directory (fidelity/studies/scenarios.py)."""
    from fidelity.api import plural
    from fidelity.decoders.production import get_profile
    from fidelity.studies import scenario_file
    from fidelity.studies.catalogue import check_names
    from fidelity.studies.scenarios import run_scenarios

    _check_device(args.device)
    files = [scenario_file.read(f) for f in (getattr(args, "scenario_file", None) or ())]
    try:
        scenarios = check_names(args.scenario) if args.scenario or not files else []
        get_profile(args.profile)
    except ValueError as err:
        raise UsageError(str(err)) from None
    faults = _decoder_faults(args, "scenarios")
    jobs = _jobs(getattr(args, "jobs", "1"))  # fidelity run --scenario: one process
    resume = _job_dir(args, "scenarios")
    plan = _plan(args)
    if files:
        _check_scenario_files(args, plan, files)
    scenarios += [s for s, _ in files]
    threads = _threads(args, plan.config, args.device)
    res = run_scenarios(plan, scenarios, args.decoder, args.out or "runs", args.run_id,
                        modes=tuple(args.mode or ("free", "layer", "op")), profile=args.profile,
                        decoder_dtype=args.decoder_dtype, device=args.device, overwrite=args.overwrite,
                        progress=lambda line: print(line, file=sys.stderr, flush=True), notify=_notify,
                        faults=faults, resume=resume, jobs=jobs)
    m, p = res.matrix, res.pairs
    planted = f" with {', '.join(faults)} planted" if faults else ""
    print(f"dsv4-fidelity {__version__}: scenarios {', '.join(s.name for s in scenarios)} on {args.decoder}{planted} "
          f"({plan.what}), {res.seconds:.0f} s, " +
          (f"{jobs} worker processes of {plural(max(1, threads // jobs), 'thread')}" if jobs > 1 else
           f"{threads} thread(s)"))
    print(f"oracle: {int((m['verdict'] == 'PASS').sum())}/{len(m)} runs pass; self-consistency: "
          f"{int(p['passed'].sum()) if len(p) else 0}/{len(p)} pairs pass")
    for line in res.failures():
        print(f"FAIL {line}")
    for name, why in res.skipped.items():
        print(f"SKIPPED {name}: {why}")
    if res.resumed:
        print(res.resumed)
    print(f"report: {res.out_dir / 'report.md'} (and report.html, matrix.csv, pairs.csv, plots/, runs/)")
    return 1 if args.gate and not res.passed else 0


def _decoder_faults(args, command: str, production_faults_only: bool = False) -> tuple[str, ...]:
    """``--decoder`` (production or transformers, installed) and the ``--inject`` faults checked against that
    decoder's catalogue (the production decoder's alone where ``production_faults_only``)."""
    if args.decoder not in ("production", "transformers"):
        raise UsageError(f"--decoder: expected production or transformers for {command}, found {args.decoder!r}")
    _require_transformers(args)
    faults = tuple(getattr(args, "inject", None) or ())
    if faults:
        from fidelity.decoders.production.faults import FAULTS
        from fidelity.decoders.transformers import FAULTS as HF_FAULTS

        owner = "production" if production_faults_only else args.decoder
        known = sorted(FAULTS) if owner == "production" else sorted(HF_FAULTS)
        if unknown := sorted(set(faults) - set(known)):
            raise UsageError(f"--inject: expected faults of the {owner} decoder ({', '.join(known)}), found "
                             f"{', '.join(unknown)}")
    return faults


def _check_scenario_files(args, plan, files) -> None:
    """Each ``--scenario-file``'s calls against what the decoder can do and the model's context (one line naming
    the field)."""
    from fidelity.api import open_decoder
    from fidelity.studies.scenario_file import check_decoder

    decoder = open_decoder(args.decoder, plan.open(), args.profile, 64, args.device, args.decoder_dtype)
    for path, (_, script) in zip(args.scenario_file, files, strict=True):
        check_decoder(script, decoder, plan.config.max_seq_len, path)


def cmd_fuzz(args) -> int:
    """``fidelity fuzz``: call scripts drawn at random, judged against the decoder itself and the oracle, a failing
    one shrunk and written as a scenario file (fidelity/studies/fuzz_run.py)."""
    from fidelity.decoders.production import get_profile
    from fidelity.outputs.rundir import check_output, new_run_id
    from fidelity.studies.fuzz_run import parse_budget, parse_seed, run_fuzz

    _check_device(args.device)
    budget = parse_budget(args.budget)
    shrink_s = parse_budget(args.shrink_budget, "--shrink-budget") if args.shrink_budget else None
    seed = parse_seed(args.seed)
    if args.max_context < 2:
        raise UsageError(f"--max-context: expected >= 2, found {args.max_context}")
    if not 0 <= args.oracle_rate <= 1:
        raise UsageError(f"--oracle-rate: expected a share in 0..1, found {args.oracle_rate}")
    try:
        get_profile(args.profile)
    except ValueError as err:
        raise UsageError(str(err)) from None
    faults = _decoder_faults(args, "fuzz", production_faults_only=True)
    run_id = f"fuzz-{new_run_id()}" if args.run_id is None else args.run_id
    check_output(args.out, run_id, args.overwrite)
    args.seed = 0  # the preset's weights and default prompt; --seed is the search's
    plan = _plan(args)
    if args.max_context > plan.config.max_seq_len:
        raise UsageError(f"--max-context: expected <= the model's context {plan.config.max_seq_len}, found "
                         f"{args.max_context}")
    threads = _threads(args, plan.config, args.device)
    res = run_fuzz(plan, args.decoder, args.out, run_id, seed=seed, budget_s=budget, context=args.max_context,
                   oracle_rate=args.oracle_rate, modes=tuple(args.mode or ("free", "layer")), shrink_s=shrink_s,
                   profile=args.profile, decoder_dtype=args.decoder_dtype, device=args.device,
                   overwrite=args.overwrite, progress=lambda line: print(line, file=sys.stderr, flush=True),
                   faults=faults)
    f = res.found
    print(f"dsv4-fidelity {__version__}: fuzz {args.decoder} ({plan.what}), seed {seed}, {len(res.tried)} scripts in "
          f"{res.seconds:.0f} s, {threads} thread(s)")
    if f is None:
        print("no script failed")
    else:
        print(f"FAIL {f.verdict.check} after {f.seconds_to_failure:.0f} s (script {len(res.tried)}); shrunk to "
              f"{len(f.shrunk.ops)} ops: {f.shrunk_verdict.detail}")
        print(f"replay: fidelity scenarios --scenario-file {res.out_dir / 'scenario.json'}")
    print(f"report: {res.out_dir / 'report.md'}")
    return 1 if args.gate and f is not None else 0


def _job_dir(args, command: str) -> Path | None:
    """The job directory of ``--resume DIR`` (checked: a job directory of ``command``), or None for a new job whose
    ``--out`` / ``--run-id`` place is checked here; both before any work. Sets ``args.job_dir`` (where an
    interrupted job is kept)."""
    from fidelity.outputs.rundir import check_output, new_run_id
    from fidelity.studies.jobdir import open_job

    if getattr(args, "resume", None) is not None:
        given = [f for f, v in (("--out", args.out), ("--run-id", args.run_id), ("--overwrite", args.overwrite)) if v]
        if given:
            raise UsageError(f"--resume: continues the job in its own directory; expected no {', '.join(given)}")
        args.job_dir = open_job(args.resume, command)
        return args.job_dir
    args.run_id = f"{command}-{new_run_id()}" if args.run_id is None else args.run_id
    args.job_dir = check_output(args.out or "runs", args.run_id, args.overwrite)
    return None


def _require_transformers(args) -> None:
    """``--decoder transformers`` without transformers installed: one line saying what to install."""
    from fidelity.decoders.transformers import TransformersMissing, require_transformers

    if args.decoder == "transformers":
        try:
            require_transformers("--decoder transformers")
        except TransformersMissing as err:
            raise UsageError(str(err)) from None


def _check_trace_model(args) -> None:
    """``--decoder trace:DIR``: the config in trace.json against the checkpoint the trace will be judged on, before
    any step file is read (a trace of another model is named as that, not as the first site of the wrong shape)."""
    if args.decoder.startswith("trace:"):
        from fidelity.decoders.trace import TraceHeader

        _plan(args, TraceHeader(args.decoder.removeprefix("trace:")), notify=lambda kind, message: None)


def _write_dump(args) -> str | None:
    """``--write-dump sglang:DIR``'s folder, checked now (only SGLang's dumper layout is written)."""
    if not args.write_dump:
        return None
    fmt, sep, directory = args.write_dump.partition(":")
    if not sep or fmt != "sglang" or not directory:
        raise UsageError(f"--write-dump: expected sglang:DIR (SGLang's dumper layout), found {args.write_dump!r}")
    from fidelity.atomic_write import check_new_dir

    check_new_dir(directory, args.overwrite, "--write-dump")
    return directory


def _traces(args) -> list:
    """The TraceDecoders of ``--decoder trace:DIR``: the sequence ``--trace-seq`` names, else every sequence the
    trace holds (each judged as its own run); every file checked now. Empty for a live decoder."""
    from fidelity.decoders.trace import TraceDecoder
    from fidelity.decoders.trace_file import read_trace

    if args.decoder in ("production", "transformers"):
        if args.trace_seq is not None:
            raise UsageError("--trace-seq: needs --decoder trace:DIR")
        return []
    from fidelity.decoders.engine_dump import is_dump, open_dump

    if not args.decoder.startswith("trace:") and not is_dump(args.decoder):
        raise UsageError(f"--decoder: expected production, transformers, trace:DIR, sglang-dump:DIR or hook-dump:DIR, "
                         f"found {args.decoder!r}")
    if args.write_trace or args.write_dump:
        raise UsageError(f"{'--write-trace' if args.write_trace else '--write-dump'}: a replayed trace or dump is not "
                         "recorded again")
    if is_dump(args.decoder):  # the dump read as the checkpoint's model: it names no checkpoint of its own
        return open_dump(args.decoder, _plan(args).config, args.site_map, args.dump_precision, args.trace_seq)
    if args.site_map:
        raise UsageError("--site-map: applies to --decoder sglang-dump:DIR and hook-dump:DIR")
    directory = args.decoder.removeprefix("trace:")
    seqs = [args.trace_seq] if args.trace_seq is not None else read_trace(directory).sequences
    return [TraceDecoder(directory, seq) for seq in seqs]


def _run_prompt(args, plan, replay) -> torch.Tensor | None:
    """The prompt of a run: ``_prompt``, or None for a replayed trace (its own; a prompt option then is an error)."""
    if replay is None:
        return _prompt(args, plan)
    if args.prompt_file or args.prompt_len is not None or args.prompt_text is not None or args.prompt_text_file:
        raise UsageError("--prompt-file/--prompt-text/--prompt-text-file/--prompt-len: a trace replays its own prompt; "
                         "leave them out")
    return None


def _stops(args, cfg) -> tuple[int, ...] | None:
    from fidelity.model.sampling import StopSet

    if bad := [i for i in args.stop_id or () if not 0 <= i < cfg.vocab_size]:
        raise UsageError(f"--stop-id: expected ids in [0, {cfg.vocab_size}), found {', '.join(map(str, bad))}")
    if args.tokenizer:
        return tuple(StopSet.from_tokenizer_file(args.tokenizer, extra=args.stop_id or ()))
    if args.stop_id:
        return tuple(StopSet.from_config(cfg, extra=args.stop_id))
    return None


def _print_verdict(j) -> None:
    """Verdict, first divergence, and a warning for each threshold-file rule that checked nothing."""
    n = int((~j.judged["passed"]).sum())
    print(f"verdict: {'PASS' if j.passed else 'FAIL'}" + ("" if j.passed else f" ({n} threshold failures)"))
    print(f"first divergence: {j.first_divergence or 'none'}")
    for rule in j.unmatched():
        if rule.source != "default":
            print(f"warning: threshold rule {rule.site_regex!r} {rule.metric} {rule.text} ({rule.source}) checked "
                  "no value of this run", file=sys.stderr)


REJUDGED = "report-rejudged"  # fidelity report RUN --thresholds F: the re-judged report, beside the run's own


def cmd_report(args) -> int:
    """Re-render a run's report with its plots and stored rules; ``--thresholds``: re-judge it into
    report-rejudged.md / .html, rejudged.json and plots-rejudged/, leaving the run's own verdict as it was."""
    from fidelity.atomic_write import write_text_atomic
    from fidelity.harness.judgement import judge, run_rules
    from fidelity.outputs.plots import existing_plots, make_plots
    from fidelity.outputs.report import write_report
    from fidelity.outputs.rundir import read_run

    run_dir = Path(args.run)
    df, manifest = read_run(run_dir)
    rules, klass = run_rules(manifest, df, args.thresholds)
    judgement = judge(df, rules, klass)
    if args.thresholds:
        entries = {**judgement.manifest_entries(), "rejudged_with": str(args.thresholds)}
        plots = make_plots(df, run_dir / "plots-rejudged", judgement.rules)
        md, html = write_report(run_dir, df, {**manifest, **entries}, judgement, plots, stem=REJUDGED)
        write_text_atomic(run_dir / "rejudged.json", json.dumps(entries, indent=2) + "\n")
    else:
        md, html = write_report(run_dir, df, manifest, judgement, existing_plots(run_dir / "plots"))
    _print_verdict(judgement)
    print(f"report: {md} and {html}")
    if args.thresholds:
        print(f"re-judged with {args.thresholds} beside the run's own report (report.md, manifest.json: its verdict "
              "as run); rejudged.json holds the new rules and verdict")
    return 1 if args.gate and not judgement.passed else 0


def cmd_plot(args) -> int:
    from fidelity.outputs.plots import make_plots
    from fidelity.outputs.rundir import read_run

    df, _ = read_run(args.run)
    for path in make_plots(df, Path(args.run) / "plots"):
        print(path)
    return 0


def cmd_compare(args) -> int:
    from fidelity.outputs.compare import compare_runs

    table, plot = compare_runs(args.runs, args.out, overwrite=args.overwrite)
    print(table)
    print(f"plot: {plot}")
    return 0


def cmd_memory(args) -> int:
    from fidelity.decoders.production.cache_sizes import memory_main

    try:
        print(memory_main(None if args.config else args.preset, args.config, args.context))
    except ValueError as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_mutants(args) -> int:
    from fidelity.api import plural
    from fidelity.decoders.transformers import FAULTS as HF_FAULTS
    from fidelity.decoders.transformers import TransformersDecoder
    from fidelity.outputs.report import md_table
    from fidelity.studies.mutant_runs import MutantSettings, run_mutants_job
    from fidelity.studies.mutants import check_names
    from fidelity.studies.workers import worker_spec

    _check_device(args.device)
    if args.decoder not in ("production", "transformers"):
        raise UsageError(f"--decoder: expected production or transformers, found {args.decoder!r}")
    _require_transformers(args)
    known = HF_FAULTS if args.decoder == "transformers" else None
    try:
        check_names(args.only, known)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.decode is not None and args.decode < 0:
        raise UsageError(f"--decode: expected >= 0, found {args.decode}")
    jobs = _jobs(args.jobs)
    resume = _job_dir(args, "mutants")
    plan = _plan(args)
    threads = _threads(args, plan.config)
    ckpt = plan.open()
    settings = MutantSettings(tuple(args.mode or ("layer", "op")), args.seed, args.device, args.decode)
    factory = None
    if args.decoder == "transformers":
        def factory():
            return TransformersDecoder.from_checkpoint(ckpt, args.decoder_dtype, args.device)

    def progress(k: int, n: int, name: str) -> None:
        print(f"[{k + 1}/{n}] {name}", file=sys.stderr, flush=True)

    decoder = "production" if factory is None else f"transformers ({args.decoder_dtype})"
    reopen = worker_spec(plan, ckpt, jobs, args.decoder, args.decoder_dtype, args.device) if jobs > 1 else None
    res = run_mutants_job(ckpt, args.job_dir, args.only, settings, progress, factory, known, decoder_label=decoder,
                          resume=resume is not None, overwrite=args.overwrite, jobs=jobs, reopen=reopen)
    workers = f"{jobs} worker processes of {plural(max(1, threads // jobs), 'thread')}" if jobs > 1 else \
        plural(threads, "thread")
    print(f"dsv4-fidelity {__version__}: mutants of the {decoder} decoder on {plan.what}, {workers}")
    print(md_table(res.table))
    print("gate: PASS" if not res.failures else "gate: FAIL\n" + "\n".join(f"  - {f}" for f in res.failures))
    if res.resumed:
        print(res.resumed)
    print(f"matrix: {res.out_dir / 'detection.md'} (and detection.html, detection.parquet)")
    return 1 if args.gate and res.failures else 0


def cmd_oracle(args) -> int:
    from fidelity.api import warn_past_max_seq_len
    from fidelity.harness.oracle_run import ORACLE_DTYPES, format_summary, run_oracle
    from fidelity.model import text
    from fidelity.progress import Progress

    if args.decode < 0:
        raise UsageError(f"--decode: expected >= 0, found {args.decode}")
    plan = _plan(args)
    if args.held_out:
        return _held_out(args, plan)
    prompt = _prompt(args, plan)
    warn_past_max_seq_len(plan.config, len(prompt), args.decode, _notify)
    _threads(args, plan.config)
    ckpt = plan.open()
    tok = _text_tokenizer(args, ckpt.path)
    summary = run_oracle(ckpt, prompt, args.decode, ORACLE_DTYPES[args.oracle_dtype], Progress(),
                         text.load(tok) if tok is not None else None)
    print(format_summary(summary, f"dsv4-fidelity {__version__}: oracle on {plan.what}", plan.config.vocab_size))
    return 0


def cmd_recall(args) -> int:
    """``fidelity recall``: the indexer recall study (``fidelity.studies.recall``) on one checkpoint; a table and
    files."""
    from fidelity.api import open_checkpoint
    from fidelity.outputs.recall_report import format_table, write_study
    from fidelity.studies import recall

    _check_device(args.device)
    ckpt = open_checkpoint(args.checkpoint)
    _threads(args, ckpt.config, args.device)
    try:
        recall.check_request(ckpt.config, args.contexts, args.topk, args.precisions, args.queries)
        result = recall.run_study(ckpt, args.contexts, args.topk, args.precisions, args.queries, args.chunk,
                                  args.device, progress=lambda s: _notify("progress", s) if args.verbose else None)
    except recall.RecallError as err:
        raise UsageError(str(err)) from None
    tables = recall.summaries(result)
    paths = write_study(result, tables, recall.__doc__, Path(args.out))
    print(f"dsv4-fidelity {__version__}: indexer recall on {ckpt.path or 'the checkpoint'} (index_topk "
          f"{ckpt.config.index_topk}); recall over the queries with more visible entries than k")
    print(format_table(tables["pooled"]))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_dtype_flow(args) -> int:
    import pandas as pd

    from fidelity.decoders.production import ProductionModel, get_profile
    from fidelity.decoders.production.dtype_flow import dtype_flow, flow_table
    from fidelity.outputs.report import md_table

    try:
        profile = get_profile(args.profile)
    except ValueError as err:
        raise UsageError(str(err)) from None
    plan = _plan(args)
    prompt = _prompt(args, plan)
    _threads(args, plan.config)
    ckpt = plan.open()
    rows = flow_table(dtype_flow(ProductionModel(ckpt, profile, len(prompt) + 1), prompt))
    print(f"dsv4-fidelity {__version__}: dtype flow of production ({profile.name}) on {plan.what}, a "
          f"{len(prompt)}-token prefill and one decode step: values narrowed, then widened by their next use")
    print(md_table(pd.DataFrame(rows)) if rows else "no round trips")
    print(f"round trips: prefill {sum(r['prefill'] for r in rows)}, decode step {sum(r['decode step'] for r in rows)}")
    return 0


def _held_out(args, plan) -> int:
    """``fidelity oracle --held-out``: the oracle's mean NLL per token over the corpus's held-out files."""
    from fidelity.model import text
    from fidelity.train import corpus
    from fidelity.train.loop import EVAL_MAX_LEN, heldout_nll, tokenize
    from oracles import OracleModel

    tok = _text_tokenizer(args, plan.path)
    if tok is None:
        raise UsageError("--held-out: needs a tokenizer: the checkpoint has no tokenizer.json beside its config")
    files = corpus.split(corpus.corpus_files(args.corpus))[1]
    if not files:
        raise UsageError(f"--held-out: no file of {args.corpus or corpus.stdlib_root()} is held out (one path in "
                         f"{corpus.HELD_OUT_OF} is)")
    _threads(args, plan.config)
    ckpt = plan.open()
    nll, count = heldout_nll(OracleModel(ckpt), tokenize(text.load(tok), files), EVAL_MAX_LEN)
    print(f"dsv4-fidelity {__version__}: oracle on {plan.what}")
    print(f"held-out NLL: {nll:.4f} nats/token over {count} tokens of {len(files)} files (the first {EVAL_MAX_LEN} "
          f"tokens of each, from BOS) under {args.corpus or corpus.stdlib_root()}; "
          f"uniform: {math.log(plan.config.vocab_size):.4f}")
    return 0


_ID_SEPARATORS = re.compile(r"[\s,\[\]]+")


def _read_ids(path: str, vocab: int, option: str) -> torch.Tensor:
    """Token ids from a file: separated by whitespace or commas, or a JSON list. Errors name the first bad
    token by position (0-based) and text."""
    import torch

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"{option}: cannot read {path}: {err.strerror}") from None
    tokens = [t for t in _ID_SEPARATORS.split(text) if t]
    if not tokens:
        raise UsageError(f"{option} {path}: expected at least one token id, found none")
    for k, t in enumerate(tokens):
        if not re.fullmatch(r"[+-]?\d+", t):
            raise UsageError(f"{option} {path}: token {k} is {t[:40]!r}, expected an integer token id")
        if not 0 <= int(t) < vocab:
            raise UsageError(f"{option} {path}: token {k} is {int(t)}, expected an id in [0, {vocab})")
    return torch.tensor([int(t) for t in tokens], dtype=torch.long)


def cmd_synth(args) -> int:
    from fidelity.api import preset_config
    from fidelity.atomic_write import check_new_dir
    from fidelity.model.save import save_checkpoint
    from fidelity.model.synthesize import synthesize

    check_new_dir(args.out, args.overwrite, "--out", allow_empty=True)
    cfg = preset_config(args.preset)
    save_checkpoint(synthesize(cfg, seed=args.seed), args.out, layout=args.layout, overwrite=args.overwrite)
    print(f"wrote {args.layout} checkpoint of preset '{args.preset}' (seed {args.seed}) to {args.out}")
    return 0


def cmd_train(args) -> int:
    from fidelity.atomic_write import check_new_dir
    from fidelity.train.loop import TrainSettings, train

    _check_device(args.device)
    for name in ("steps", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected >= 1, found {getattr(args, name)}")
    check_new_dir(args.out, args.overwrite, "--out", allow_empty=True)
    settings = TrainSettings(out=args.out, steps=args.steps, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                             device=args.device, corpus=args.corpus, tokenizer=args.tokenizer,
                             eval_every=args.eval_every, init=args.init, warmup=args.warmup)
    log = train(settings)
    print(f"wrote {Path(args.out) / 'checkpoint'} and {Path(args.out) / 'training.json'}; held-out NLL "
          f"{log['final']['held_out_nll']:.3f} nats/token")
    return 0


def cmd_inspect(args) -> int:
    from fidelity.model.load import load_checkpoint

    ckpt = load_checkpoint(args.checkpoint)
    cfg = ckpt.config
    formats: dict[str, int] = {}
    for name in ckpt.names():
        fmt = ckpt.stored(name).fmt
        formats[fmt] = formats.get(fmt, 0) + 1
    print(f"{args.checkpoint}: layout {ckpt.layout}, {len(ckpt.names())} tensors "
          + ", ".join(f"{k} {v}" for k, v in sorted(formats.items())))
    print(f"layers {cfg.n_layers}: " + " ".join(cfg.layer_kinds) + f"; hash layers {cfg.n_hash_layers}")
    print(f"dim {cfg.dim}, heads {cfg.n_heads}x{cfg.head_dim}, experts {cfg.n_routed_experts} top-"
          f"{cfg.n_activated_experts}, vocab {cfg.vocab_size}")
    if ckpt.ignored:
        print(f"ignored {len(ckpt.ignored)} tensor(s) (e.g. MTP): {ckpt.ignored[:3]}")
    return 0


def cmd_config(args) -> int:
    cfg = ModelConfig.from_file(args.file) if args.file else ModelConfig.preset(args.preset)
    d = cfg.to_hf_dict() if args.spelling == "hf" else cfg.to_official_dict()
    print(json.dumps(d, indent=2))
    return 0


def _source_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint directory (config.json + *.safetensors; default: the trained "
                                          "default checkpoint)")
    src.add_argument("--preset", help="synthesize this preset's random weights instead of the trained default "
                                      "checkpoint: tiny, flash or pro (--layers alone takes tiny; on --device cuda "
                                      "it is generated on the GPU)")
    p.add_argument("--layers", type=int, help="keep the preset's first N layers (a slice: widths unchanged)")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights and default prompt seed")
    p.add_argument("--prompt-len", type=int, help="cut the prompt to this many tokens (the default prompt: the trained "
                   f"default's text, repeated when longer; random ids elsewhere, default {DEFAULT_PROMPT_LEN})")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt-file", help="token ids (whitespace/comma separated) instead of the default prompt")
    given.add_argument("--prompt-text", help="text, tokenized with the checkpoint's tokenizer.json (BOS first)")
    given.add_argument("--prompt-text-file", help="a UTF-8 text file, tokenized like --prompt-text")
    _threads_arg(p)


def _threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default="auto",
                   help="torch CPU threads (default auto: 1 for models up to 1024 wide, else torch's default)")


def _decoder_args(p: argparse.ArgumentParser, what: str, dtype: str) -> None:
    p.add_argument("--decoder", default="production", help=what)
    p.add_argument("--decoder-dtype", choices=("bf16", "fp16", "fp32", "fp64"), default=dtype,
                   help=f"dtype of --decoder transformers (default {dtype})")


def _oracle_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--oracle-dtype", choices=("fp32", "fp64"), default="fp32", help="the oracle's dtype")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fidelity", description="Differential testing of DeepSeek-V4 decoders.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dsv4-fidelity {__version__}")
    sub = p.add_subparsers(dest="command")

    r = sub.add_parser("run", help="a decoder (default: production) vs the oracle side by side; writes runs/<run-id>/",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _source_args(r)
    r.add_argument("--decode", type=int, help="decode steps after the prompt (default 64; a trace replays its own)")
    _decoder_args(r, "the decoder under test: production (default), transformers (DeepseekV4ForCausalLM), "
                     "trace:DIR (a recorded trace, replayed with its own prompt and tokens), or sglang-dump:DIR / "
                     "hook-dump:DIR (an engine's own dump, docs/engines.md)", "bf16")
    r.add_argument("--write-trace", metavar="DIR", help="also record the decoder's calls as a trace in DIR")
    r.add_argument("--write-dump", metavar="sglang:DIR",
                   help="also write the oracle's (free mode) and the decoder's sites of every call in SGLang's dumper "
                        "layout: DIR/oracle, DIR/decoder (docs/engines.md)")
    r.add_argument("--site-map", metavar="FILE",
                   help="with --decoder sglang-dump:DIR / hook-dump:DIR: a name map (TOML: engine tensor name regex -> "
                        "site), read before the engine's built-in one, or a built-in map's name: sglang, transformers, "
                        "vllm (docs/engines.md)")
    r.add_argument("--dump-precision", choices=("exact", "bf16", "quantized"), default="quantized",
                   help="with a dump: the engine's numerics, which pick the default thresholds (default: quantized)")
    r.add_argument("--trace-seq", type=int, metavar="K",
                   help="with --decoder trace:DIR: judge sequence K only (default: every sequence of the trace, "
                        "each its own run directory <run-id>-seq<K> when there are several)")
    r.add_argument("--profile", default="reference",
                   help="built-in profile, base:field=value,..., or a .toml/.json profile file")
    r.add_argument("--mode", action="append", choices=("free", "layer", "op"), help="repeatable (default: all)")
    r.add_argument("--stream", choices=("oracle", "production", "given"), default="oracle",
                   help="whose pick drives the teacher-forced token stream")
    r.add_argument("--continuation-file", help="token ids for --stream given")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--repetition-penalty", type=float, default=1.0)
    r.add_argument("--repetition-window", type=int, default=0, metavar="N",
                   help="the penalty covers the last N ids of prompt + generated (default 0: all of them)")
    r.add_argument("--sample-seed", type=int, default=0)
    r.add_argument("--stop-id", type=int, action="append", help="extra stop token id (repeatable)")
    r.add_argument("--tokenizer", help="tokenizer.json / tokenizer_config.json / generation_config.json for stops; a "
                   "tokenizer.json also reads --prompt-text and shows the continuations as text")
    _oracle_dtype_arg(r)
    r.add_argument("--max-context", type=int, help="production cache size (default: prompt + decode)")
    r.add_argument("--sample-queries", type=int, help="layer/op modes: oracle on this many prefill queries")
    r.add_argument("--oracle-block", type=int, metavar="N",
                   help="tokens of decode calls and short prefill chunks judged together (default 64, "
                        "oracles.blocks.BLOCK_TOKENS): the oracle modes that do not pick the tokens run them as one "
                        "causal pass, their probes in one batch; 1: each call as it is made")
    r.add_argument("--prefill-chunk", type=int,
                   help="prompt tokens per prefill call (default: the whole prompt up to 8192 tokens, else 8192 at a "
                        "time)")
    r.add_argument("--device", default="cpu", help="the decoder's device (default cpu)")
    r.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="production decoder: decode steps as CUDA-graph replays, the sites recorded from the graph's "
                        "outputs (default: on with a CUDA --device, off on the CPU, where --graphs runs the same "
                        "fixed-shape step uncaptured); the manifest's decode_graphs says which ran")
    r.add_argument("--oracle-device", help="the oracle's device (default: the decoder's); its fp32 runs without TF32")
    r.add_argument("--out", default="runs", help="parent folder of run directories (default runs/)")
    r.add_argument("--run-id")
    r.add_argument("--thresholds", help="TOML: site regex -> {metric = '>=0.99'} overriding the defaults")
    r.add_argument("--gate", action="store_true", help="exit 1 when any threshold fails")
    r.add_argument("--overwrite", action="store_true")
    r.add_argument("--scenario", action="append", metavar="NAME",
                   help="run these scenarios instead (repeatable): the same as fidelity scenarios --scenario NAME")
    r.add_argument("--scenario-file", action="append", metavar="F",
                   help="replay this scenario file's call script as a scenario (repeatable; docs/fuzz.md): the same "
                        "as fidelity scenarios --scenario-file F")
    r.set_defaults(func=cmd_run)

    sc = sub.add_parser("scenarios", help="the scenario catalogue (lengths, chunks, decode-boundaries, long-decode, "
                        "batch, prefix, verify) "
                        "against the oracle and against the decoder itself; one combined report directory")
    sc.add_argument("--scenario", action="append", metavar="NAME",
                    help="lengths, chunks, decode-boundaries, long-decode, batch, prefix or verify (repeatable; "
                    "default: all)")
    src = sc.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint directory (default: the trained default checkpoint)")
    src.add_argument("--preset", help="synthesize this preset's random weights instead (e.g. tiny)")
    sc.add_argument("--layers", type=int, help="keep the preset's first N layers")
    sc.add_argument("--seed", type=int, default=0, help="synthetic weights and default prompt seed")
    _decoder_args(sc, "production (default) or transformers (DeepseekV4ForCausalLM)", "bf16")
    sc.add_argument("--profile", default="reference", help="the production decoder's profile")
    sc.add_argument("--inject", action="append", metavar="FAULT",
                    help="plant this fault of the mutant catalogue in the decoder (repeatable; docs/mutants.md): "
                         "the catalogue must find it")
    sc.add_argument("--scenario-file", action="append", metavar="F",
                    help="a scenario file's call script (repeatable; docs/fuzz.md), e.g. the one fidelity fuzz wrote; "
                         "with no --scenario only the files run")
    sc.add_argument("--mode", action="append", choices=("free", "layer", "op"), help="repeatable (default: all)")
    sc.add_argument("--device", default="cpu", help="the decoder's device (default cpu)")
    sc.add_argument("--out", help="parent folder of the report directory (default runs/)")
    sc.add_argument("--resume", metavar="DIR", help="continue the stopped job in DIR (a fidelity scenarios "
                    "directory): runs it finished with the same inputs are reused, the others run")
    _jobs_arg(sc)
    sc.add_argument("--run-id", help="the directory's name (default scenarios-<UTC time>-<random>)")
    sc.add_argument("--gate", action="store_true", help="exit 1 when a run fails or a self-consistency pair fails")
    sc.add_argument("--overwrite", action="store_true")
    _threads_arg(sc)
    sc.set_defaults(func=cmd_scenarios)

    fz = sub.add_parser("fuzz", help="call scripts drawn at random (Hypothesis) judged against the decoder itself "
                        "and the oracle; a failing one shrunk and written as a scenario file")
    src = fz.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint directory (default: the trained default checkpoint)")
    src.add_argument("--preset", help="synthesize this preset's random weights instead (seed 0)")
    fz.add_argument("--layers", type=int, help="keep the preset's first N layers")
    fz.add_argument("--seed", default="0", help="the search's seed (an integer; the same seed draws the same "
                    "scripts)")
    fz.add_argument("--budget", default="10m", help="how long to search: seconds or 90s, 10m, 1h (default 10m; "
                    "checked before each script)")
    fz.add_argument("--shrink-budget", help="how long to shrink a failing script (default half --budget)")
    fz.add_argument("--max-context", type=int, default=1024, help="positions per sequence (default 1024)")
    fz.add_argument("--oracle-rate", type=float, default=0.1,
                    help="share of passing scripts also judged against the oracle (default 0.1; failing ones always)")
    _decoder_args(fz, "production (default) or transformers (DeepseekV4ForCausalLM)", "bf16")
    fz.add_argument("--profile", default="reference", help="the production decoder's profile")
    fz.add_argument("--inject", action="append", metavar="FAULT", help="plant this fault of the mutant catalogue")
    fz.add_argument("--mode", action="append", choices=("free", "layer", "op"),
                    help="modes of the oracle judgement (repeatable; default free and layer)")
    fz.add_argument("--device", default="cpu", help="the decoder's device (default cpu)")
    fz.add_argument("--out", default="runs", help="parent folder of the report directory (default runs/)")
    fz.add_argument("--run-id", help="the directory's name (default fuzz-<UTC time>-<random>)")
    fz.add_argument("--gate", action="store_true", help="exit 1 when a script fails")
    fz.add_argument("--overwrite", action="store_true")
    _threads_arg(fz)
    fz.set_defaults(func=cmd_fuzz)

    mu = sub.add_parser("mutants", help="inject known DSv4 port bugs, each in its scenario run; which probe "
                        "catches each, and where")
    mu.add_argument("--checkpoint", help="checkpoint directory (default: the trained default)")
    mu.add_argument("--preset", help="synthesize this preset instead (random weights, e.g. tiny)")
    mu.add_argument("--seed", type=int, default=0, help="synthetic weights and default prompt seed")
    mu.add_argument("--only", action="append", help="mutant name (repeatable; default: the whole catalogue); the "
                    "clean decoder runs every scenario run the chosen mutants use")
    mu.add_argument("--decode", type=int, help="decode steps of every run instead of its scenario run's own (a "
                    "quicker look; a mutant that needs decode steps to show may then go undetected)")
    mu.add_argument("--mode", action="append", choices=("free", "layer", "op"), help="default: layer and op")
    _decoder_args(mu, "production (default: the whole catalogue) or transformers (DeepseekV4ForCausalLM with the "
                      "faults it can carry planted at run time)", "fp32")
    mu.add_argument("--device", default="cpu", help="the decoder's and the oracle's device (default cpu)")
    mu.add_argument("--out", help="parent folder of the matrix's directory (default runs/)")
    mu.add_argument("--resume", metavar="DIR", help="continue the stopped job in DIR (a fidelity mutants "
                    "directory): runs it finished with the same inputs are reused, the others run")
    _jobs_arg(mu)
    mu.add_argument("--run-id", help="the directory's name (default mutants-<UTC time>-<random>)")
    mu.add_argument("--overwrite", action="store_true")
    _threads_arg(mu)
    mu.add_argument("--gate", action="store_true",
                    help="exit 1 if the clean decoder alarms or a mutant is missed or found elsewhere")
    mu.set_defaults(func=cmd_mutants)

    rep = sub.add_parser("report", help="re-render a run's report.md / report.html with the rules it was judged "
                         "with, or re-judge it with a threshold file added")
    rep.add_argument("run")
    rep.add_argument("--thresholds", help="TOML rules appended to the run's: the re-judged report is written "
                     "beside the run's own (report-rejudged.md/.html, rejudged.json, plots-rejudged/), which keeps its "
                     "verdict")
    rep.add_argument("--gate", action="store_true")
    rep.set_defaults(func=cmd_report)
    pl = sub.add_parser("plot", help="re-draw a run's plots")
    pl.add_argument("run")
    pl.set_defaults(func=cmd_plot)
    cmp_ = sub.add_parser("compare", help="two or more runs (or scenario reports) side by side: tables and a plot")
    cmp_.add_argument("runs", nargs="+", metavar="RUN", help="run directories, or scenario report directories "
                      "(runs/scenarios-*), at least two of one kind")
    cmp_.add_argument("--out", help="folder for compare.md and the plot (default: compare-<A>-vs-<B>... next to A)")
    cmp_.add_argument("--overwrite", action="store_true")
    cmp_.set_defaults(func=cmd_compare)
    mem = sub.add_parser("memory", help="cache bytes per token and in total, bf16 vs packed storage")
    mem.add_argument("--preset", default="flash")
    mem.add_argument("--config", help="a config.json instead of a preset")
    mem.add_argument("--context", type=int, default=1 << 20)
    mem.set_defaults(func=cmd_memory)

    o = sub.add_parser("oracle", help="run the FP32/FP64 oracle and summarise it per layer",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _source_args(o)
    o.add_argument("--decode", type=int, default=16, help="greedy decode steps after the prompt")
    _oracle_dtype_arg(o)
    o.add_argument("--dtype", dest="oracle_dtype", choices=("fp32", "fp64"), default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # a second spelling, left out of --help
    o.add_argument("--held-out", action="store_true", help="instead: the mean NLL per token over the training "
                   "corpus's held-out files (fidelity train's rule), with the checkpoint's tokenizer")
    o.add_argument("--corpus", help="with --held-out: the corpus folder (default: this Python's standard library)")
    o.set_defaults(func=cmd_oracle)

    rc = sub.add_parser("recall", help="the indexer's top-k recall per precision against the exact fp32 selection "
                        "(and bf16), tie-aware, and the attention mass kept, per CSA layer (docs/recall.md)")
    rc.add_argument("--checkpoint", help="checkpoint folder (default: the trained default)")
    rc.add_argument("--contexts", type=int, nargs="+", default=[16384], help="context lengths (default 16384)")
    rc.add_argument("--topk", type=int, nargs="+", default=[32, 128, 512, 1024], help="top-k values")
    rc.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "fp4", "fp4-no-hadamard", "fp4-packed"],
                    help="indexer precisions: bf16, fp8, fp4, fp4-no-hadamard, fp4-packed, fp32 (the exact path)")
    rc.add_argument("--queries", type=int, default=256, help="sampled query positions per context (default 256)")
    rc.add_argument("--chunk", type=int, default=4096, help="oracle prefill chunk in tokens (default 4096)")
    rc.add_argument("--device", default="cpu")
    rc.add_argument("--out", default="recall", help="output folder (default ./recall)")
    rc.add_argument("--verbose", action="store_true", help="progress lines on stderr")
    _threads_arg(rc)
    rc.set_defaults(func=cmd_recall)

    df_ = sub.add_parser("dtype-flow", help="where the production decoder narrows a value and its next use widens it "
                         "again, per site (a prefill and one decode step)")
    _source_args(df_)
    df_.add_argument("--profile", default="reference",
                     help="built-in profile, base:field=value,..., or a .toml/.json profile file")
    df_.set_defaults(func=cmd_dtype_flow)

    s = sub.add_parser("synth", help="write a deterministic synthetic checkpoint")
    s.add_argument("--preset", default="tiny")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.add_argument("--layout", choices=("deepseek", "official", "transformers"), default="deepseek")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(func=cmd_synth)

    t = sub.add_parser("train", help="train the default checkpoint's recipe (tiny shape, Python stdlib sources)")
    t.add_argument("--out", required=True, help="folder for checkpoint/ (release layout + tokenizer.json), "
                   "training.json")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--seq-len", type=int, default=4096, help="tokens per training window (one window a step)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--corpus", help="folder of .py files (default: this Python's standard library)")
    t.add_argument("--tokenizer", help="reuse this tokenizer.json (default: --init's, else train one on the corpus)")
    t.add_argument("--init", help="continue from this checkpoint folder's weights (default: synthesize tiny)")
    t.add_argument("--warmup", type=int, default=100, help="steps of linear learning-rate warm-up")
    t.add_argument("--eval-every", type=int, default=250, help="steps between held-out measurements (0: at the end)")
    t.add_argument("--overwrite", action="store_true")
    t.set_defaults(func=cmd_train)

    i = sub.add_parser("inspect", help="validate a checkpoint and summarise it")
    i.add_argument("checkpoint")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("config", help="print a preset's or a file's config in either spelling")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--file", help="config.json to parse instead of a preset")
    c.add_argument("--spelling", choices=("official", "hf"), default="official")
    c.set_defaults(func=cmd_config)
    return p


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are a user's error (one line, exit 2), imported only when a command raised one."""
    from fidelity.api import InputError
    from fidelity.atomic_write import OutputError
    from fidelity.decoders.base import ContextError, DecoderError
    from fidelity.decoders.trace_file import TraceError
    from fidelity.harness.runner import RunError
    from fidelity.harness.thresholds import ThresholdError
    from fidelity.model.checkpoint import CheckpointError
    from fidelity.model.sampling import TokenizerFileError
    from fidelity.model.text import TextError
    from fidelity.outputs.compare import CompareError
    from fidelity.outputs.rundir import RunDirError
    from fidelity.train.corpus import CorpusError

    return (UsageError, InputError, ConfigError, CheckpointError, RunDirError, ThresholdError, RunError, ContextError,
            TokenizerFileError, OutputError, CompareError, TraceError, CorpusError, TextError, DecoderError)


def _new_folders(args) -> list[tuple[Path, Path]]:
    """(output folder, its first missing ancestor) for each output option (``--out``, ``--write-trace``) whose
    folder does not exist yet."""
    found = []
    new_job = hasattr(args, "resume") and args.resume is None  # --out left out: runs/ (a resumed job writes none)
    for option in ("out", "write_trace"):
        path = getattr(args, option, None) or ("runs" if option == "out" and new_job else None)
        if not path or Path(path).exists():
            continue
        top = Path(path).absolute()
        while not top.parent.exists():
            top = top.parent
        found.append((Path(path).absolute(), top))
    return found


def _remove_if_empty(folders: list[tuple[Path, Path]]) -> None:
    """Remove each folder that ``_new_folders`` found missing and is now empty, up to its first missing ancestor."""
    for path, top in folders:
        for folder in (path, *path.parents):
            if not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()
            if folder == top:
                break


def _kept_note(args) -> str:
    """What an interrupted scenarios or mutants job kept, and how to continue it ('' when it kept nothing)."""
    from fidelity.studies.jobdir import KEPT

    folder = getattr(args, "job_dir", None)
    kept = len(list((folder / KEPT).glob("*.json"))) if folder is not None and (folder / KEPT).is_dir() else 0
    if not kept:
        return ""
    runs = "1 finished run" if kept == 1 else f"{kept} finished runs"
    return f"; {runs} kept in {folder}: continue with the same options and --resume {folder}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain ``fidelity``: the commands, not a run
        parser.print_help()
        return 0
    new_folders = _new_folders(args)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"fidelity: error: {err}", file=sys.stderr)
    except user_errors() as err:  # the tuple is evaluated only once a command raised
        print(f"fidelity: error: {err}", file=sys.stderr)
    except OSError as err:  # a place that could not be read or written
        where = f"{err.filename}: " if err.filename else ""
        print(f"fidelity: error: {where}{err.strerror or err}", file=sys.stderr)
    except KeyboardInterrupt:  # the temporary folders of what was being written are gone already
        print(f"fidelity: interrupted{_kept_note(args)}", file=sys.stderr)
        return 130
    _remove_if_empty(new_folders)  # a refused command leaves no empty output folder behind
    return 2


if __name__ == "__main__":
    sys.exit(main())
