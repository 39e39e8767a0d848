"""The ``fidelity`` command line as a new user meets it: output places checked before any work, errors that name
what is wrong once, one spelling per option, progress without a terminal, thread settings."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import torch

from fidelity import cli
from fidelity.harness.runner import Runner
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize

SMALL = ["--prompt-len", "40", "--decode", "1", "--mode", "op"]


@pytest.fixture
def no_synthesis(monkeypatch):
    """Fail the test if the checkpoint is synthesized: the error must come before that work."""
    def refuse(*_a, **_k):
        raise AssertionError("synthesized before the error")

    monkeypatch.setattr(sys.modules["fidelity.model.synthesize"], "synthesize", refuse)


def _error(capsys, argv: list[str], code: int = 2) -> str:
    """The one line a failed command writes on stderr besides its progress lines."""
    assert cli.main(argv) == code
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith(("prefill ", "decode "))]
    assert len(err) == 1 and err[0].startswith("fidelity: "), err
    return err[0]


def test_an_existing_run_id_is_refused_before_the_run_naming_the_flag(tmp_path, capsys, no_synthesis):
    (tmp_path / "r1").mkdir()
    line = _error(capsys, ["run", "--out", str(tmp_path), "--run-id", "r1"])
    assert f"{tmp_path / 'r1'}: exists; pass --overwrite to replace it" in line


def test_an_out_that_is_a_file_is_refused_before_the_run(tmp_path, capsys, no_synthesis):
    f = tmp_path / "file"
    f.write_text("x")
    assert f"--out {f}: is a file, expected a folder" in _error(capsys, ["run", "--out", str(f)])
    line = _error(capsys, ["run", "--out", str(f / "below")])
    assert line == f"fidelity: error: --out {f / 'below'}: {f} is a file, expected a folder"


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, permission bits allow writing anywhere")
@pytest.mark.parametrize("out", ["/proc/fidelity-runs", "/sys/fidelity-runs"])
def test_an_out_that_root_cannot_create_is_refused_before_the_run(out, capsys, no_synthesis):
    line = _error(capsys, ["run", *SMALL, "--out", out])
    assert line.startswith(f"fidelity: error: --out {out}: cannot create {out}: "), line


def test_a_failed_write_ends_in_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    def full(self, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    line = _error(capsys, ["run", *SMALL, "--out", str(tmp_path), "--run-id", "r"])
    assert line == f"fidelity: error: {tmp_path / 'r'}: cannot write metrics.parquet: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_ends_in_one_line_with_exit_130_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """Interrupted at the first decode step, after the prefill was recorded into the trace's temporary folder."""
    step = Runner.step

    def interrupted(self, call, ids):
        if call == 1:
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".trace.partial-")]
            raise KeyboardInterrupt
        return step(self, call, ids)

    monkeypatch.setattr(Runner, "step", interrupted)
    argv = ["run", *SMALL, "--out", str(tmp_path / "runs"), "--write-trace", str(tmp_path / "trace")]
    assert _error(capsys, argv, 130) == "fidelity: interrupted"
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and list((tmp_path / "runs").iterdir()) == []


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


@pytest.mark.parametrize(("layout", "first"), [("deepseek", "embed.weight"),
                                               ("transformers", "model.embed_tokens.weight")])
