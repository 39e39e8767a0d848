"""Decoders the harness did not write: transformers' DeepseekV4ForCausalLM through hooks (all modes, fp32 and bf16),
recorded traces (a round trip equal metric for metric, bad traces refused in one line), and catalogue bugs planted
in transformers' model caught where they were planted."""

from __future__ import annotations

import json
import shutil
import sys

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

import fidelity
from fidelity import cli
from fidelity.decoders import Decoder, ProductionDecoder, TraceDecoder, TransformersDecoder
from fidelity.decoders.trace_file import TraceError, TraceWriter
from fidelity.decoders.transformers import FAULTS, hf_model
from fidelity.model.config import ModelConfig
from fidelity.model.save import save_checkpoint
from fidelity.outputs.rundir import read_run
from fidelity.studies.detection import gate_failures
from fidelity.studies.mutant_runs import MutantSettings, run_mutants
from fidelity.studies.mutants import BY_NAME
from tests.hf_reference import random_hf_model

ALL_ENTRIES = ModelConfig.preset("tiny").replace(index_topk=1024)  # the indexer selects every visible entry
KEYS = ["mode", "step", "phase", "position", "layer", "site", "metric"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random tiny transformers model (every parameter randomised) written with save_pretrained."""
    path = tmp_path_factory.mktemp("hf") / "model"
    random_hf_model(ALL_ENTRIES, seed=3).save_pretrained(path)
    return path


def test_transformers_in_fp32_agrees_with_the_oracle_in_every_mode(hf_dir, tmp_path):
    res = fidelity.run("transformers", hf_dir, prompt=160, decode_steps=3, out=tmp_path, decoder_dtype="fp32")
    assert res.verdict == "PASS", str(res.first_divergence)
    assert res.manifest["modes"] == ["free", "layer", "op"] and res.manifest["modes_skipped"] == {}
    df, _ = read_run(res.run_dir)
    cos = df[(df["metric"] == "cos") & (df["position"] == -1)]
    assert set(cos["mode"]) == {"free", "layer", "op"}
    assert cos.groupby("mode")["site"].nunique().min() > 30
    assert cos["value"].min() >= 0.99999, cos.sort_values("value").head(3).to_string()
    assert res.manifest["profile"] == {"name": "transformers-fp32", "precision": "exact"}


def test_transformers_in_bf16_gets_a_per_layer_table_of_where_error_enters(hf_dir, tmp_path):
    res = fidelity.run("transformers", hf_dir, prompt=160, decode_steps=2, out=tmp_path, decoder_dtype="bf16")
    md = (res.run_dir / "report.md").read_text()
    table = md.split("## Per-layer error: local vs inherited")[1].split("\n## ")[0]
    assert "| site | cos local | cos inherited | calc_diff local | calc_diff inherited |" in table
    assert all(f"| L{i}.attn.out |" in table for i in range(6))
    # the router runs in bf16 (the official gate in fp32): op mode on its own inputs finds the routing weights
    first = res.first_divergence
    assert first is not None and first.site.endswith("moe.weights") and first.mode == "op", str(first)


def test_the_decoders_config_must_match_the_checkpoints(hf_dir, tmp_path):
    other = ALL_ENTRIES.replace(swiglu_limit=7.0)
    decoder = TransformersDecoder(random_hf_model(other, seed=1), other)
    with pytest.raises(fidelity.harness.runner.RunError,
                       match=r"its config differs from the checkpoint's \(swiglu_limit: 7.0 vs 10.0\)"):
        fidelity.run(decoder, hf_dir, prompt=20, decode_steps=0, out=tmp_path)


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """A live bf16 transformers run on its own greedy tokens, recorded as a trace, and the trace replayed."""
    root = tmp_path_factory.mktemp("trace")
    ckpt = fidelity.synthesize(ModelConfig.preset("tiny"), seed=0)
    ckpt.origin["preset"] = "tiny"
    live = fidelity.run("transformers", ckpt, prompt=140, decode_steps=3, out=root, run_id="live",
                        stream="production", trace=root / "trace")
    replay = fidelity.run(f"trace:{root / 'trace'}", out=root, run_id="replay")
    return root, live, replay


def test_a_replayed_trace_gives_the_live_runs_metrics(round_trip):
    root, live, replay = round_trip
    a, b = (read_run(r.run_dir)[0] for r in (live, replay))
    a, b = a[a["site"] != "memory"], b[b["site"] != "memory"]  # process memory differs between two runs
    both = a.merge(b, on=KEYS, how="outer", suffixes=("_live", "_replay"), indicator=True)
    assert set(both["_merge"]) == {"both"} and len(both) > 5000
    same = (both["value_live"] == both["value_replay"]) | (both["value_live"].isna() & both["value_replay"].isna())
    assert same.all(), both[~same].head().to_string()
    assert (live.verdict, str(live.first_divergence)) == (replay.verdict, str(replay.first_divergence))
    assert replay.manifest["decoder"].startswith("trace (transformers DeepseekV4ForCausalLM (bf16))")


def _bad(tmp_path, round_trip, edit) -> str:
    trace = tmp_path / "t"
    shutil.copytree(round_trip[0] / "trace", trace)
    edit(trace)
    with pytest.raises(TraceError) as err:
        fidelity.run(f"trace:{trace}", out=tmp_path, run_id="bad")
    assert not (tmp_path / "bad").exists()
    return str(err.value)


def _json(trace, change) -> None:
    m = json.loads((trace / "trace.json").read_text())
    change(m)
    (trace / "trace.json").write_text(json.dumps(m))


def _tensor(trace, key, change) -> None:
    f = trace / "call-00001.safetensors"
    t = load_file(f)
    t[key] = change(t[key])
    save_file(t, f)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: _json(t, lambda m: m.update(format="other")), "format: expected 'dsv4-fidelity-trace'"),
    (lambda t: _json(t, lambda m: m["events"][1]["rows"][0].__setitem__(1, 141)),
     "events[1] (call-00001.safetensors): sequence 0 starts at 141; it stands at 140"),
    (lambda t: _json(t, lambda m: m["events"].insert(2, {"rollback": [0, 150]})),
     "events[2]: rollback of 0 to 150: position 150 is not in 0..141"),
    (lambda t: _json(t, lambda m: m["events"].insert(1, {"fork": [1, 0, 141]})),
     "events[1]: fork 1 from 0 at 141: position 141 is not in 0..140"),
    (lambda t: _json(t, lambda m: m["checkpoint"].update(hash="0" * 16)), "recorded on a checkpoint with hash 0000"),
    (lambda t: _json(t, lambda m: m["config"].update(rope_theta=5000.0)),
     "its config differs from the checkpoint's (rope_theta: 5000.0 vs 10000.0)"),
    (lambda t: _json(t, lambda m: m["config"].update(dim=384)),
     "L0.attn.in: expected shape [140, 384], found [140, 256]"),
    (lambda t: _tensor(t, "L2.attn.q", lambda x: x[:, :2]), "L2.attn.q: expected shape [1, 4, 128], found [1, 2, "),
    (lambda t: _tensor(t, "L1.attn.out", lambda x: torch.cat((x, x))), "L1.attn.out: expected 1 rows"),
    (lambda t: _tensor(t, "logits", lambda x: x[:, :100]), "logits: expected shape [1, 4096], found [1, 100]"),
    (lambda t: _tensor(t, "positions", lambda x: x + 1), "positions: expected 140..140, found [141]"),
])
def test_a_bad_trace_is_refused_naming_what_differs(tmp_path, round_trip, edit, message):
    try:
        text = _bad(tmp_path, round_trip, edit)
    except fidelity.harness.runner.RunError as err:  # a config mismatch is the runner's check
        text = str(err)
    assert message in text, text


def test_a_bad_trace_ends_the_command_in_one_line(tmp_path, round_trip, capsys):
    trace = tmp_path / "t"
    shutil.copytree(round_trip[0] / "trace", trace)
    _tensor(trace, "positions", lambda x: x + 1)
    assert cli.main(["run", "--decoder", f"trace:{trace}", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fidelity: error: ")
    assert "positions: expected 140..140, found [141]" in err[0]
    assert [p.name for p in tmp_path.iterdir()] == ["t"]  # no run directory


def test_a_plain_decode_loop_writes_a_trace_with_the_writer(tmp_path):
    """The README's loop: logits and the residual streams of a transformers model, no harness decoder; the trace
    replays in free and layer mode, and op mode is skipped, saying which sites it lacks."""
    from transformers import DynamicCache

    ckpt = fidelity.synthesize(ModelConfig.preset("tiny"), seed=0)
    ckpt.origin["preset"] = "tiny"
    model = hf_model(ckpt, torch.bfloat16)
    prompt = torch.arange(10, 150)
    writer = TraceWriter(tmp_path / "trace", ckpt.config, prompt, decoder="my loop", checkpoint={"preset": "tiny"})
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, out: writer("embed", out[0]))]
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: writer(f"L{i}.residual", out[0])))
    cache, ids = DynamicCache(config=model.config), prompt
    with torch.no_grad():
        for _ in range(3):
            logits = model(input_ids=ids[None], cache=cache, use_cache=True).logits[0]
            writer.end_step(ids, logits)
            ids = logits[-1:].argmax(-1)
    writer.finish()
    for h in hooks:
        h.remove()
    res = fidelity.run(f"trace:{tmp_path / 'trace'}", out=tmp_path, run_id="mine")
    assert res.manifest["modes"] == ["free", "layer"]
    assert res.manifest["modes_skipped"]["op"].startswith("the decoder does not report L{i}.attn.in, L{i}.attn.q")
    assert "skipped: the decoder does not report" in (res.run_dir / "report.md").read_text()


def test_bugs_planted_in_transformers_are_caught_where_they_were_planted():
    ckpt = fidelity.synthesize(ModelConfig.preset("tiny"), seed=0)
    assert len(FAULTS) >= 6 and set(FAULTS) <= set(BY_NAME)
    matrix = run_mutants(ckpt, None, MutantSettings(decode_steps=1),
                         decoder=lambda: TransformersDecoder.from_checkpoint(ckpt, "fp32"), known=FAULTS)
    assert gate_failures(matrix) == []
    first = matrix[matrix["probe"] == "first"].set_index("mutant")
    assert not first.loc[["clean"], "detected"].any()
    caught = first[first["expect"] == "caught"]  # the others: silent runs, and models that cannot show a fault
    assert set(first.index) == {"clean", *FAULTS} and caught["located"].all()
    assert pd.Series(caught["step"]).eq(0).all()
    assert first[first["expect"] == "cannot show"].index.tolist() == ["tid2eid-bf16"]  # 8 experts


def test_the_command_line_runs_transformers_records_a_trace_and_replays_it(hf_dir, tmp_path, capsys):
    base = ["--prompt-len", "60", "--decode", "2", "--mode", "layer", "--mode", "op", "--out", str(tmp_path)]
    assert cli.main(["run", "--checkpoint", str(hf_dir), "--decoder", "transformers", "--decoder-dtype", "fp32",
                     "--stream", "production", "--write-trace", str(tmp_path / "trace"), "--run-id", "live",
                     *base]) == 0
    out = capsys.readouterr().out
    assert "transformers DeepseekV4ForCausalLM (fp32) vs oracle on checkpoint" in out and "verdict: PASS" in out
    assert cli.main(["run", "--decoder", f"trace:{tmp_path / 'trace'}", "--run-id", "replay", "--checkpoint",
                     str(hf_dir), "--mode", "layer", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trace (transformers DeepseekV4ForCausalLM (fp32)) vs oracle" in out and "verdict: PASS" in out
    assert "2 decode steps" in out


@pytest.fixture
def no_synthesis(monkeypatch):
    """Fail the test if a checkpoint is synthesized: a refusal must come before that work."""
    def refuse(*_a, **_k):
        raise AssertionError("synthesized before the error")

    monkeypatch.setattr(sys.modules["fidelity.model.synthesize"], "synthesize", refuse)


def _refused_by_the_command(tmp_path, round_trip, capsys, edit) -> str:
    """The command's one error line for the round trip's trace edited by ``edit``; no run directory is left."""
    trace = tmp_path / "t"
    shutil.copytree(round_trip[0] / "trace", trace)
    edit(trace)
    assert cli.main(["run", "--decoder", f"trace:{trace}", "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fidelity: error: "), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    return err[0]


def _drop(trace, site: str, file: bool = True, listed: bool = True) -> None:
    """Remove ``site`` from step 1's file and/or from trace.json's list of its sites."""
    if file:
        f = trace / "call-00001.safetensors"
        t = load_file(f)
        del t[site]
        save_file(t, f)
    if listed:
        _json(trace, lambda m: m["events"][1]["sites"].remove(site))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: _drop(t, "L1.attn.q", listed=False),
     "call-00001.safetensors: L1.attn.q: trace.json lists it for this step, the file does not hold it"),
    (lambda t: _drop(t, "L1.attn.q"),
     "call-00001.safetensors: L1.attn.q: expected (the trace reports every input of op mode, read at every call "
     "in each layer that has it), found none"),
    (lambda t: _drop(t, "L2.indexer.topk"),
     "call-00001.safetensors: L2.indexer.topk: expected (call-00000.safetensors holds it, read at every call), "
     "found none"),
    (lambda t: _drop(t, "L3.moe.out", file=False),
     "call-00001.safetensors: L3.moe.out: the file holds it, trace.json does not list it for this step"),
    (lambda t: _tensor(t, "L0.moe.experts", lambda x: x.float()),
     "call-00001.safetensors: L0.moe.experts: expected an integer dtype, found F32"),
    (lambda t: _tensor(t, "L2.attn.q", lambda x: x.long()),
     "call-00001.safetensors: L2.attn.q: expected a float dtype, found I64"),
    (lambda t: _tensor(t, "logits", lambda x: x.long()), "call-00001.safetensors: logits: expected a float dtype"),
])
def test_a_trace_whose_step_files_miss_a_site_is_refused_in_one_line_before_any_work(
        tmp_path, round_trip, capsys, no_synthesis, edit, message):
    assert message in _refused_by_the_command(tmp_path, round_trip, capsys, edit)


def test_a_traces_relative_checkpoint_path_is_read_from_the_trace_folder(tmp_path, monkeypatch, capsys):
    """The writer records a relative --checkpoint relative to the trace's folder, and a replay from another
    directory reads it from there; a path that holds no checkpoint is named with trace.json."""
    work = tmp_path / "work"
    save_checkpoint(fidelity.synthesize(ModelConfig.preset("tiny"), seed=0), work / "ckpt")
    monkeypatch.chdir(work)
    small = ["--prompt-len", "40", "--decode", "1", "--mode", "op"]
    assert cli.main(["run", "--checkpoint", "ckpt", *small, "--write-trace", "trace", "--out", "runs"]) == 0
    assert json.loads((work / "trace" / "trace.json").read_text())["checkpoint"]["path"] == "../ckpt"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--decoder", "trace:work/trace", "--out", "runs", "--run-id", "replay"]) == 0
    assert json.loads((tmp_path / "runs" / "replay" / "manifest.json").read_text())["verdict"]["passed"]
    capsys.readouterr()
    _json(work / "trace", lambda m: m["checkpoint"].update(path="gone"))
    line = _error_line(capsys, ["run", "--decoder", "trace:work/trace", "--out", "runs"])
    assert "work/trace/trace.json: checkpoint.path 'gone': expected a checkpoint directory at work/trace/gone" in line


def _error_line(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fidelity: error: "), err
    return err[0]


def test_a_trace_without_a_checkpoint_says_it_is_compared_with_the_trained_default(tmp_path, round_trip, capsys):
    trace = tmp_path / "t"
    shutil.copytree(round_trip[0] / "trace", trace)
    _json(trace, lambda m: m.pop("checkpoint"))
    assert cli.main(["run", "--decoder", f"trace:{trace}", "--mode", "free", "--out", str(tmp_path / "runs")]) == 0
    err = capsys.readouterr().err
    note = f"fidelity: note: {trace}/trace.json names no checkpoint: compared with the trained default checkpoint "
    assert note + str(fidelity.default_checkpoint()) in err
    with pytest.warns(UserWarning, match="names no checkpoint: compared with the trained default checkpoint"):
        fidelity.run(f"trace:{trace}", modes=("free",), out=tmp_path / "runs")
    _json(trace, lambda m: m["config"].update(rope_theta=5000.0))
    line = _error_line(capsys, ["run", "--decoder", f"trace:{trace}", "--out", str(tmp_path / "runs")])
    assert ("its config differs from the checkpoint's (rope_theta: 5000.0 vs 10000.0); the checkpoint is the "
            f"trained default checkpoint {fidelity.default_checkpoint()} (trace.json names no checkpoint)") in line


def _without_memory(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["site"] != "memory"].reset_index(drop=True)  # process memory differs between two runs


def _twice(decoder, checkpoint, out, **kwargs) -> None:
    """Two runs of one decoder object give the same metrics: the second starts at position 0."""
    runs = [fidelity.run(decoder, checkpoint, out=out, run_id=f"run{n}", **kwargs) for n in range(2)]
    a, b = (_without_memory(read_run(r.run_dir)[0]).drop(columns="run_id") for r in runs)
    pd.testing.assert_frame_equal(a, b)


def test_a_decoder_object_runs_twice_from_position_zero(hf_dir, round_trip, tmp_path):
    small = {"prompt": 40, "decode_steps": 1, "modes": ("op",)}
    _twice(TransformersDecoder.from_pretrained(hf_dir, "fp32"), hf_dir, tmp_path / "hf", **small)
    ckpt = fidelity.synthesize(ModelConfig.preset("tiny"), seed=0)
    production = ProductionDecoder(ckpt, max_context=41)
    _twice(production, ckpt, tmp_path / "production", **small)
    assert production.pos == 41
    _twice(TraceDecoder(round_trip[0] / "trace"), None, tmp_path / "trace", modes=("free",))


def test_a_decoder_that_cannot_reset_is_refused_once_used(tmp_path):
    from fidelity.decoders.base import DecoderError

    class Used(Decoder):
        label, config, profile, pos = "my engine", ModelConfig.preset("tiny"), {"name": "mine"}, 5

        def prefill(self, ids):
            raise AssertionError("a used decoder ran")

        step = prefill

        def sites(self):
            return frozenset({"logits"})

    with pytest.raises(DecoderError) as err:
        fidelity.run(Used(), fidelity.synthesize(ModelConfig.preset("tiny")), prompt=20, decode_steps=0,
                     out=tmp_path)
    assert str(err.value) == ("my engine: has consumed 5 tokens and cannot start a new run: it does not implement "
                              "Decoder.reset; pass a new decoder to each run")
    assert list(tmp_path.iterdir()) == []
