"""Training the default checkpoint's recipe: corpus split, tokenizer ids, the objective's gradient routing, the
balance update, the stored result, and a CPU smoke run of ``fidelity train`` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from fidelity import cli
from fidelity.model.config import ModelConfig
from fidelity.model.load import load_checkpoint
from fidelity.model.sampling import StopSet
from fidelity.model.synthesize import synthesize
from fidelity.train import corpus
from fidelity.train.loop import TrainSettings, _balance, lr_at
from fidelity.train.objective import step_losses
from fidelity.train.tokenizer import SPECIAL_TOKENS, encode_document, train_tokenizer
from fidelity.train.trainable import TrainableWeights
from oracles.model import OracleModel

SOURCES = {
    f"pkg/mod{i}.py": f'"""Module {i}."""\n\n\ndef f{i}(x, y={i}):\n    """Add {i}."""\n    return x + y * {i}\n\n'
    f"class C{i}:\n    def __init__(self):\n        self.value = f{i}(1)\n" * 3
    for i in range(40)
}


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for rel, text in SOURCES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "pkg" / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    return root


def test_the_held_out_split_is_a_rule_on_relative_paths(small_corpus):
    files = corpus.corpus_files(small_corpus)
    assert [f.rel for f in files] == sorted(SOURCES)  # sorted, the non-UTF-8 file skipped
    train, held = corpus.split(files)
    assert held and train and len(train) + len(held) == len(files)
    assert all(corpus.is_held_out(f.rel) for f in held) and not any(corpus.is_held_out(f.rel) for f in train)
    described = corpus.describe(small_corpus, files)
    assert described["held_out_files"] == len(held) and len(described["files"][0]["sha256"]) == 64


def test_an_empty_corpus_is_an_error_naming_the_folder(tmp_path):
    with pytest.raises(corpus.CorpusError, match=str(tmp_path)):
        corpus.corpus_files(tmp_path)


def test_the_tokenizer_keeps_the_configs_special_ids_and_round_trips_text(small_corpus, tmp_path):
    tok = train_tokenizer(SOURCES.values(), 400)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    text = SOURCES["pkg/mod3.py"]
    ids = encode_document(tok, text)
    assert ids[0] == 0 and ids[-1] == 1 and tok.decode(ids) == text
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig.preset("tiny")
    # the stop set read from the tokenizer file is the config's EOS plus its end-of-turn id
    assert set(StopSet.from_tokenizer_file(tmp_path / "tokenizer.json")) == {cfg.eos_token_id, *cfg.stop_token_ids}


@pytest.fixture(scope="module")
def weights():
    return TrainableWeights(synthesize(ModelConfig.preset("tiny"), 0))


def test_the_lm_loss_trains_the_model_and_the_kl_loss_only_the_indexer(weights):
    model = OracleModel(weights)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 4096, (161,), generator=gen)
    losses = step_losses(model, weights, ids, 32, gen)
    assert 8.0 < float(losses.lm.detach()) < 10.0 and float(losses.indexer_kl.detach()) > 0
    losses.indexer_kl.backward(retain_graph=True)
    assert all(p.grad is None for p in weights.main_params().values())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in weights.indexer_params().values())
    for p in weights.indexer_params().values():
        p.grad = None
    losses.lm.backward()
    assert all(p.grad is None for p in weights.indexer_params().values())
    assert weights.params["layers.3.attn.wq_a.weight"].grad.abs().sum() > 0
    assert "layers.3.ffn.gate.bias" not in weights.params  # the routing bias has no gradient: it is balanced
    for p in weights.params.values():
        p.grad = None
    # loads of the non-hash layers, one count per routed slot
    assert sorted(losses.loads) == [3, 4, 5] and all(int(v.sum()) == 160 * 2 for v in losses.loads.values())


def test_the_balance_update_raises_the_bias_of_underloaded_experts(weights):
    before = weights.fixed["layers.3.ffn.gate.bias"].clone()
    load = torch.tensor([10, 0, 0, 0, 0, 0, 0, 6])
    _balance(weights, {3: load}, 1e-3)
    step = weights.fixed["layers.3.ffn.gate.bias"] - before
    assert torch.allclose(step[[0, 1, 7]], torch.tensor([-1e-3, 1e-3, -1e-3]), atol=1e-6)
    weights.fixed["layers.3.ffn.gate.bias"].copy_(before)


def test_the_schedule_warms_up_then_decays_to_its_floor():
    s = TrainSettings(out="", steps=1000, lr=1e-3, warmup=100, min_lr_ratio=0.1)
    assert lr_at(s, 0) == pytest.approx(1e-5) and lr_at(s, 99) == pytest.approx(1e-3)
    assert lr_at(s, 999) == pytest.approx(1e-4, rel=1e-3) and lr_at(s, 500) < lr_at(s, 200)


def test_stored_weights_are_the_release_formats_of_the_trained_values(weights):
    ckpt = weights.checkpoint()
    assert ckpt.stored("layers.0.attn.wq_a.weight").fmt == "fp8"
    assert ckpt.stored("layers.3.ffn.experts.0.w1.weight").fmt == "fp4"
    w = weights.params["layers.0.attn.wq_a.weight"].detach()
    assert (ckpt["layers.0.attn.wq_a.weight"] - w).abs().max() <= w.abs().max() / 8  # one FP8 rounding
    assert torch.equal(ckpt["layers.0.ffn.gate.tid2eid"], weights.fixed["layers.0.ffn.gate.tid2eid"])


def test_fidelity_train_runs_end_to_end_on_a_small_corpus(small_corpus, tmp_path, capsys):
    out = tmp_path / "trained"
    argv = ["train", "--out", str(out), "--steps", "2", "--seq-len", "64", "--corpus", str(small_corpus),
            "--eval-every", "1"]
    assert cli.main(argv) == 0
    assert "held-out NLL" in capsys.readouterr().out
    log = json.loads((out / "training.json").read_text())
    assert len(log["steps"]) == 2 and len(log["evals"]) == 1 and log["corpus"]["train_files"] > 0
    assert 0 < log["final"]["held_out_nll"] < 12
    ckpt = load_checkpoint(out / "checkpoint")
    assert ckpt.config.vocab_size == 4096 and (out / "checkpoint" / "tokenizer.json").is_file()
    # continuing from it reuses its tokenizer; an occupied --out is refused before any work
    assert cli.main([*argv[:2], str(tmp_path / "more"), *argv[3:], "--init", str(out / "checkpoint")]) == 0
    assert cli.main(argv) == 2
    assert "--out" in capsys.readouterr().err
