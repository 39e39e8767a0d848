"""The mHC pre / post weights are gated against their sigmoids' ranges, [0, 1 + hc_eps] and [0, 2], on the
decoder's own records in every mode and call (``harness.site_pairs.gate_rows``); a clean run passes the gate."""

from __future__ import annotations

import pytest
import torch

import fidelity
from fidelity.harness.site_pairs import gate_rows
from fidelity.harness.thresholds import default_thresholds
from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder, record
from fidelity.outputs.rundir import read_run

TINY = ModelConfig.preset("tiny")


def test_pre_and_post_outside_their_ranges_give_their_excess():
    rec = Recorder()
    record(rec, "L{i}.mhc_attn.post", 1, torch.tensor([[0.5, 2.5, 1.0, 0.0]]))
    record(rec, "L{i}.mhc_ffn.pre", 4, torch.tensor([[0.5, 0.25, 1.0, 0.0]]))
    record(rec, "L{i}.mhc_ffn.pre", 5, torch.tensor([[1.25, 0.25, 1.0, 0.0]]))
    record(rec, "L{i}.mhc_attn.comb", 1, torch.full((1, 4, 4), 3.0))  # the comb has its own probe
    rows = {(r["site"], r["metric"]): float(r["value"]) for r in gate_rows(rec, TINY)}
    assert rows == {("L1.mhc_attn.post", "range_excess"): 0.5, ("L4.mhc_ffn.pre", "range_excess"): 0.0,
                    ("L5.mhc_ffn.pre", "range_excess"): pytest.approx(0.25 - TINY.hc_eps, abs=1e-12)}


def test_the_gate_holds_in_every_mode_at_pre_and_post_only():
    rules = [r for r in default_thresholds("reference") if r.metric == "range_excess"]
    assert len(rules) == 1 and rules[0].op == "<=" and rules[0].value == 0
    for site in ("L0.mhc_attn.pre", "L3.mhc_attn.post", "L5.mhc_ffn.pre", "L2.mhc_ffn.post"):
        assert all(rules[0].matches(site, "range_excess", mode) for mode in ("free", "layer", "op"))
    assert not rules[0].matches("L0.mhc_attn.comb", "range_excess")


def test_a_clean_run_gates_every_layers_pre_and_post_and_passes(tmp_path):
    res = fidelity.run("production", fidelity.synthesize(TINY, seed=0), prompt=64, decode_steps=2, modes=("free",),
                       out=tmp_path)
    df, _ = read_run(res.run_dir)
    gated = df[df["metric"] == "range_excess"]
    assert set(gated["site"]) == {f"L{i}.mhc_{w}.{g}" for i in range(TINY.n_layers) for w in ("attn", "ffn")
                                  for g in ("pre", "post")}
    assert set(gated["step"]) == {0, 1, 2}  # the prefill and every decode step
    assert (gated["value"] == 0).all() and res.verdict == "PASS"
