"""The site table (``fidelity.model.sites.SITE_TABLE``) is what both models record: every site either model emits
is in it, with the shape it gives and a probe the harness knows; its order is the data flow."""

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
    assert {site_template(n) for n in rec.records} == set(SITE_TABLE)  # the tiny model has every kind of layer
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
