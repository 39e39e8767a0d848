"""Graph decode records sites (``GraphDecodeSession``'s recorder): every decode step's records equal the eager
session's bit for bit (names, shapes, dtypes, values), on the shipped default checkpoint and the tiny synthetic
one, exact and quantized profiles, flat and paged caches, with the key capacity past the visible keys; and the
production decoder's graph option in a real ``fidelity run`` (manifest fields, ``--no-graphs``, the fallback of an
injected fault a graph step cannot run, the errors of options that do not apply). The CUDA-graph replay of the same
records is tested on the GPU (``tests/gpu/test_graph_run_cuda.py``)."""

from __future__ import annotations

import json

import pytest
import torch

import fidelity
from fidelity import cli
from fidelity.api import InputError
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.faults import inject
from fidelity.decoders.production.graph_decode import GraphDecodeSession
from fidelity.model.config import ModelConfig
from fidelity.model.load import load_checkpoint
from fidelity.model.sites import Recorder
from fidelity.model.synthesize import synthesize
from fidelity.outputs.rundir import read_run

PROMPT, TOTAL = 120, 134  # decode crosses the window wrap (t = 127), block ends of ratios 4 and 128, 32 visible keys
SPARE = 64  # max_context past the run: the graph step scores 16 more key slots than are visible, masked
CASES = [("tiny", "reference"), ("tiny", "fp8-kv-storage"), ("tiny", "paged-kv:kv_storage=fp8,indexer_storage=packed"),
         ("default", "reference"), ("default", "fp4-indexer-packed"), ("default", "paged-kv")]


@pytest.fixture(scope="module")
def checkpoints():
    return {"tiny": synthesize(ModelConfig.preset("tiny"), seed=0),
            "default": load_checkpoint(fidelity.default_checkpoint())}


def decode_records(session, ids: torch.Tensor, prompt: int = PROMPT) -> Recorder:
    """``session``'s recorder after a prefill of ``ids[:prompt]`` and one decode step per further id."""
    session.prefill(ids[:prompt])
    for t in ids[prompt:]:
        session.step(int(t))
    return session.rec


def record_differences(a: Recorder, b: Recorder) -> list[str]:
    """Where two recorders differ: a site in one only, a different number of records, or a record whose step,
    shape, dtype or bits differ ('site@step')."""
    out = sorted(set(a.records) ^ set(b.records))
    for site in sorted(set(a.records) & set(b.records)):
        ra, rb = a.records[site], b.records[site]
        if len(ra) != len(rb):
            out.append(f"{site}: {len(ra)} vs {len(rb)} records")
        out += [f"{site}@{sa}" for (sa, ta), (sb, tb) in zip(ra, rb, strict=False)
                if sa != sb or ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta, tb)]
    return out


def _ids(vocab: int, n: int = TOTAL) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("which", "profile"), CASES)
def test_graph_decode_records_the_eager_sites_bit_for_bit(checkpoints, which, profile):
    ckpt = checkpoints[which]
    ids = _ids(ckpt.config.vocab_size)
    eager = ProductionModel(ckpt, profile, max_context=TOTAL + SPARE).session(Recorder())
    graph = GraphDecodeSession(ProductionModel(ckpt, profile, max_context=TOTAL + SPARE), False, Recorder())
    a, b = decode_records(eager, ids), decode_records(graph, ids)
    assert record_differences(a, b) == []
    steps = {s for records in b.records.values() for s, _ in records}
    assert steps == set(range(TOTAL - PROMPT + 1))  # the prefill (0) and every decode step recorded
    csa = next(i for i, r in enumerate(ckpt.config.compress_ratios) if r == 4)
    widths = {t.shape[1] for _, t in b.records[f"L{csa}.indexer.scores"][1:]}
    entries = [t.shape[0] for _, t in b.records[f"L{csa}.attn.compressed_kv"][1:]]
    assert widths == {30, 31, 32, 33} and entries.count(1) == 3 and entries.count(0) == 11  # cut and kept on the host


def test_a_captured_recorder_sees_only_the_sites_it_wants(checkpoints):
    """A recorder's patterns decide what a step records (the graph session clones only those under capture)."""
    ckpt = checkpoints["tiny"]
    ids = _ids(ckpt.config.vocab_size, PROMPT + 4)
    rec = Recorder([r"L2\.indexer\.(scores|topk)", "logits"])
    b = decode_records(GraphDecodeSession(ProductionModel(ckpt, max_context=PROMPT + 4), False, rec), ids)
    assert set(b.records) == {"L2.indexer.scores", "L2.indexer.topk", "logits"}
    assert [s for s, _ in b.records["logits"]] == [0, 1, 2, 3, 4]


def _manifest(run_dir) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


RUN = {"prompt": 40, "decode_steps": 6, "modes": ("op",)}


