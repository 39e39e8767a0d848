"""Self-consistency pairs judged like every other metric: the logits-pair probe's rows on hand-checkable tables,
the rules that judge them (equal values where the decoder promises equal bits, bounds elsewhere), and where the
production decoder promises equal bits (``Decoder.same_bits``)."""

import pytest
import torch

from fidelity.decoders.base import Decoder
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.studies.catalogue import CATALOGUE, Pair, Run
from fidelity.studies.judge import COS_MIN, judge_pair, pair_rows, pair_split
from probes.logits_pair import logits_pair


def _table() -> torch.Tensor:
    return torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0], [0.5, -1.0, 2.0, 0.0]])


def test_the_probe_counts_unequal_values_and_takes_the_worst_cos_and_the_mean_rel_l2():
    a = _table()
    b = a.clone()
    b[1, 0] = 5.0  # one value off by 1 at position 1
    got = logits_pair(a, b)
    assert int(got["unequal"]) == 1 and int(got["nonfinite_mismatch"]) == 0
    rel = 1 / a[1].norm().item()
    assert got["rel_l2"].tolist() == pytest.approx([0.0, rel, 0.0])
    assert float(got["rel_l2_mean"]) == pytest.approx(rel / 3)
    cos1 = float(a[1] @ b[1] / (a[1].norm() * b[1].norm()))
    assert float(got["cos_min"]) == pytest.approx(cos1) and float(got["max_abs"]) == 1.0
    assert float(got["rel_max"]) == pytest.approx(1 / 4)
    same = logits_pair(a, a.clone())
    assert int(same["unequal"]) == 0 and float(same["cos_min"]) == pytest.approx(1.0)


def test_a_nan_is_unequal_to_itself_and_a_nonfinite_mismatch_where_only_one_side_has_it():
    a, b = _table(), _table()
    a[0, 0] = b[0, 0] = float("nan")
    assert int(logits_pair(a, b)["unequal"]) == 1 and int(logits_pair(a, b)["nonfinite_mismatch"]) == 0
    b[2, 3] = float("inf")
    assert int(logits_pair(a, b)["nonfinite_mismatch"]) == 1


def test_rows_per_position_and_over_the_pair_and_the_rules_that_judge_them():
    a = _table()
    b = a.clone()
    b[2, 2] += 1e-3
    rows = pair_rows(a, b, [10, 11, 12], "p")
    assert set(rows["position"]) == {-1, 10, 11, 12} and set(rows["mode"]) == {"self"}
    assert set(rows.loc[rows["position"] >= 0, "metric"]) == {"cos", "rel_l2"}
    promised = judge_pair(a, b, [10, 11, 12], "same calls", "p")
    assert not promised["passed"] and promised["bound"] == "unequal <= 0" and not promised["bitwise"]
    bounded = judge_pair(a, b, [10, 11, 12], "", "p")
    assert bounded["passed"] and bounded["worst_position"] == 12
    assert bounded["bound"] == f"cos_min >= {COS_MIN:g}, rel_l2_mean <= 0.04, nonfinite_mismatch <= 0"
    assert not judge_pair(a, -a, [10, 11, 12], "", "p")["passed"]  # cos -1 everywhere
    b[0, 0] = float("nan")
    assert not judge_pair(a, b, [10, 11, 12], "", "p")["passed"]  # a NaN where the other side has none


def test_the_split_of_a_pair_is_the_call_boundaries_one_side_lacks():
    whole, chunked = Run("whole", 300, 4), Run("c", 300, 4, (128, 128, 44))
    assert pair_split(Pair("chunked==whole", "whole", "c"), whole, chunked) == (128, 256)
    assert pair_split(Pair("prefix", "whole", "p"), whole, Run("p", 130, 4)) == (130,)
    assert pair_split(Pair("decode==prefill", "whole", "p"), whole, Run("p", 130, 4)) is None
    checks = [c for c in CATALOGUE["prefix"].checks if c.bitwise]
    assert {c.split for c in checks} == {(), (256,)}


def test_the_production_decoder_promises_equal_bits_on_the_cpu_for_splits_on_multiples_of_128():
    dec = ProductionDecoder(synthesize(ModelConfig.preset("tiny"), seed=0), max_context=64)
    assert dec.same_bits() == "production on the CPU"
    assert "multiples of 128" in dec.same_bits((128, 256))
    assert dec.same_bits((128, 130)) == ""
    assert Decoder.same_bits(dec) == ""  # the default promises nothing


@pytest.mark.parametrize("tail", [2, 3, 4, 7])
def test_a_short_prefill_call_after_an_aligned_split_keeps_the_promised_bits(tail):
    """The promise holds whatever the call after the split: 128 tokens then ``tail`` give the bits of 128 + tail in
    one call (a call of 2-3 rows once took torch's small-M GEMM kernel and gave other bits: ``ops.rows_mm``)."""
    from fidelity.api import plan_checkpoint

    plan = plan_checkpoint(None)
    dec = ProductionDecoder(plan.open(), max_context=160)
    ids = plan.prompt(128 + tail)
    assert "multiples of 128" in dec.same_bits((128,))
    whole = dec.prefill(ids).float()
    dec.reset()
    chunked = torch.cat([dec.prefill(ids[:128]).float(), dec.prefill(ids[128:]).float()])
    assert torch.equal(chunked, whole)
