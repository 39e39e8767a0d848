"""The model's tables are what the models use: every site either model emits is in the site table
(``fidelity.model.sites.SITE_TABLE``) with the shape it gives and a probe the harness knows, in data-flow order, and
the thresholds gate the sites it marks; both models read exactly the weight schema (``weights.expected_tensors``)."""

import pytest
import torch

from fidelity.decoders.production import ProductionModel
from fidelity.model.config import ModelConfig
from fidelity.model.sites import PROBES, SITE_TABLE, Recorder, site_of, site_template, trailing_shape
from fidelity.model.synthesize import synthesize
from oracles.model import OracleModel

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def recorded() -> dict[str, Recorder]:
    ckpt = synthesize(TINY, seed=0)
    ids = torch.randint(3, TINY.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, session in (("production", ProductionModel(ckpt, max_context=72).session),
                          ("oracle", OracleModel(ckpt).session)):
        rec = Recorder()
        s = session(rec)
        s.prefill(ids[:68])
        for t in ids[68:]:
            s.step(int(t))
        out[name] = rec
    return out


@pytest.mark.parametrize("model", ["production", "oracle"])
def test_every_recorded_site_has_the_tables_shape_and_a_known_probe(recorded, model):
    rec = recorded[model]
    # the tiny model has every kind of layer; the stored KV rows are reported only under kv_storage=fp8, and only by a
    # decoder (tests/test_kv_scale_rule.py)
    stored = {t for t, site in SITE_TABLE.items() if site.probe == "kv_storage"}
    assert {site_template(n) for n in rec.records} == set(SITE_TABLE) - stored
    for name, records in rec.records.items():
        entry, want = site_of(name), trailing_shape(site_template(name), TINY)
        assert entry.probe in PROBES, name
        for _, t in records:
            assert want is None or tuple(t.shape[1:]) == want, (name, tuple(t.shape), want)


def test_the_table_runs_in_data_flow_order_and_a_layers_sites_come_in_the_order_they_are_recorded(recorded):
    templates = list(SITE_TABLE)
    assert templates[0] == "embed" and templates[-2:] == ["final", "logits"]
    layer0 = [site_template(n) for n in recorded["production"].records if n.startswith("L0.")]
    assert layer0 == [t for t in templates if t in layer0]


def test_the_thresholds_gate_exactly_the_sites_the_table_marks():
    import re

    from fidelity.harness.thresholds import COMB_SITES, MAIN_SITES

    for template, site in SITE_TABLE.items():
        name = template.replace("{i}", "12")
        assert bool(re.fullmatch(MAIN_SITES, name)) == site.gated, name
        assert bool(re.fullmatch(COMB_SITES, name)) == (site.probe == "sinkhorn"), name
    assert not re.fullmatch(MAIN_SITES, "L12.attn.qx")


class _ReadLog:
    """A checkpoint that logs the canonical names a model reads."""

    def __init__(self, ckpt):
        self._ckpt, self.read = ckpt, set()

    def __getitem__(self, name):
        self.read.add(name)
        return self._ckpt[name]

    def __getattr__(self, attr):
        return getattr(self._ckpt, attr)


def test_both_models_read_exactly_the_weight_schema():
    """Every tensor of ``weights.expected_tensors`` (the one schema the loader, writer and synthesizer use) is
    read by the production model and by the oracle over a run that routes to every expert, and neither reads a
    name outside it."""
    from fidelity.model.weights import expected_tensors

    cfg = TINY.replace(n_activated_experts=TINY.n_routed_experts)  # every routed expert runs
    ckpt = synthesize(cfg, seed=0)
    ids = torch.randint(3, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    for make in (lambda c: ProductionModel(c, max_context=24).session(), lambda c: OracleModel(c).session()):
        log = _ReadLog(ckpt)
        make(log).prefill(ids)
        assert log.read == set(expected_tensors(cfg)), sorted(log.read ^ set(expected_tensors(cfg)))[:5]


def test_a_recorder_keeps_only_the_given_rows_of_a_rows_only_site_across_its_parts():
    rows = torch.tensor([1, 5, 9])
    rec = Recorder(device=None, rows=rows, rows_only=frozenset({"L{i}.indexer.scores"}))
    first, second = torch.arange(4 * 3.0).reshape(4, 3), torch.arange(8 * 3.0).reshape(8, 3) + 100
    rec("L0.indexer.scores", first)  # call rows 0-3
    rec("L0.indexer.scores", second)  # call rows 4-11
    rec("L0.indexer.q", second)  # not listed: every row
    whole = torch.cat((first, second))
    assert torch.equal(rec.get("L0.indexer.scores"), whole[rows])
    assert torch.equal(rec.get("L0.indexer.scores", rows), whole[rows])  # recorded at these rows: as recorded
    assert torch.equal(rec.get("L0.indexer.q", torch.tensor([0, 2])), second[[0, 2]])
    with pytest.raises(ValueError, match=r"L0.indexer.scores: recorded at rows \[1, 5, 9\], asked for rows \[1\]"):
        rec.get("L0.indexer.scores", torch.tensor([1]))


def test_a_site_recorded_once_is_returned_without_a_copy():
    rec = Recorder(device=None)
    rec("L0.attn.q", torch.ones(2, 3))
    assert rec.get("L0.attn.q").data_ptr() == rec.records["L0.attn.q"][0][1].data_ptr()
