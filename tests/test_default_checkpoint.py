"""The trained default checkpoint as a new user meets it: found by ``fidelity.default_checkpoint()``, trained (it
predicts code, random weights do not), text in through its tokenizer and continuations out as text."""

from __future__ import annotations

import json

import pytest
import torch

import fidelity
from fidelity import cli
from fidelity.decoders.production.faults import inject
from fidelity.model.config import ModelConfig
from fidelity.model.default import PROMPT_FILE, default_prompt_ids
from fidelity.model.load import load_checkpoint
from fidelity.outputs.report import PART_MARK
from oracles.model import OracleModel

CODE = 'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\n\ndef sub(a, b):\n'


def test_the_default_is_a_release_layout_tiny_checkpoint_with_its_tokenizer():
    root = fidelity.default_checkpoint()
    assert {"config.json", "model.safetensors", "tokenizer.json", PROMPT_FILE} <= {p.name for p in root.iterdir()}
    ckpt = load_checkpoint(root)
    assert ckpt.layout == "deepseek"
    tiny = ModelConfig.preset("tiny")
    assert ckpt.config.layer_kinds == tiny.layer_kinds and ckpt.config.dim == tiny.dim
    assert ckpt.stored("layers.0.attn.wq_a.weight").fmt == "fp8"
    assert ckpt.stored("layers.3.ffn.experts.0.w1.weight").fmt == "fp4"
    assert sum(p.stat().st_size for p in root.iterdir()) <= 16 << 20


def test_the_default_predicts_code_and_random_weights_do_not():
    ids = default_prompt_ids(4096)  # about 1.2K tokens of Python written for this package (not in the corpus)
    assert ids[0] == 0
    nll = {}
    for name, ckpt in (("trained", load_checkpoint(fidelity.default_checkpoint())),
                       ("random", fidelity.synthesize(ModelConfig.preset("tiny"), 0))):
        logits = OracleModel(ckpt).logits(ids)
        nll[name] = float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:]))
    assert nll["trained"] < 3.2 < 8.0 < nll["random"], nll  # measured 2.82 and 8.75


def test_a_longer_default_prompt_repeats_the_text():
    ids = default_prompt_ids(4096, length=3000)
    assert len(ids) == 3000 and ids[0] == 0 and (ids == 0).sum() == 1


def test_oracle_prints_the_mean_nll_of_a_text_and_its_continuation_as_text(capsys, tmp_path):
    (tmp_path / "code.py").write_text(CODE)
    assert cli.main(["oracle", "--prompt-text-file", str(tmp_path / "code.py"), "--decode", "6"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("prompt NLL: "))
    n = len(fidelity.model.text.load(fidelity.default_checkpoint() / "tokenizer.json").encode(CODE).ids)
    assert f"over {n} predicted tokens (uniform: 8.3178)" in line  # BOS + n ids predict n tokens
    assert float(line.split()[2]) < 4.0
    assert "greedy continuation as text:" in out


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--prompt-text", "x = 1"], "--prompt-text: needs a tokenizer"),
    (["--prompt-text", ""], "--prompt-text: expected some text, found an empty string"),
    (["--prompt-text-file", "/nonexistent/f.py"], "--prompt-text-file: cannot read /nonexistent/f.py"),
])
def test_bad_text_prompts_are_one_line_errors(capsys, argv, message):
    assert cli.main(["oracle", "--decode", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_text_and_id_prompts_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["oracle", "--prompt-text", "x", "--prompt-file", "ids.txt"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_clean_run_on_the_default_passes_and_shows_both_continuations_as_text(tmp_path, capsys):
    argv = ["run", "--prompt-len", "300", "--decode", "6", "--out", str(tmp_path), "--gate"]
    assert cli.main([*argv, "--run-id", "clean"]) == 0  # the clean decoder passes the re-derived thresholds
    out = capsys.readouterr().out
    assert "the trained default checkpoint" in out and "verdict: PASS" in out
    manifest = json.loads((tmp_path / "clean" / "manifest.json").read_text())
    texts = manifest["texts"]
    assert texts["parted_at"] is None and texts["oracle"] == texts["decoder"] and texts["oracle"]
    assert manifest["picks"]["oracle"] == manifest["generated"]
    tok = fidelity.model.text.load(fidelity.default_checkpoint() / "tokenizer.json")
    assert texts["prompt_tail"] == tok.decode(default_prompt_ids(4096)[:300].tolist())[-400:]
    report = (tmp_path / "clean" / "report.md").read_text()
    assert "## Continuations" in report and "every one of the 6 decode steps" in report


def test_where_the_picks_part_the_report_marks_the_token(tmp_path):
    with inject("no-inverse-rope"):  # attention outputs rotated wrongly: the decoder's picks part early
        res = fidelity.run("production", None, 120, 8, ("free",), tmp_path, run_id="broken")
    t = res.manifest["texts"]
    k = t["parted_at"]
    assert k is not None and res.manifest["picks"]["oracle"][k] != res.manifest["picks"]["decoder"][k]
    report = (tmp_path / "broken" / "report.md").read_text()
    a, b = PART_MARK
    assert f"The picks part at decode step {k}" in report
    assert ("decoder (its first pick already differs; the stream then follows the oracle)" if k == 0 else
            f"decoder (its picks up to decode step {k}; the stream then follows the oracle, so the rest is not its "
            "own)") in report
    assert f"{a}{t['decoder_token']}{b}" in report and f"{a}{t['oracle_token']}{b}" in report


def test_oracle_measures_the_held_out_nll_of_a_corpus(tmp_path, capsys):
    from fidelity.train import corpus

    for i in range(64):
        (tmp_path / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    held = [f.rel for f in corpus.split(corpus.corpus_files(tmp_path))[1]]
    assert held  # the hash rule holds out about one name in 32
    assert cli.main(["oracle", "--held-out", "--corpus", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("held-out NLL: ") and f"tokens of {len(held)} files" in line
    assert float(line.split()[2]) < 8.3  # below uniform: the model predicts short Python functions
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "a.py").write_text("x = 1\n")
    assert cli.main(["oracle", "--held-out", "--corpus", str(tmp_path / "only")]) == 2
    assert "--held-out: no file of" in capsys.readouterr().err
