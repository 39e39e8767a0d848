"""The verdict names the layer whatever a decoder reports: real runs with a port bug planted in transformers' model
(or in what a decoder reports), each localised to the site and step where it enters."""

from __future__ import annotations

import pytest
import torch

import fidelity
from fidelity.decoders import TransformersDecoder
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.trace_file import TraceWriter
from fidelity.decoders.transformers import hf_model
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_checkpoint, prompt_for
from fidelity.model.load import load_checkpoint
from fidelity.model.sites import Recorder, site_template
from tests.hf_reference import random_hf_model


@pytest.fixture(scope="module")
def default():
    return load_checkpoint(default_checkpoint())


def _readme_trace(path, ckpt, model, prompt, steps: int) -> None:
    """The README's minimal trace: logits, ``embed`` and the ``L{i}.residual`` streams of a greedy decode loop."""
    from transformers import DynamicCache

    writer = TraceWriter(path, ckpt.config, prompt, decoder="transformers, README trace",
                         profile={"name": "hf-fp32", "precision": "exact"}, checkpoint={"path": str(ckpt.path)})
    inner = model.model
    inner.embed_tokens.register_forward_hook(lambda m, a, out: writer("embed", out[0]))
    for i, layer in enumerate(inner.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: writer(f"L{i}.residual", out[0]))
    cache, ids = DynamicCache(config=model.config), prompt
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(input_ids=ids[None], cache=cache, use_cache=True)
            cache, logits = out.cache, out.logits[0].float()
            writer.end_step(ids, logits)
            ids = logits[-1:].argmax(-1)
    writer.finish()


@pytest.mark.parametrize("bug_layer", [None, 2])
def test_a_residual_only_trace_names_the_csa_layer_whose_compressor_lost_its_position_bias(default, tmp_path,
                                                                                         bug_layer):
    """A weight never loaded (transformers' compressor ``position_bias`` left at zero) in CSA layer 2: the first
    divergence is that layer's residual in layer mode, and the free-mode logits failure is named its consequence;
    the same trace without the bug passes the exact thresholds."""
    model = hf_model(default, torch.float32)
    if bug_layer is not None:
        with torch.no_grad():
            model.model.layers[bug_layer].self_attn.compressor.position_bias.zero_()
    _readme_trace(tmp_path / "trace", default, model, prompt_for(default, 300), steps=3)
    res = fidelity.run(f"trace:{tmp_path / 'trace'}", out=tmp_path / "runs")
    assert res.manifest["modes"] == ["free", "layer"]
    if bug_layer is None:
        assert res.verdict == "PASS", str(res.first_divergence)
        return
    first = res.first_divergence
    assert (first.site, first.mode, first.step) == ("L2.residual", "layer", 0), str(first)
    assert first.consequences >= 1 and "logits" in first.first_consequence
    assert "free-mode failure" in str(first) and "follow" in str(first)
    failing_layers = set(res.failures.loc[res.failures["mode"] == "layer", "site"])
    assert failing_layers == {"L2.residual"}


def test_an_embedding_that_is_not_the_checkpoints_is_named_first(default, tmp_path):
    """A randomly initialised model passed with the checkpoint: the embedding (a table lookup) is the first
    divergence, in words, before any mHC or attention metric."""
    decoder = TransformersDecoder(random_hf_model(default.config, seed=5), default.config)
    res = fidelity.run(decoder, default, prompt=40, decode_steps=1, out=tmp_path, modes=("free", "layer"))
    first = res.first_divergence
    assert first.site == "embed" and first.metric == "cos", str(first)
    assert "embeddings are not the checkpoint's" in str(first)


class _InertDecodeCompressor(ProductionDecoder):
    """Reports no compressed entry on one-token calls, as a port whose compressor is inert during decode does."""

    def step(self, token: int) -> torch.Tensor:
        outer = self.rec
        inner = Recorder(device=None)
        inner.step = outer.step
        self.rec = inner
        try:
            logits = super().step(token)
        finally:
            self.rec = outer
        for site, records in inner.records.items():
            for step, t in records:
                if site_template(site) == "L{i}.attn.compressed_kv":
                    t = t[:0]
                outer.records.setdefault(site, []).append((step, t))
        return logits


def test_a_decoder_reporting_fewer_rows_is_judged_at_that_site_and_step_not_crashed(tmp_path):
    ckpt = fidelity.synthesize(ModelConfig.preset("tiny"), seed=0)
    decoder = _InertDecodeCompressor(ckpt, max_context=64)
    res = fidelity.run(decoder, ckpt, prompt=41, decode_steps=4, out=tmp_path, modes=("layer", "op"))
    first = res.first_divergence
    # position 43 closes a CSA block: the first one-token call that should emit an entry (step 3: prefill, 41, 42, 43)
    assert (first.site, first.metric, first.step) == ("L2.attn.compressed_kv", "rows_missing", 3), str(first)
    assert first.value == 1 and first.mode == "op"
    rows = res.judgement.judged
    missing = rows[(rows["metric"] == "rows_missing") & ~rows["passed"]]
    assert set(missing["site"]) == {"L2.attn.compressed_kv", "L4.attn.compressed_kv"}


def test_a_hash_routing_table_cast_to_bf16_is_the_first_divergence_at_its_experts_site(tmp_path):
    """384 routed experts: ids above 256 do not survive bf16 (odd ones move to an even neighbour), so a hash layer
    routes tokens elsewhere. No near-tie excuses a hash lookup: the first divergence is L0.moe.experts."""
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=384, moe_inter_dim=128)
    ckpt = fidelity.synthesize(cfg, seed=0)
    model = hf_model(ckpt, torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[: cfg.n_hash_layers]:
            table = layer.mlp.gate.tid2eid
            # 383 rounds to 384, past the last expert (transformers' gather would fail): keep it in range
            table.copy_(table.to(torch.bfloat16).to(table.dtype).clamp(max=cfg.n_routed_experts - 1))
    res = fidelity.run(TransformersDecoder(model, cfg), ckpt, prompt=60, decode_steps=1, out=tmp_path)
    first = res.first_divergence
    assert (first.site, first.metric, first.step) == ("L0.moe.experts", "routing_gap", 0), str(first)
    assert first.value == float("inf")
    flips = res.judgement.judged
    hashed = flips[(flips["metric"] == "routing_gap") & ~flips["passed"]]
    assert set(hashed["site"]) == {f"L{i}.moe.experts" for i in range(cfg.n_hash_layers)}