def test_a_truncated_file_is_reported_once_not_tensor_by_tensor(saved, tmp_path, capsys, layout, first):
    """One line, in the layout the file's surviving header names, with that layout's tensor names."""
    broken = tmp_path / "broken"
    shutil.copytree(saved[layout], broken)
    f = next(broken.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = _error(capsys, ["inspect", str(broken)])
    assert f"checkpoint {broken} (layout {layout}): 2 problems: " in line
    assert "model.safetensors: unreadable safetensors file (truncated or corrupt)" in line
    assert f"; 304 tensors not found ('{first}', " in line and "unreadable file(s) model.safetensors" in line


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
    assert _error(capsys, ["inspect", str(ckpt)]).endswith(f"(layout transformers): config.json: {message}")


def test_a_config_with_several_problems_and_an_unknown_preset_end_in_one_line(saved, tmp_path, capsys,
                                                                             no_synthesis):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["transformers"], ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    raw.update(hidden_size="256", rms_norm_eps="small")
    (ckpt / "config.json").write_text(json.dumps(raw))
    line = _error(capsys, ["inspect", str(ckpt)])
    assert ": 2 problems: config.json: hidden_size: expected an integer, found '256'; config.json: rms_norm_eps" in line
    line = _error(capsys, ["run", "--preset", "tinier", "--out", str(tmp_path)])
    assert line.endswith("preset: expected one of ['flash', 'pro', 'tiny'], found 'tinier'")


def test_sampler_errors_name_the_flag(tmp_path, capsys, no_synthesis):
    line = _error(capsys, ["run", "--temperature", "-1", "--top-p", "0", "--out", str(tmp_path)])
    assert line == ("fidelity: error: --temperature: expected a finite number >= 0, found -1.0; --top-p: expected a "
                    "number in (0, 1], found 0.0")
    line = _error(capsys, ["run", "--repetition-window", "-3", "--out", str(tmp_path)])
    assert line == "fidelity: error: --repetition-window: expected an integer >= 0 (0: the whole history), found -3"


def test_run_help_names_the_trained_default_as_the_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split()).split("options:")[1]
    preset = text.split("--preset PRESET")[1].split("--layers LAYERS")[0]
    assert "default: tiny" not in preset and "instead of the trained default checkpoint" in preset


def test_a_run_past_the_configs_max_seq_len_warns_in_one_line(tmp_path, capsys):
    from fidelity.model.save import save_checkpoint

    cfg = ModelConfig.preset("tiny").replace(max_seq_len=32)
    save_checkpoint(synthesize(cfg, seed=0), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg.to_official_dict()))  # the spelling with the field
    assert cli.main(["run", "--checkpoint", str(tmp_path / "ckpt"), *SMALL, "--out", str(tmp_path)]) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert warnings == ["fidelity: warning: prompt 40 tokens + 1 decode step goes past the config's max_seq_len 32; "
                        "running anyway"]


