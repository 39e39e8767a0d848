"""The ``fidelity`` command line as a new user meets it: output places checked before any work, errors that name
what is wrong once, one spelling per option, progress without a terminal, thread settings."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from fidelity import cli
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize

SMALL = ["--prompt-len", "40", "--decode", "1", "--mode", "op"]


@pytest.fixture
def no_synthesis(monkeypatch):
    """Fail the test if the checkpoint is synthesized: the error must come before that work."""
    def refuse(*_a, **_k):
        raise AssertionError("synthesized before the error")

    monkeypatch.setattr(sys.modules["fidelity.model.synthesize"], "synthesize", refuse)


def _error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fidelity: error: "), err
    return err[0]


def test_an_existing_run_id_is_refused_before_the_run_naming_the_flag(tmp_path, capsys, no_synthesis):
    (tmp_path / "r1").mkdir()
    line = _error(capsys, ["run", "--out", str(tmp_path), "--run-id", "r1"])
    assert f"{tmp_path / 'r1'}: exists; pass --overwrite to replace it" in line


def test_an_out_that_is_a_file_is_refused_before_the_run(tmp_path, capsys, no_synthesis):
    f = tmp_path / "file"
    f.write_text("x")
    assert f"--out {f}: is a file, expected a folder" in _error(capsys, ["run", "--out", str(f)])
    assert "is a file, expected a folder" in _error(capsys, ["run", "--out", str(f / "below")])


def test_an_out_that_is_not_writable_is_refused_before_the_run(tmp_path, capsys, no_synthesis, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    assert f"{ro} is not writable" in _error(capsys, ["run", "--out", str(ro / "runs")])


def test_synth_and_mutants_check_their_output_first(tmp_path, capsys, no_synthesis):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert f"--out {ckpt}: exists; pass --overwrite to replace it" in _error(capsys, ["synth", "--out", str(ckpt)])
    (tmp_path / "m1").mkdir()
    line = _error(capsys, ["mutants", "--out", str(tmp_path), "--run-id", "m1"])
    assert "exists; pass --overwrite to replace it" in line


def test_an_unknown_profile_is_refused_before_synthesis(tmp_path, capsys, no_synthesis):
    assert "profile: expected one of" in _error(capsys, ["run", "--profile", "fp7", "--out", str(tmp_path)])


def test_a_bad_token_is_named_by_position_and_text(tmp_path, capsys, no_synthesis):
    f = tmp_path / "ids.txt"
    f.write_text("5, 6,\n7 x8 9")
    line = _error(capsys, ["run", "--prompt-file", str(f), "--out", str(tmp_path)])
    assert line.endswith(f"--prompt-file {f}: token 3 is 'x8', expected an integer token id")
    f.write_text("[5, 6, 99999]")
    line = _error(capsys, ["run", "--prompt-file", str(f), "--out", str(tmp_path)])
    assert line.endswith("token 2 is 99999, expected an id in [0, 4096)")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    from fidelity.model.save import save_checkpoint

    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    return {layout: save_checkpoint(ckpt, root / layout, layout=layout) for layout in ("deepseek", "transformers")}


def test_a_truncated_file_is_reported_once_not_tensor_by_tensor(saved, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(saved["deepseek"], broken)
    f = next(broken.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert cli.main(["inspect", str(broken)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and "2 problem(s)" in lines[0]
    assert "model.safetensors: unreadable safetensors file (truncated or corrupt)" in lines[1]
    assert "304 tensors not found ('embed.weight', " in lines[2] and "unreadable file(s) model.safetensors" in lines[2]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_hidden_layers", [6], "num_hidden_layers: expected an integer, found [6]"),
    ("hidden_size", "256", "hidden_size: expected an integer, found '256'"),
    ("rms_norm_eps", "small", "rms_norm_eps: expected a number, found 'small'"),
])
def test_a_config_error_names_the_key_as_written(saved, tmp_path, capsys, key, value, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["transformers"], ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw[key] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert cli.main(["inspect", str(ckpt)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[1] == f"  - config.json: {message}"


def test_run_speaks_one_spelling_and_counts_its_steps(tmp_path, capsys):
    assert cli.main(["run", *SMALL, "--oracle-dtype", "fp64", "--out", str(tmp_path), "--run-id", "a"]) == 0
    out = capsys.readouterr()
    assert "1 decode step (length)" in out.out and "1 decode steps" not in out.out
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["oracle_dtype"] == "fp64" and manifest["threads"] == 1
    # progress without a terminal: one line per phase start and end
    assert "prefill (40 tokens) 0/2 (0.0 s, decoder under test)" in out.err
    assert "decode 1/1 (" in out.err
    assert "oracle_dtype | fp64 |" in (tmp_path / "a" / "report.md").read_text()


def test_oracle_takes_the_same_dtype_option_as_run(capsys):
    assert cli.main(["oracle", "--prompt-len", "30", "--decode", "1", "--oracle-dtype", "fp64"]) == 0
    out = capsys.readouterr().out
    assert "1 greedy decode step, fp64" in out
    assert cli.main(["oracle", "--prompt-len", "30", "--decode", "0", "--dtype", "fp64"]) == 0  # older spelling


def test_threads_auto_takes_one_thread_for_the_tiny_model_and_a_count_is_checked(capsys, tmp_path):
    before = torch.get_num_threads()
    try:
        args = cli.build_parser().parse_args(["run"])
        torch.set_num_threads(2)
        assert cli._threads(args, ModelConfig.preset("tiny")) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert cli._threads(args, ModelConfig.preset("flash")) == 2  # wide models keep torch's default
        args.threads = "3"
        assert cli._threads(args, ModelConfig.preset("tiny")) == 3
    finally:
        torch.set_num_threads(before)
    line = _error(capsys, ["run", "--threads", "0", "--out", str(tmp_path), *SMALL])
    assert "--threads: expected 'auto' or an integer >= 1, found '0'" in line


def test_a_trace_folder_that_exists_is_refused_before_the_run(tmp_path, capsys, no_synthesis):
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "trace.json").write_text("{}")
    line = _error(capsys, ["run", "--write-trace", str(tmp_path / "trace"), "--out", str(tmp_path)])
    assert f"--write-trace {tmp_path / 'trace'}: exists; pass --overwrite to replace it" in line
