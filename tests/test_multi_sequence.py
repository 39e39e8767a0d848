"""Several sequences on the production decoder (forward, fork, rollback) and the scenarios that use them (batch,
prefix, verify): batched == alone up to GEMM rounding (one model call over every sequence's rows, a call mixing
prefill and decode), forked == cold and rolled back == never proposed bit for bit on the CPU, planted batch and
rollback bugs caught by self-consistency, a wrong start one line, a decoder without the capabilities skipped with
its reason."""

import pytest
import torch

from fidelity.api import open_decoder, plan_checkpoint
from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Call, Decoder, DecoderError
from fidelity.decoders.production.batch import forward_batch
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.studies import catalogue
from fidelity.studies.catalogue import CATALOGUE, Check, Feed, Run, Scenario, Script
from fidelity.studies.play import missing
from fidelity.studies.scenarios import run_scenarios, self_consistency


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
    assert all(p["bitwise"] for p in promised)
    if name == "batch":  # one batched call's GEMMs over every sequence's rows: rounding, no promise of bits
        assert not promised and max(p["rel_l2"] for p in got) < 0.02
    elif name == "verify":
        assert len(promised) == len(got)
    else:  # prefix has one pair under the bounds: fork at 130 vs the cold run's one prefill
        assert 0 < len(promised) < len(got)


def test_forward_fork_rollback_by_hand():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    ids = torch.arange(3, 83) % ckpt.config.vocab_size
    dec = ProductionDecoder(ckpt, max_context=100)
    assert all(v is None for v in dec.capabilities().values()) and "batched" in dec.info()["multi_sequence"]
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


def test_a_batched_call_mixes_prefill_and_decode_in_one_model_call(plan):
    ckpt, ids = plan.ckpt, plan.prompt(80)
    alone = [ProductionDecoder(ckpt, max_context=100) for _ in range(3)]
    want = [alone[0].forward([Call(0, ids[:9], 0)])[0], alone[1].forward([Call(0, ids[:20], 0)])[0]]
    want += [alone[0].forward([Call(0, ids[9:10], 9)])[0], alone[1].forward([Call(0, ids[20:27], 20)])[0],
             alone[2].forward([Call(0, ids[:13], 0)])[0]]
    dec = ProductionDecoder(ckpt, max_context=100)
    got = dec.forward([Call(0, ids[:9], 0), Call(1, ids[:20], 0)])
    got += dec.forward([Call(0, ids[9:10], 9), Call(1, ids[20:27], 20), Call(2, ids[:13], 0)])  # decode + prefills
    assert [t.shape[0] for t in got] == [9, 20, 1, 7, 13]
    assert [dec.seqs[k].session.pos for k in range(3)] == [10, 27, 13] and dec.session.calls == 2
    for a, b in zip(want, got, strict=True):  # GEMMs over 29 / 21 rows vs each sequence's own: rounding only
        assert torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min() > 0.99
    assert dec.seqs[1].tokens == ids[:27].tolist()


def _shifted_forward_batch(sessions, ids):
    """Port bug: every sequence of a batch is placed at the first sequence's position (its offset read from the
    wrong sequence), so RoPE and the cache writes of the others land elsewhere."""
    pos = [s.pos for s in sessions]
    for s in sessions:
        s.pos = pos[0]
    out = forward_batch(sessions, ids)
    for s, p, t in zip(sessions, pos, ids, strict=True):
        s.pos = p + len(t)
    return out


def test_a_batch_offset_bug_is_caught_by_batch_self_consistency(plan, monkeypatch):
    monkeypatch.setattr("fidelity.decoders.production.decoder.forward_batch", _shifted_forward_batch)
    got = self_consistency(CATALOGUE["batch"], plan.prompt(700), _fresh(plan.ckpt))
    by_seq = {p["b"]: p for p in got}
    assert by_seq["batched / seq 0"]["passed"]  # sequence 0 sets the position everyone takes: itself unharmed
    for late in ("batched / seq 3", "batched / seq 4"):  # prefilled in a call with others' decode steps
        assert not by_seq[late]["passed"] and by_seq[late]["cos_min"] < 0.9, by_seq[late]
    assert not by_seq["batched / seq 2"]["passed"]  # 8 decode steps at another sequence's positions


def _two_in_a_batch() -> Scenario:
    """Prompts 20 and 33 prefilled in one call, decoded together for 3 steps; each alone; judged as played."""
    streams = ((0, ((0, 23),)), (1, ((50, 36),)))
    ops = (Feed(((0, 20), (1, 33))), *[Feed(((0, 1), (1, 1)))] * 3)
    alone = [Script(f"alone {k}", ((0, segs),), (Feed(((0, n),)), *[Feed(((0, 1),))] * 3))
             for (k, segs), n in zip(streams, (20, 33), strict=True)]
    return Scenario("two", "two sequences batched", (), needs=("batch",),
                    scripts=(Script("batched", streams, ops), *alone),
                    checks=tuple(Check("batched==alone", (f"alone {k}", 0), ("batched", k)) for k in (0, 1)))


@pytest.mark.parametrize("bug", [None, _shifted_forward_batch])
def test_a_batch_bug_is_localised_by_judging_the_played_sequences_against_the_oracle(plan, tmp_path, monkeypatch,
                                                                                       bug):
    if bug is not None:
        monkeypatch.setattr("fidelity.decoders.production.decoder.forward_batch", bug)
    res = run_scenarios(plan, [_two_in_a_batch()], out=tmp_path, run_id="b", modes=("op",))
    rows = res.matrix.set_index("run")
    assert list(rows.index) == ["batched / seq 0", "batched / seq 1"]
    assert [rows.loc[r, "decode_steps"] for r in rows.index] == [3, 3]
    if bug is None:
        assert res.passed, res.failures()
    else:  # sequence 1 decoded at sequence 0's positions: its q's RoPE is wrong in layer 0 at the first step
        assert rows.loc["batched / seq 0", "verdict"] == "PASS"
        assert rows.loc["batched / seq 1", "first_site"] == "L0.attn.q"
        assert rows.loc["batched / seq 1", "first_step"] == 1
    assert not (tmp_path / "b" / "traces").exists()  # judged and removed; the run directories stay
    assert len(list((tmp_path / "b" / "runs").iterdir())) == 2


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


def test_a_planted_fault_is_found_by_the_scenarios_command_and_named_in_the_report(tmp_path, monkeypatch, capsys):
    """``fidelity scenarios --inject``: the catalogue (here the two-sequence batch) with a batch fault planted fails
    at the played sequence, and the report says what was planted; an unknown fault is one line, exit 2."""
    from fidelity.cli import main

    monkeypatch.setitem(catalogue.CATALOGUE, "two", _two_in_a_batch())
    argv = ["scenarios", "--scenario", "two", "--mode", "op", "--out", str(tmp_path), "--gate"]
    assert main([*argv, "--run-id", "bug", "--inject", "batch-key-range"]) == 1
    out = capsys.readouterr().out
    assert "with batch-key-range planted" in out and "FAIL two/batched / seq 1: step 0 (prefill), L2.indexer" in out
    assert "with batch-key-range planted" in (tmp_path / "bug" / "report.md").read_text()
    assert main([*argv, "--run-id", "x", "--inject", "no-such-fault"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--inject: expected faults of the production decoder (" in err[0]
    assert "found no-such-fault" in err[0] and not (tmp_path / "x").exists()
