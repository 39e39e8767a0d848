"""Graph decode in CUDA runs (skipped without CUDA): a captured step's sites, recorded from the graph's outputs after
each replay, equal the eager session's bit for bit; ``fidelity run --device cuda`` decodes in CUDA graphs by default,
says so in its manifest, and records what a ``--no-graphs`` run records, bit for bit."""

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import fidelity  # noqa: E402
from fidelity.decoders.production import ProductionModel  # noqa: E402
from fidelity.decoders.production.faults import inject  # noqa: E402
from fidelity.decoders.production.graph_decode import GraphDecodeSession  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.load import load_checkpoint  # noqa: E402
from fidelity.model.sites import Recorder  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402
from tests.test_graph_decode_sites import CASES, PROMPT, SPARE, TOTAL, decode_records, record_differences  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints():
    return {"tiny": synthesize(ModelConfig.preset("tiny"), seed=0),
            "default": load_checkpoint(fidelity.default_checkpoint())}


def _ids(vocab: int, n: int = TOTAL) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("which", "profile"), CASES)
def test_graph_replays_record_the_eager_sites_bit_for_bit(checkpoints, which, profile):
    """The CPU test's cases (tests/test_graph_decode_sites.py) with the step captured: the first decode step runs
    (and records) eagerly before the capture, every later one is a replay recorded from the graph's outputs."""
    ckpt = checkpoints[which]
    ids = _ids(ckpt.config.vocab_size)
    eager = ProductionModel(ckpt, profile, TOTAL + SPARE, "cuda").session(Recorder())
    graph = GraphDecodeSession(ProductionModel(ckpt, profile, TOTAL + SPARE, "cuda"), recorder=Recorder())
    a, b = decode_records(eager, ids), decode_records(graph, ids)
    assert graph.replays == TOTAL - PROMPT - 1 and graph.captures == 1
    assert record_differences(a, b) == []


def test_a_fault_that_moves_the_rows_is_recorded_from_its_own_capture(checkpoints):
    """A slot fault injected mid-run takes the torch path in a new capture; its sites (the visible set with the
    window moved) equal the eager session's under the same schedule."""
    ckpt = checkpoints["tiny"]
    ids = _ids(ckpt.config.vocab_size)
    recs = {}
    for name in ("eager", "graph"):
        model = ProductionModel(ckpt, "reference", TOTAL + SPARE, "cuda")
        s = model.session(Recorder()) if name == "eager" else GraphDecodeSession(model, recorder=Recorder())
        s.prefill(ids[:PROMPT])
        for k, t in enumerate(ids[PROMPT:]):
            with inject(*(["window-127"] if 4 <= k < 10 else [])):
                s.step(int(t))
        recs[name] = s.rec
    assert s.captures == 3
    assert record_differences(recs["eager"], recs["graph"]) == []


def _trace_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    return out


def test_a_cuda_run_decodes_in_graphs_and_records_what_an_eager_run_records(checkpoints, tmp_path):
    steps = 12
    common = {"checkpoint": checkpoints["tiny"], "prompt": 100, "decode_steps": steps, "modes": ("layer", "op"),
              "out": tmp_path, "device": "cuda"}
    on = fidelity.run(run_id="on", trace=tmp_path / "on-trace", **common)
    off = fidelity.run(run_id="off", trace=tmp_path / "off-trace", graphs=False, **common)
    m = on.manifest
    assert m["decode_graphs"] is True and m["decode_graph_captured"] is True and m["decode_graphs_off"] is None
    assert m["decode_graph_replays"] == steps - 1 > 0
    assert m["decode_sites"] == {"graph outputs": steps - 1, "eager": 1}
    assert off.manifest["decode_graphs"] is False and off.manifest["decode_graphs_off"].startswith("off")
    a, b = _trace_tensors(tmp_path / "on-trace"), _trace_tensors(tmp_path / "off-trace")
    assert a.keys() == b.keys() and len(a) > 100
    assert [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])] == []
    assert on.passed == off.passed
