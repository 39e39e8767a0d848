"""NaN and Inf never crash a run: planted in weights of several kinds (a norm, an FP8 linear, an FP4 expert's
scale, an attention sink) or in one decode step's cache, the report is written and names the first site and step
where production goes non-finite, and says whether the oracle went with it."""

from __future__ import annotations

import pytest
import torch

from fidelity.decoders.production.model import ProductionSession
from fidelity.harness.runner import RunSpec
from fidelity.job import run_job
from fidelity.model.checkpoint import Checkpoint, StoredTensor
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt
from fidelity.model.synthesize import synthesize

E4M3_NAN, E8M0_NAN = 0x7F, 0xFF


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


def _planted(ckpt, name: str, value: float) -> Checkpoint:
    """A copy of ``ckpt`` with one element of ``name`` non-finite: a float element set to ``value``; FP8 codes
    get the e4m3 NaN code, FP4 tensors a NaN ue8m0 scale (e2m1 has no NaN)."""
    tensors = {n: ckpt.stored(n) for n in ckpt.names()}
    st = tensors[name]
    if st.fmt == "fp8":
        data = st.data.clone()
        data.view(torch.uint8).view(-1)[3] = E4M3_NAN
        tensors[name] = StoredTensor(data, st.fmt, st.scale)
    elif st.fmt == "fp4":
        scale = st.scale.clone()
        scale.view(torch.uint8).view(-1)[3] = E8M0_NAN
        tensors[name] = StoredTensor(st.data, st.fmt, scale)
    else:
        data = st.data.clone()
        data.view(-1)[1] = value
        tensors[name] = StoredTensor(data, st.fmt)
    return Checkpoint.from_tensors(ckpt.config, tensors)


def _run(ckpt, tmp_path, run_id: str):
    spec = RunSpec(prompt=default_prompt(4096, 140), decode_steps=2)
    res = run_job(ckpt, spec, tmp_path, run_id=run_id)
    md = (res.run_dir / "report.md").read_text()
    return res, md.split("## Anomalies")[1].split("\n## ")[0]


BOTH = "the oracle has non-finite values there too: the weights or inputs, not a kernel"
# the official kernel adds the sink after its running max: an infinite sink gives 0, the oracle's max gives NaN
ORACLE_ONLY = "production is finite there and the oracle is not"


@pytest.mark.parametrize(("name", "value", "site", "metric", "whose"), [
    ("layers.2.attn_norm.weight", float("nan"), "L2.attn.in", "test_nonfinite", BOTH),
    ("layers.1.attn.wq_a.weight", float("nan"), "L1.attn.q", "test_nonfinite", BOTH),
    ("layers.3.ffn.experts.5.w2.weight", float("nan"), "L3.moe.out", "test_nonfinite", BOTH),
    ("layers.4.attn.attn_sink", float("inf"), "L4.attn.core", "nonfinite_mismatch", ORACLE_ONLY),
])
def test_a_non_finite_weight_is_reported_where_it_first_shows(tiny, tmp_path, name, value, site, metric, whose):
    res, anomalies = _run(_planted(tiny, name, value), tmp_path, "planted")
    first = res.first_divergence
    assert (first.step, first.site, first.metric) == (0, site, metric), str(first)
    assert f"first non-finite: step 0 (prefill), {site} (" in anomalies
    assert whose in anomalies


def test_a_non_finite_cache_entry_is_reported_at_the_step_that_reads_it(tiny, tmp_path, monkeypatch):
    """NaN written into production's layer-3 window cache before the first decode step: layer mode (the oracle
    keeps its own cache) sees production's attention go non-finite there, and the oracle's stays finite."""
    step = ProductionSession.step

    def poisoned(self, token_id):
        if self.pos == 140:
            cache = self.layers[3].kv
            rows = next(t for t in vars(cache).values() if isinstance(t, torch.Tensor) and t.is_floating_point())
            rows.view(-1)[: rows.shape[-1]] = float("nan")
        return step(self, token_id)

    monkeypatch.setattr(ProductionSession, "step", poisoned)
    res, anomalies = _run(tiny, tmp_path, "cache")
    first = res.first_divergence
    assert (first.step, first.site) == (1, "L3.attn.core"), str(first)
    assert "first non-finite: step 1 (decode), L3.attn.core (" in anomalies
    assert "the oracle's values are finite there: the decoder made them" in anomalies
