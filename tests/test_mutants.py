"""Fault injection: every catalogued DSv4 port bug is caught by a named probe where it was planted, and the
clean decoder stays silent with the default thresholds (on two synthetic seeds)."""

from __future__ import annotations

import pytest

from fidelity.decoders.production.faults import FAULTS, inject, on
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.mutants import CATALOGUE, MutantSettings, gate_failures, matrix_table, run_mutants, write_matrix

EXPECTED_PROBE = {
    "indexer-key-width": "similarity", "causal-off-by-one": "visible", "window-127": "visible",
    "window-no-self": "visible", "no-inverse-rope": "similarity", "sink-value-row": "similarity",
    "sink-dropped": "similarity", "sinkhorn-3-iters": "sinkhorn", "comb-transposed": "sinkhorn",
    "hadamard-q-only": "similarity", "fp4-scale-floor": "similarity", "compressed-rope-last": "similarity",
    "yarn-on-swa": "similarity", "shared-clamp-missing": "similarity", "routing-bias-in-weights": "routing",
    "rep-penalty-no-prompt": "sampler", "stop-missing-eot": "stops", "cache-concat-growth": "memory",
    "decode-buffer-kept": "memory",
    "topk-cap-half": "indexer",
}  # fmt: skip


@pytest.fixture(scope="class")
def matrix(request):
    """The detection matrix of the class's seed (one class per seed: xdist's loadscope runs them in parallel)."""
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=request.cls.seed)
    return run_mutants(ckpt, None, MutantSettings(seed=request.cls.seed))


def test_catalogue_covers_every_fault_once():
    assert sorted(m.name for m in CATALOGUE) == sorted(FAULTS)
    assert len(CATALOGUE) >= 17


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

    def test_clean_decoder_raises_no_alarm(self, matrix):
        clean = matrix[(matrix["mutant"] == "clean") & (matrix["probe"] == "first")].iloc[0]
        assert not clean["detected"], f"clean alarm: {clean['site']} {clean['metric']} {clean['value']}"

    @pytest.mark.parametrize("name", [m.name for m in CATALOGUE])
    def test_mutant_is_detected_where_it_was_planted(self, matrix, name):
        first = matrix[(matrix["mutant"] == name) & (matrix["probe"] == "first")].iloc[0]
        assert first["detected"], f"{name} went undetected"
        assert first["located"], f"{name}: first detected at {first['site']}, expected {first['expected']}"
        probe = matrix[(matrix["mutant"] == name) & (matrix["probe"] == EXPECTED_PROBE[name])].iloc[0]
        assert probe["detected"], f"{name}: probe {EXPECTED_PROBE[name]} stayed silent"

    def test_gate_passes_and_matrix_is_written(self, matrix, tmp_path):
        assert gate_failures(matrix) == []
        out = write_matrix(matrix, tmp_path, "m")
        assert {p.name for p in out.iterdir()} == {"detection.parquet", "detection.md", "detection.html"}
        table = matrix_table(matrix)
        assert list(table["mutant"])[0] == "clean" and len(table) == len(CATALOGUE) + 1
        assert "gate: PASS" in (out / "detection.md").read_text()

    def test_gate_reports_an_undetected_mutant_and_a_misplaced_one(self, matrix):
        broken = matrix.copy()
        row = (broken["mutant"] == "window-127") & (broken["probe"] == "first")
        broken.loc[row, "detected"] = False
        row = (broken["mutant"] == "yarn-on-swa") & (broken["probe"] == "first")
        broken.loc[row, "located"] = False
        failures = gate_failures(broken)
        assert any("window-127: not detected" in f for f in failures)
        assert any(f.startswith("yarn-on-swa: first detected at") for f in failures)


class TestSeed0(GateOnOneSeed):
    seed = 0


class TestSeed1(GateOnOneSeed):
    seed = 1
