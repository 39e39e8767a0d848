"""``fidelity fuzz`` (docs/fuzz.md): call scripts drawn by Hypothesis (``fidelity.studies.fuzz``) judged against the
decoder itself and, for failing scripts and a sampled share of the others, against the oracle
(``fidelity.studies.fuzz_judge``), until one fails or the budget is spent; a failing script is shrunk
(``fidelity.studies.shrink``) to the smallest that fails the same check and written as a scenario file, with a
report, in one directory written atomically.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed

from fidelity.api import CheckpointPlan, InputError, open_decoder
from fidelity.atomic_write import write_dir_atomic
from fidelity.decoders.base import Decoder
from fidelity.decoders.faults import inject
from fidelity.outputs.fuzz_report import write_report
from fidelity.outputs.rundir import check_output, new_run_id
from fidelity.studies import scenario_file
from fidelity.studies.catalogue import Script, describe
from fidelity.studies.fuzz import Space, scripts
from fidelity.studies.fuzz_judge import Verdict, judge
from fidelity.studies.shrink import shrink, size

MIN_BUDGET_S = 10.0  # below this not one script and its pairs can run on the default checkpoint (2-core CPU)


@dataclass
class Found:
    """A failing script, as found and as shrunk, with their verdicts."""

    original: Script
    verdict: Verdict
    shrunk: Script
    shrunk_verdict: Verdict
    seconds_to_failure: float
    shrink_tried: int
    shrink_seconds: float


@dataclass
class FuzzResult:
    """``tried``: a row per script judged (index, sequences, ops, tokens, oracle, check, seconds); ``found``: the
    failure, None when every script passed; ``left_out``: {what: why} the space did not draw."""

    out_dir: Path
    seed: int
    budget_s: float
    seconds: float
    tried: pd.DataFrame
    left_out: dict[str, str]
    found: Found | None = None
    refused: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.found is None


class _Stop(Exception):
    """Ends Hypothesis' search: the budget is spent or a script failed."""


