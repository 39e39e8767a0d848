"""Fault injection: every catalogued DSv4 port bug is caught by a named probe where it was planted, in the scenario
run it names, and the clean decoder stays silent on every scenario run the mutants use, with the default thresholds
(on two synthetic seeds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fidelity.decoders import faults
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.faults import FAULTS, inject, on
from fidelity.model.config import ModelConfig
from fidelity.model.default import prompt_for
from fidelity.model.synthesize import synthesize
from fidelity.outputs.mutants_report import write_matrix
from fidelity.studies.detection import gate_failures, matrix_table
from fidelity.studies.mutant_runs import MutantSettings, run_mutants, run_spec
from fidelity.studies.mutants import BY_NAME, CATALOGUE, Played, check_catalogue, scenario_run

EXPECTED_PROBE = {
    "indexer-key-width": "similarity", "indexer-key-stride": "similarity", "causal-off-by-one": "visible",
    "window-127": "visible", "window-no-self": "visible", "no-inverse-rope": "similarity",
    "sink-value-row": "similarity", "sink-dropped": "similarity", "sinkhorn-3-iters": "sinkhorn",
    "comb-transposed": "sinkhorn",
    "hadamard-q-only": "similarity", "fp4-scale-floor": "similarity", "compressed-rope-last": "similarity",
    "yarn-on-swa": "similarity", "shared-clamp-missing": "similarity", "routing-bias-in-weights": "routing",
    "rep-penalty-no-prompt": "sampler", "rep-window-no-prompt": "sampler", "stop-missing-eot": "stops",
    "cache-concat-growth": "memory",
    "decode-buffer-kept": "memory",
    "topk-cap-half": "indexer",
    "paged-flat-addressing": "similarity", "indexer-keys-planar": "similarity",
    "indexer-chunk-local": "indexer", "index-topk-hardcoded": "indexer", "compressor-no-used-length": "similarity",
    "ue8m0-round-after": "similarity", "tid2eid-bf16": "routing",
    "rollback-partial-carry": "similarity", "fork-stale-ring": "similarity", "fork-drops-carry": "similarity",
    "batch-key-range": "indexer",
}  # fmt: skip
LONG = 64  # decode steps past which a scenario run is left to the slow tests (~0.15 s a step in layer + op mode)
CUT = 4  # the decode steps the long runs are cut to in the quick check of their mutants


def _long(where: tuple[str, str]) -> bool:
    return scenario_run(*where).decode_steps > LONG


QUICK = [m.name for m in CATALOGUE if not _long(m.where)]
SLOW = [m.name for m in CATALOGUE if _long(m.where)]


def _runs(names: list[str]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(BY_NAME[n].where for n in names))


def _profile(name: str) -> str:
    return BY_NAME[name].options.get("profile", "reference")


def _clean_runs(names: list[str]) -> list[tuple[str, str, str]]:
    """The clean decoder's runs for these mutants, in the gate's order: (scenario, run, profile) of each one's run
    and of the runs where it must stay silent, with its profile."""
    return list(dict.fromkeys((*w, _profile(n)) for n in names for w in (BY_NAME[n].where, *BY_NAME[n].silent_in)))


def _param(value, where: tuple[str, str], name: str = ""):
    marks = [pytest.mark.slow] if _long(where) else []
    return pytest.param(value, marks=marks, id=f"{name}{'@' if name else ''}{where[0]}/{where[1]}")


def _first(matrix, name: str, where: tuple[str, str], probe: str = "first", profile: str = "reference"):
    rows = matrix[(matrix["mutant"] == name) & (matrix["scenario"] == where[0]) & (matrix["run"] == where[1])
                  & (matrix["probe"] == probe) & (matrix["profile"].fillna("reference") == profile)]
    assert len(rows) == 1, f"{name} on {where}: expected one {probe!r} row, found {len(rows)}"
    return rows.iloc[0]


@pytest.fixture(scope="class")
def ckpt(request):
    return synthesize(ModelConfig.preset("tiny"), seed=request.cls.seed)


@pytest.fixture(scope="class")
def matrix(request, ckpt):
    """The detection matrix of the class's seed over the mutants on moderate runs (one class per seed: xdist's
    loadscope runs them in parallel)."""
    return run_mutants(ckpt, QUICK, MutantSettings(seed=request.cls.seed))


@pytest.fixture(scope="class")
def long_matrix(request, ckpt):
    """The detection matrix over the mutants on runs of more than LONG decode steps (the slow tests)."""
    return run_mutants(ckpt, SLOW, MutantSettings(seed=request.cls.seed))


def _matrix_of(request, where: tuple[str, str]):
    return request.getfixturevalue("long_matrix" if _long(where) else "matrix")


def test_catalogue_covers_every_fault_once():
    assert sorted(m.name for m in CATALOGUE) == sorted(FAULTS)
    assert len(CATALOGUE) >= 17


def test_the_switchboard_describes_every_mutant_as_the_production_catalogue_does():
    """The studies read what a fault breaks from the switchboard, where the production decoder registered its
    catalogue; a name no decoder registered cannot be injected."""
    assert {m.name: m.description for m in CATALOGUE} == FAULTS
    assert FAULTS.items() <= faults.catalogue().items()
    with pytest.raises(KeyError, match=r"fault\(s\) \['window-129'\]: expected names from \["):
        with faults.inject("window-129"):
            pass


def test_every_mutant_names_a_run_of_its_scenario():
    assert check_catalogue() == []
    for m in CATALOGUE:
        assert scenario_run(*m.where) is not None and all(scenario_run(*w) for w in m.silent_in), m.name
    assert isinstance(scenario_run("verify", "verified / seq 0"), Played)  # a played sequence of a script
    base = BY_NAME["window-127"]
    bad = (replace(base, name="a", scenario="nope"), replace(base, name="b", run="prompt 7"),
           replace(base, name="c", scenario="batch", run="batched / seq 9"),
           replace(base, name="d", options={"decode_steps": 3}),
           replace(base, name="e", silent_in=(("chunks", "chunk 1"),)))
    problems = check_catalogue(bad)
    assert len(problems) == 5
    assert problems[0].startswith("a: scenario: expected one of [") and problems[0].endswith("found 'nope'")
    assert problems[1].startswith("b: run: expected a run of 'lengths' (['prompt 125', ") and \
        problems[1].endswith("found 'prompt 7'")
    assert problems[2].startswith("c: run: expected a run of 'batch' (['seq 0: prompt 37', ") and \
        "'batched / seq 4'" in problems[2] and problems[2].endswith("found 'batched / seq 9'")
    assert problems[3].startswith("d: options: expected some of ['eot_at', ") and problems[3].endswith(
        "found ['decode_steps']")
    assert problems[4].startswith("e: run: expected a run of 'chunks'") and problems[4].endswith("'chunk 1'")


def test_a_mutant_runs_its_scenario_runs_prompt_chunks_and_decode_steps():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=1)
    run = scenario_run("chunks", "chunks 5,6,7,63,130,89")
    spec = run_spec(ckpt, MutantSettings(seed=1), run, {})
    assert spec.prompt.tolist() == prompt_for(ckpt, 300, 1).tolist()
    assert spec.chunk_sizes() == [5, 6, 7, 63, 130, 89] and spec.decode_steps == run.decode_steps == 4
    text = run_spec(ckpt, MutantSettings(seed=1, decode_steps=6), scenario_run("lengths", "prompt 128"),
                    {"text_stream": True, "max_context": 999})
    ids = prompt_for(ckpt, 135, 1)
    assert text.prompt.tolist() == ids[:128].tolist() and text.continuation.tolist() == ids[128:135].tolist()
    assert (text.stream, text.decode_steps, text.max_context, text.prefill_chunk) == ("given", 6, 999, None)


def test_faults_are_off_unless_injected():
    assert not any(on(name) for name in FAULTS)
    with inject("window-127"):
        assert on("window-127") and not on("window-no-self")
    assert not on("window-127")
    with pytest.raises(KeyError, match="expected names from"):
        with inject("nope"):
            pass


class GateOnOneSeed:
    seed = 0

    @pytest.mark.parametrize("run", [_param(r, r[:2], "" if r[2] == "reference" else r[2])
                                     for r in _clean_runs([m.name for m in CATALOGUE])])
    def test_clean_decoder_raises_no_alarm_on_each_run_the_mutants_use(self, request, run):
        where, profile = run[:2], run[2]
        clean = _first(_matrix_of(request, where), "clean", where, profile=profile)
        assert not clean["detected"], f"clean alarm on {where}: {clean['site']} {clean['metric']} {clean['value']}"

    @pytest.mark.parametrize("name", [_param(m.name, m.where, m.name) for m in CATALOGUE])
    def test_mutant_is_detected_where_it_was_planted_in_its_run(self, request, name):
        where = BY_NAME[name].where
        first = _first(_matrix_of(request, where), name, where, profile=_profile(name))
        if first["expect"] == "cannot show":  # listed, not run (tests/test_port_bug_mutants.py shows it caught)
            pytest.skip(f"{name}: {first['note']}")
        assert first["detected"], f"{name} went undetected on {where}"
        assert first["located"], f"{name}: first detected at {first['site']} on {where}, expected {first['expected']}"
        probe = _first(_matrix_of(request, where), name, where, EXPECTED_PROBE[name], _profile(name))
        assert probe["detected"], f"{name}: probe {EXPECTED_PROBE[name]} stayed silent on {where}"

    def test_the_clean_decoder_runs_exactly_the_runs_of_the_mutants(self, matrix):
        first = matrix[matrix["probe"] == "first"]
        clean = first[first["mutant"] == "clean"]
        assert list(zip(clean["scenario"], clean["run"], clean["profile"], strict=True)) == _clean_runs(QUICK)
        for r in first[first["mutant"] != "clean"].itertuples():
            m = BY_NAME[r.mutant]
            assert (r.scenario, r.run) in m.silent_in if r.expect == "silent" else (r.scenario, r.run) == m.where

    def test_long_run_mutants_show_in_their_runs_cut_short(self, ckpt):
        """The quick stand-in for the slow tests: on random weights the shared experts pass the clamp on many
        tokens, so the prefill of its run already shows it."""
        cut = run_mutants(ckpt, SLOW, MutantSettings(seed=self.seed, decode_steps=CUT))
        assert gate_failures(cut) == []
        first = cut[(cut["probe"] == "first") & (cut["mutant"] != "clean")]
        assert set(first["mutant"]) == set(SLOW) and (first["step"] == 0).all()
        where = BY_NAME[SLOW[0]].where
        assert f"{where[0]} / {where[1]} ({CUT} decode steps)" in set(matrix_table(cut)["scenario run"])

    def test_gate_passes_and_matrix_is_written(self, matrix, tmp_path):
        assert gate_failures(matrix) == []
        out = write_matrix(matrix, matrix_table(matrix), gate_failures(matrix), tmp_path, "m")
        assert {p.name for p in out.iterdir()} == {"detection.parquet", "detection.md", "detection.html"}
        table = matrix_table(matrix)
        runs = _clean_runs(QUICK)
        assert list(table["mutant"]) == ["clean"] * len(runs) + [n for n in QUICK for _ in (0, *BY_NAME[n].silent_in)]
        assert list(table["scenario run"][: len(runs)]) == [f"{s} / {r}" + ("" if p == "reference" else
                                                                            f" [profile {p}]") for s, r, p in runs]
        md = (out / "detection.md").read_text()
        assert "gate: PASS" in md and "| mutant | scenario run | first detection |" in md
        assert "| window-127 | lengths / prompt 128 | step 0 L0.attn.visible" in md
        page = (out / "detection.html").read_text()
        assert page.index('<section class="pass"><h2>Verdict') < page.index("<table>") and ">nan<" not in page

    def test_gate_reports_an_undetected_mutant_a_misplaced_one_and_a_clean_alarm(self, matrix):
        broken = matrix.copy()
        row = (broken["mutant"] == "window-127") & (broken["probe"] == "first")
        broken.loc[row, "detected"] = False
        row = (broken["mutant"] == "yarn-on-swa") & (broken["probe"] == "first")
        broken.loc[row, "located"] = False
        row = (broken["mutant"] == "clean") & (broken["probe"] == "first") & (broken["scenario"] == "decode-boundaries")
        broken.loc[row, ["detected", "site", "metric", "value", "threshold"]] = [True, "L2.attn.q", "cos", 0.5,
                                                                                 ">= 0.99"]
        failures = gate_failures(broken)
        assert "window-127: not detected on lengths / prompt 128" in failures
        assert any(f.startswith("yarn-on-swa: first detected at") and "on lengths / prompt 128, expected" in f
                   for f in failures)
        assert "clean decoder raised an alarm on decode-boundaries / prompt 250, 10 steps: L2.attn.q cos 0.5 " \
               "(>= 0.99)" in failures


class TestSeed0(GateOnOneSeed):
    seed = 0


class TestSeed1(GateOnOneSeed):
    seed = 1


class RaisesUnderWindow127(ProductionDecoder):
    """The production decoder, except that its prefill (``at`` "prefill") or its first decode step raises while
    ``window-127`` is planted (a kernel fault of the kind a wrong index gives on a GPU)."""

    at = "prefill"

    def prefill(self, ids):
        self._raise_at("prefill")
        return super().prefill(ids)

    def step(self, token: int):
        self._raise_at("decode")
        return super().step(token)

    def _raise_at(self, phase: str) -> None:
        if on("window-127") and phase == self.at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")


class RaisesDecodingUnderWindow127(RaisesUnderWindow127):
    at = "decode"


class RaisesForkingUnderStaleRing(ProductionDecoder):
    """The production decoder, except that a fork raises while ``fork-stale-ring`` is planted."""

    def fork(self, seq: int, parent: int, pos: int) -> None:
        if on("fork-stale-ring"):
            raise ValueError("ring slot 73 of 128 already taken")
        super().fork(seq, parent, pos)


def test_a_decoder_that_raises_under_one_mutant_is_a_row_and_the_matrix_goes_on(tmp_path):
    """A mutant's run whose decoder raises is recorded (the run ends at that call, judged up to it: detected,
    located by no probe, the exception's type and first line kept; a raise while a script plays likewise), the
    gate names it, and the other mutants' runs still happen."""
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    matrix = run_mutants(ckpt, ["window-127", "causal-off-by-one"], MutantSettings(seed=0),
                         decoder=lambda: RaisesUnderWindow127(ckpt, "reference", 4096, "cpu"))
    first = matrix[matrix["probe"] == "first"].set_index("mutant")
    crashed = first.loc["window-127"]
    assert crashed["detected"] and not crashed["located"] and crashed["site"] == "decoder"
    assert crashed["crash"] == "RuntimeError: CUDA error: an illegal memory access was encountered (call 0, prefill)"
    assert first.loc["causal-off-by-one"]["detected"] and first.loc["causal-off-by-one"]["located"]
    assert gate_failures(matrix) == ["window-127: the decoder raised on lengths / prompt 128 (RuntimeError: CUDA "
                                     "error: an illegal memory access was encountered (call 0, prefill)); no probe "
                                     "located it"]
    table = matrix_table(matrix).set_index("mutant")
    assert table.loc["window-127", "first detection"].startswith("the decoder raised: RuntimeError: CUDA error")
    md = (write_matrix(matrix, matrix_table(matrix), gate_failures(matrix), tmp_path, "m") / "detection.md").read_text()
    assert "gate: FAIL: window-127: the decoder raised on lengths / prompt 128" in md
    later = run_mutants(ckpt, ["window-127"], MutantSettings(seed=0),
                        decoder=lambda: RaisesDecodingUnderWindow127(ckpt, "reference", 4096, "cpu"))
    caught = later[(later["probe"] == "first") & (later["mutant"] == "window-127")].iloc[0]
    assert caught["located"] and caught["crash"].endswith("(call 1, decode)")  # located in the prefill first
    assert gate_failures(later) == []
    assert "; then the decoder raised: RuntimeError" in matrix_table(later).set_index("mutant").loc[
        "window-127", "first detection"]
    played = run_mutants(ckpt, ["fork-stale-ring"], MutantSettings(seed=0),
                         decoder=lambda: RaisesForkingUnderStaleRing(ckpt, "reference", 4096, "cpu"))
    row = played[(played["probe"] == "first") & (played["mutant"] == "fork-stale-ring")
                 & (played["expect"] == "caught")].iloc[0]
    assert row["detected"] and not row["located"] and row["crash"] == "ValueError: ring slot 73 of 128 already taken"
