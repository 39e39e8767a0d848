"""Several sequences on the production decoder (forward, fork, rollback) and the scenarios that use them (batch,
prefix, verify): batched == alone, forked == cold and rolled back == never proposed bit for bit on the CPU, a
planted rollback bug caught by verify's self-consistency, a wrong start one line, a decoder without the
capabilities skipped with its reason."""

import pytest
import torch

from fidelity.api import open_decoder, plan_checkpoint
from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Call, Decoder, DecoderError
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.scenarios import CATALOGUE, Run, Scenario, missing, run_scenarios, self_consistency


@pytest.fixture(scope="module")
def plan():
    p = plan_checkpoint(None)
    p.open()
    return p


def _fresh(ckpt):
    return lambda n: open_decoder("production", ckpt, max_context=n)


@pytest.mark.parametrize("name", ["batch", "prefix", "verify"])
def test_the_multi_sequence_scenarios_hold_on_the_clean_decoder(plan, name):
    got = self_consistency(CATALOGUE[name], plan.prompt(700), _fresh(plan.ckpt))
    assert got and all(p["passed"] for p in got), [p for p in got if not p["passed"]]
    promised = [p for p in got if p["bitwise promised"] != "no"]
    assert promised and all(p["bitwise"] for p in promised)
    if name != "prefix":  # prefix has one pair under the bounds: fork at 130 vs the cold run's one prefill
        assert len(promised) == len(got)


def test_forward_fork_rollback_by_hand():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    ids = torch.arange(3, 83) % ckpt.config.vocab_size
    dec = ProductionDecoder(ckpt, max_context=100)
    assert all(v is None for v in dec.capabilities().values()) and "one after another" in dec.info()["multi_sequence"]
    a, b = dec.forward([Call(0, ids[:30], 0), Call(1, ids[:45], 0)])
    assert a.shape == (30, ckpt.config.vocab_size) and b.shape[0] == 45
    dec.fork(2, 1, 37)  # inside sequence 1's call: replayed
    dec.fork(3, 1, 45)  # its end: the snapshot
    alone = ProductionDecoder(ckpt, max_context=100)
    alone.forward([Call(0, ids[:37], 0)])
    assert torch.equal(dec.forward([Call(2, ids[37:40], 37)])[0], alone.forward([Call(0, ids[37:40], 37)])[0])
    dec.forward([Call(3, ids[45:49], 45)])
    dec.rollback(3, 46)  # a proposal of 4, one accepted
    assert dec.seqs[3].session.pos == 46 and dec.snapshot_bytes() > 0
    with pytest.raises(DecoderError) as err:
        dec.forward([Call(3, ids[47:48], 47)])
    assert str(err.value) == "production (reference): sequence 3: call starts at 47, expected 46 (where it stands)"
    with pytest.raises(DecoderError, match="a new sequence starts at 0"):
        dec.forward([Call(9, ids[:2], 5)])
    dec.reset()
    assert set(dec.seqs) == {0} and dec.pos == 0 and dec.snapshot_bytes() == 0


class CarryNotRestored(ProductionDecoder):
    """Port bug: a rollback (or fork) restores the window ring but leaves the compressors' carries as the rejected
    proposals left them."""

    def restore_carries(self, cache, saved):
        pass


def test_a_rollback_that_keeps_the_carry_is_caught_by_verify(plan):
    one = CarryNotRestored(plan.ckpt, max_context=300)
    got = self_consistency(CATALOGUE["verify"], plan.prompt(300), lambda n: one)
    assert len(got) == 1 and not got[0]["passed"] and not got[0]["bitwise"]
    assert got[0]["worst_position"] >= 251  # the first block a stale carry closes


class OneSequence(Decoder):
    """A decoder with the base interface only (no capabilities) over the production decoder."""

    def __init__(self, ckpt, n):
        self.inner = ProductionDecoder(ckpt, max_context=n)
        self.config, self.profile, self.label = ckpt.config, self.inner.profile, "one-sequence engine"

    pos = property(lambda self: self.inner.pos)
    rec = property(lambda self: self.inner.rec, lambda self, r: setattr(self.inner, "rec", r))

    def prefill(self, ids):
        return self.inner.prefill(ids)

    def step(self, token):
        return self.inner.step(token)

    def sites(self):
        return self.inner.sites()

    def reset(self):
        self.inner.reset()


def test_a_decoder_without_the_capabilities_gets_them_skipped(plan, tmp_path):
    dec = OneSequence(plan.ckpt, 300)
    why = dec.capabilities()[BATCH]
    assert missing(CATALOGUE["batch"], dec) == f"batch: {why}"
    assert missing(CATALOGUE["prefix"], dec) == f"fork: {dec.capabilities()[FORK]}"
    assert missing(CATALOGUE["verify"], dec) == f"rollback: {dec.capabilities()[ROLLBACK]}"
    small = Scenario("one", "one prompt", (Run("prompt 20", 20, 1),))
    res = run_scenarios(plan, [small, "batch", "verify"], dec, out=tmp_path, run_id="s", modes=("free",))
    assert res.passed and set(res.skipped) == {"batch", "verify"} and len(res.matrix) == 1
    assert res.verdict().startswith("PASS; not judged: batch skipped (batch: ")
    md = (tmp_path / "s" / "report.md").read_text()
    assert "Skipped" in md and why in md
    only = run_scenarios(plan, ["verify"], dec, out=tmp_path, run_id="t", modes=("free",))
    assert only.verdict() == f"SKIPPED: verify skipped (rollback: {dec.capabilities()[ROLLBACK]})"


class ForksAtCallEnds(ProductionDecoder):
    """Forks only where the parent's call ended (as transformers' decoder, which keeps cache copies at call ends)."""

    def fork(self, seq: int, parent: int, pos: int) -> None:
        if pos != self.seqs[parent].session.pos:
            raise DecoderError(f"{self.label}: cannot fork sequence {parent} at position {pos}: only where it stands")
        super().fork(seq, parent, pos)


def test_a_capability_held_only_in_part_skips_that_self_consistency_with_the_reason(plan, tmp_path):
    dec = ForksAtCallEnds(plan.ckpt, max_context=400)
    res = run_scenarios(plan, ["prefix"], dec, out=tmp_path, run_id="p", modes=("free",))
    assert len(res.matrix) and res.pairs.empty
    assert "only where it stands" in res.skipped["prefix self-consistency"]
    assert "not judged: prefix self-consistency skipped" in res.verdict()