def test_the_transformers_decoder_without_transformers_says_what_to_install(tmp_path, capsys, no_synthesis,
                                                                           monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    install = "pip install 'dsv4-fidelity[transformers]' (in a checkout: pip install -e '.[transformers]')"
    for command in ("run", "mutants"):
        line = _error(capsys, [command, "--decoder", "transformers", "--out", str(tmp_path)])
        assert line == f"fidelity: error: --decoder transformers needs transformers>=5.23, which is not installed: " \
                       f"{install}"
    assert list(tmp_path.iterdir()) == []
    root = Path(cli.__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["transformers"] == ["transformers>=5.23"]
    assert "pip install -e '.[transformers]'" in (root / "README.md").read_text()


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
    assert cli.main(["oracle", "--prompt-len", "30", "--decode", "0", "--dtype", "fp64"]) == 0  # hidden spelling


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


HEAVY = ("torch", "pandas", "numpy", "matplotlib", "fidelity.api", "fidelity.harness")
CHECK = """import runpy, sys
heavy = sys.argv.pop().split(",")
try:
    runpy.run_module("fidelity", run_name="__main__")
except SystemExit as end:
    code = end.code
print("heavy:", [m for m in heavy if m in sys.modules], "exit:", code, file=sys.stderr)
"""


@pytest.mark.smoke
@pytest.mark.parametrize(("argv", "code"), [
    (["--help"], 0), (["--version"], 0), ([], 0), (["run", "--help"], 0), (["report", "--help"], 0),
    (["run", "--bogus"], 2), (["run", "--decode", "x"], 2), (["run", "--mode", "fast"], 2),
])
def test_help_version_and_argument_errors_import_no_torch(argv, code):
    """``python -m fidelity`` with these arguments: nothing heavy imported (heavy modules load inside commands)."""
    res = subprocess.run([sys.executable, "-c", CHECK, *argv, ",".join(HEAVY)], capture_output=True, text=True,
                         cwd=Path(cli.__file__).parents[1])
    assert res.stderr.strip().splitlines()[-1] == f"heavy: [] exit: {code}", res.stderr


@pytest.mark.smoke
def test_python_m_fidelity_and_plain_fidelity_list_the_commands():
    res = subprocess.run([sys.executable, "-m", "fidelity"], capture_output=True, text=True,
                         cwd=Path(cli.__file__).parents[1])
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.startswith("usage: fidelity") and "{run,scenarios,fuzz,mutants,report" in res.stdout
    assert "examples:" in res.stdout and "verdict" not in res.stdout  # the commands, not a run
    res = subprocess.run([sys.executable, "-m", "fidelity", "--version"], capture_output=True, text=True)
    assert res.stdout.strip() == f"dsv4-fidelity {cli.__version__}"


@pytest.mark.smoke
@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "tpu"], "--device: expected cpu or cuda[:N] (the devices the decoders and the oracle run on), "
                          "found 'tpu'"),
    (["--oracle-device", "npu"], "--oracle-device: expected cpu or cuda[:N] (the devices the decoders and the oracle "
                                 "run on), found 'npu'"),
    (["--layers", "0"], "--layers: expected >= 1, found 0"),
    (["--checkpoint", "ckpt", "--layers", "2"], "--layers: cuts a --preset's layers; a --checkpoint keeps its own "
                                                "(leave --layers out)"),
    (["--run-id", ""], "--run-id: expected letters, digits, '.', '_', '+', '-' (not leading), found ''"),
    (["--stop-id", "999999", "--stop-id", "7"], "--stop-id: expected ids in [0, 4096), found 999999"),
    (["--sample-queries", "-1", "--mode", "op"], "--sample-queries: expected >= 1 prefill queries, found -1"),
])
def test_a_bad_run_option_is_one_line_before_any_work_and_leaves_no_out_folder(argv, message, tmp_path, capsys,
                                                                              no_synthesis):
    out = tmp_path / "new" / "runs"
    assert _error(capsys, ["run", *argv, "--out", str(out)]).endswith(message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.smoke
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch: --device cuda is not refused")
def test_device_cuda_on_a_cpu_only_torch_names_the_build_and_what_to_install(tmp_path, capsys, no_synthesis):
    for command in ("run", "scenarios", "mutants"):
        line = _error(capsys, [command, "--device", "cuda", "--out", str(tmp_path / "runs")])
        assert line.startswith(f"fidelity: error: --device cuda: this torch ({torch.__version__}) is a CPU-only "
                               "build; install a CUDA build (pip install torch --index-url"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.smoke
def test_a_run_that_cannot_fit_in_memory_is_refused_before_its_prompt_is_built(tmp_path, capsys, monkeypatch):
    from fidelity import budget
    from fidelity.model import default

    monkeypatch.setattr(budget, "available_bytes", lambda: 8 << 30)  # this machine's memory, whatever it is

    def no_prompt(*_a, **_k):
        raise AssertionError("the prompt was built before the memory check")

    monkeypatch.setattr(default, "default_prompt_ids", no_prompt)
    line = _error(capsys, ["run", "--prompt-len", "100000000", "--out", str(tmp_path / "runs")])
    assert line.startswith("fidelity: error: prompt 100000000 tokens + 64 decode steps: the run needs at least "), line
    assert "oracle caches" in line and "this machine has 8.0 GiB available; shorten --prompt-len" in line
    assert list(tmp_path.iterdir()) == []
    cfg = ModelConfig.preset("tiny")
    assert budget.estimate(cfg, 1221, 64).total < 8 << 30 < budget.estimate(cfg, 10**8, 64).total
    assert budget.estimate(cfg, 10**6, 64, ("op",)).parts["oracle caches"] == 0  # op mode reads the decoder's


@pytest.mark.smoke
def test_a_checkpoint_folder_with_a_config_only_is_one_short_line(saved, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(saved["deepseek"] / "config.json", ckpt)
    assert _error(capsys, ["inspect", str(ckpt)]) == f"fidelity: error: checkpoint {ckpt}: no *.safetensors files " \
                                                     f"in {ckpt}"


def test_the_transformers_decoders_bf16_router_failure_names_its_documented_cause(tmp_path, capsys):
    pytest.importorskip("transformers")
    argv = ["run", "--decoder", "transformers", *SMALL, "--out", str(tmp_path), "--run-id", "hf"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "verdict: FAIL" in out and "L0.moe.weights" in out
    assert "cause (documented in README.md, \"A live decoder\"): transformers' router computes its gate logits in " \
           "bf16 (the official gate is fp32)" in out
    assert "A live decoder" in (Path(cli.__file__).parents[1] / "README.md").read_text()
    md = (tmp_path / "hf" / "report.md").read_text()  # no production profile: no 'as reference' beside its name
    assert "| profile | transformers-bf16 |" in md
    assert "| profile fields | none: not a production profile (the decoder's own numerics, precision bf16) |" in md