def search(space: Space, seed: int, budget_s: float, judge_one: Callable[[Script, bool], Verdict],
           oracle_rate: float, tell: Callable[[str], None]) -> tuple[list[dict], Script | None, Verdict | None,
                                                                       float, int]:
    """Scripts drawn from ``space`` (Hypothesis, seeded by ``seed``) judged one by one until one fails or
    ``budget_s`` is spent: (rows tried, the failing script and its verdict or None, seconds to the failure,
    scripts refused)."""
    rows: list[dict] = []
    box: dict = {"refused": 0}
    coin = random.Random(seed)
    t0 = time.perf_counter()
    judged: dict[tuple, Verdict] = {}

    @settings(database=None, deadline=None, max_examples=10**9, phases=(Phase.generate,), derandomize=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @hyp_seed(seed)
    @given(scripts(space))
    def probe(script: Script) -> None:
        if box.get("stop") or time.perf_counter() - t0 >= budget_s:  # also Hypothesis' replay of the last example
            box["stop"] = True
            raise _Stop
        key = (script.streams, script.ops)
        if key in judged:  # drawn before: judged once
            return
        oracle = coin.random() < oracle_rate
        t = time.perf_counter()
        v = judge_one(script, oracle)
        judged[key] = v
        ops, tokens = size(script)
        rows.append({"script": len(rows) + 1, "sequences": len(script.streams), "ops": ops, "tokens": tokens,
                     "oracle": bool(v.oracle), "check": v.check or ("refused" if v.refused else "pass"),
                     "note": v.note,
                     "seconds": time.perf_counter() - t})
        left = max(0.0, budget_s - (time.perf_counter() - t0))
        tell(f"script {len(rows)}: {len(script.streams)} seq, {ops} ops, {tokens} tokens: "
             f"{rows[-1]['check']}{' (oracle)' if v.oracle else ''} ({rows[-1]['seconds']:.1f} s; {left:.0f} s left)")
        if v.refused:
            box["refused"] += 1
        if v.failed:
            box.update(script=script, verdict=v, at=time.perf_counter() - t0, stop=True)
            raise _Stop

    try:
        probe()
    except _Stop:
        pass
    return rows, box.get("script"), box.get("verdict"), box.get("at", 0.0), box["refused"]


def parse_budget(text: str, option: str = "--budget") -> float:
    """Seconds of a budget written as ``90``, ``90s``, ``10m`` or ``1h``; InputError naming ``option`` otherwise or
    below ``MIN_BUDGET_S``."""
    units = {"s": 1, "m": 60, "h": 3600}
    body, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        seconds = float(body) * unit
    except ValueError:
        raise InputError(f"{option}: expected seconds or a duration like 90s, 10m, 1h, found {text!r}") from None
    if not seconds >= MIN_BUDGET_S:
        raise InputError(f"{option}: expected at least {MIN_BUDGET_S:.0f}s (one script and its pairs take several "
                         f"seconds), found {text!r}")
    return seconds


def parse_seed(text: str, option: str = "--seed") -> int:
    """An integer seed, or InputError naming ``option``."""
    try:
        return int(text)
    except (TypeError, ValueError):
        raise InputError(f"{option}: expected an integer, found {text!r}") from None


def run_fuzz(plan: CheckpointPlan, decoder: Decoder | str = "production", out: str | Path = "runs",
             run_id: str | None = None, *, seed: int = 0, budget_s: float = 600.0, context: int = 1024,
             oracle_rate: float = 0.1, modes: Sequence[str] = ("free", "layer"), shrink_s: float | None = None,
             profile: str = "reference", decoder_dtype: str = "bf16", device: str = "cpu", overwrite: bool = False,
             progress: Callable[[str], None] | None = None, faults: Sequence[str] = (),
             space: Space | None = None) -> FuzzResult:
    """Search ``decoder``'s call patterns for ``budget_s`` seconds (or until a script fails) and write
    ``out/<run_id>/`` atomically: report.md, scripts.csv and, when a script failed, original.json and the shrunk
    script as scenario.json (``shrink_s``: the shrinking's own budget, default half ``budget_s``)."""
    if budget_s < MIN_BUDGET_S:
        raise InputError(f"--budget: expected at least {MIN_BUDGET_S:.0f}s, found {budget_s:g}s")
    if not 0 <= oracle_rate <= 1:
        raise InputError(f"--oracle-rate: expected a share in 0..1, found {oracle_rate}")
    target = check_output(out, run_id or f"fuzz-{new_run_id()}", overwrite)
    ckpt = plan.open()
    tell = progress or (lambda line: None)

    def fresh(n: int) -> Decoder:
        return open_decoder(decoder, ckpt, profile, max(n, context), device, decoder_dtype)

    space = space or Space.of(fresh(context), context)
    ids = plan.prompt(space.longest)
    if space.left_out:
        tell("not drawn: " + "; ".join(f"{k}: {why}" for k, why in space.left_out.items()))

    def judge_one(script: Script, oracle: bool) -> Verdict:
        return judge(script, ids, fresh, plan, oracle, modes, device)

    def fill(tmp: Path) -> FuzzResult:
        t0 = time.perf_counter()
        rows, bad, verdict, at, refused = search(space, seed, budget_s, judge_one, oracle_rate, tell)
        res = FuzzResult(target, seed, budget_s, 0.0, pd.DataFrame(rows), dict(space.left_out), refused=refused)
        if bad is not None:
            tell(f"script {len(rows)} fails {verdict.check} after {at:.0f} s: shrinking")
            oracle = verdict.check.startswith("oracle")
            t = time.perf_counter()
            small, tried = shrink(bad, lambda s: judge_one(s, oracle).check == verdict.check,
                                  budget_s / 2 if shrink_s is None else shrink_s, tell)
            spent = time.perf_counter() - t
            small_v = judge_one(small, True)
            if small_v.check != verdict.check:  # judged once more with the oracle: keep what failed the same way
                small, small_v = bad, judge_one(bad, True)
            res.found = Found(bad, verdict, small, small_v, at, tried, spent)
            found = {"check": verdict.check, "detail": small_v.detail, "seed": seed}
            scenario_file.write(tmp / "scenario.json", small, f"fuzz-seed-{seed}",
                                f"shrunk from script {len(rows)} of fidelity fuzz --seed {seed}", found)
            scenario_file.write(tmp / "original.json", bad, f"fuzz-seed-{seed}-original",
                                f"script {len(rows)} of fidelity fuzz --seed {seed}, as drawn", found)
        res.seconds = time.perf_counter() - t0
        res.tried.to_csv(tmp / "scripts.csv", index=False)
        got = res.found
        shown = {} if got is None else {k: (describe(s), size(s)) for k, s in
                                        (("original", got.original), ("shrunk", got.shrunk))}
        write_report(tmp, res, plan.what, decoder.label if isinstance(decoder, Decoder) else decoder, shown)
        return res

    box: list[FuzzResult] = []
    with inject(*faults):
        write_dir_atomic(target, lambda tmp: box.append(fill(tmp)), overwrite)
    return box[0]
