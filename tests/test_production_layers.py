"""The production decoder's layers as objects (``fidelity.decoders.production.layer``): built once per layer of a
model, holding the weights they read, with a compressor and an indexer exactly where the layer kind has them."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.policies import EAGER, ONE_SEQUENCE, WHOLE_MODEL
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize


def test_each_layer_is_built_once_with_the_sub_layers_its_kind_has():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    model, cfg = ProductionModel(ckpt, max_context=32), ckpt.config
    for i in range(cfg.n_layers):
        layer = model.layer(i)
        assert model.layer(i) is layer
        ratio = cfg.ratio(i)
        assert (layer.attn.compressor is not None) == (ratio > 0), i
        assert (layer.attn.indexer is not None) == (ratio == 4), i
        assert layer.moe.hashed == cfg.is_hash_layer(i)
        assert layer.attn.sink is model.w(f"layers.{i}.attn.attn_sink")  # the model's tensor, not a copy
        assert layer.mhc_ffn.fn is model.w(f"layers.{i}.hc_ffn_fn")


def test_a_layer_reads_only_its_own_weights_when_built():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    model = ProductionModel(ckpt, max_context=32)
    model.layer(2)
    layers = {int(name.split(".")[1]) for name in model._weights if name.startswith("layers.")}
    assert layers == {2}


def test_a_session_runs_under_the_eager_single_sequence_whole_model_policies_by_default():
    session = ProductionModel(synthesize(ModelConfig.preset("tiny"), seed=0), max_context=32).session()
    assert (session.decode, session.rows, session.stage) == (EAGER, ONE_SEQUENCE, WHOLE_MODEL)
    logits = session.prefill(torch.arange(3, 20))
    assert logits.shape == (17, session.cfg.vocab_size) and session.pos == 17