def test_a_run_with_graphs_on_the_cpu_runs_the_graph_step_and_reports_every_site(tmp_path):
    """``graphs=True`` on the CPU: the fixed-shape step uncaptured; the manifest says so, the report's metric rows
    cover the same sites at the same steps as the eager run's, with the same values."""
    on = fidelity.run(out=tmp_path, run_id="on", graphs=True, **RUN)
    off = fidelity.run(out=tmp_path, run_id="off", **RUN)
    m = _manifest(on.run_dir)
    assert m["decode_graphs"] is True and m["decode_graph_captured"] is False and m["decode_graphs_off"] is None
    assert m["decode_graph_replays"] == 0 and m["decode_sites"] == {"graph outputs": 0, "eager": 6}
    assert _manifest(off.run_dir)["decode_graphs"] is False
    assert "CUDA graphs need a CUDA device" in _manifest(off.run_dir)["decode_graphs_off"]
    assert "| decode | graph step, uncaptured |" in (on.run_dir / "report.md").read_text()
    assert "| decode | eager (off by default on the CPU" in (off.run_dir / "report.md").read_text()
    df_on, df_off = (df[df["site"] != "memory"].reset_index(drop=True) for df in (read_run(r.run_dir)[0]
                                                                                 for r in (on, off)))
    cols = ["site", "layer", "metric", "step", "position"]
    decode_sites = set(df_on.loc[df_on["phase"] == "decode", "site"])
    assert {"L2.indexer.scores", "L2.indexer.topk", "L2.indexer.keys", "L3.attn.compressed_kv"} <= decode_sites
    assert df_on[cols].equals(df_off[cols]) and df_on["value"].equals(df_off["value"])


def test_no_graphs_is_recorded_and_a_fault_a_graph_step_cannot_run_falls_back(tmp_path, capsys):
    assert cli.main(["run", "--prompt-len", "40", "--decode", "2", "--mode", "op", "--no-graphs", "--out",
                     str(tmp_path), "--run-id", "no"]) == 0
    m = _manifest(tmp_path / "no")
    assert m["decode_graphs"] is False and m["decode_graphs_off"] == "off (graphs=False, --no-graphs)"
    with inject("decode-buffer-kept"):
        res = fidelity.run(out=tmp_path, run_id="fault", graphs=True, **RUN)
    m = res.manifest
    assert m["decode_graphs"] is False and m["decode_sites"] == {"graph outputs": 0, "eager": 6}
    assert m["decode_graphs_off"].startswith("fault decode-buffer-kept injected")


def test_a_fault_injected_mid_run_switches_sequence_0_to_eager_over_the_same_caches(checkpoints):
    """The fallback keeps the state: the steps after it equal an eager session's under the same fault."""
    ckpt = checkpoints["tiny"]
    ids = _ids(ckpt.config.vocab_size, PROMPT + 6)
    dec = ProductionDecoder(ckpt, max_context=PROMPT + 6, graphs=True)
    eager = ProductionModel(ckpt, max_context=PROMPT + 6).session()
    outs = {"dec": [dec.prefill(ids[:PROMPT])[-1]], "eager": [eager.prefill(ids[:PROMPT])[-1]]}
    for k, t in enumerate(ids[PROMPT:]):
        with inject(*(["cache-concat-growth"] if k >= 3 else [])):
            outs["dec"].append(dec.step(int(t)))
            outs["eager"].append(eager.step(int(t)))
    assert torch.equal(torch.stack(outs["dec"]), torch.stack(outs["eager"]))
    info = dec.info()
    assert not info["decode_graphs"] and info["decode_graphs_off"].startswith("fault cache-concat-growth")
    assert not isinstance(dec.session, GraphDecodeSession) and dec.session.pos == PROMPT + 6


def test_forward_runs_sequence_0_eagerly_and_says_why(checkpoints):
    from fidelity.decoders.base import Call

    dec = ProductionDecoder(checkpoints["tiny"], max_context=64, graphs=True)
    assert isinstance(dec.session, GraphDecodeSession)
    dec.forward([Call(seq=0, ids=torch.arange(2, 10), start=0)])
    assert not dec.info()["decode_graphs"] and "forward" in dec.info()["decode_graphs_off"]
    dec.reset()
    assert isinstance(dec.session, GraphDecodeSession) and dec.info()["decode_graphs_off"] is None


def test_graph_options_that_do_not_apply_are_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(InputError, match=r"graphs=True: graph decode applies to the production decoder"):
        fidelity.run(decoder="transformers", out=tmp_path, graphs=True, **RUN)
    assert cli.main(["run", "--decoder", "trace:nowhere", "--no-graphs", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--no-graphs: graph decode applies to the production decoder" in err and "trace:nowhere" in err
    assert cli.main(["run", "--scenario", "lengths", "--graphs", "--out", str(tmp_path)]) == 2
    assert "--graphs: applies to a run's decoder, not to --scenario" in capsys.readouterr().err
