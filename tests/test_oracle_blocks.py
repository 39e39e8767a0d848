"""Consecutive calls run as one causal pass (``oracles.blocks``, ``Reference.run_calls``) give each call the records
the call-by-call oracle gives it: the same sites, the same shapes (index scores and an HCA layer's visible entries as
wide as the entries after the call, compressed entries and indexer keys in the call whose token completes them), the
same integers, and floats equal up to the rounding of GEMMs over more rows."""

from __future__ import annotations

import pytest
import torch

from fidelity.api import plan_checkpoint
from fidelity.decoders import default_decoder
from fidelity.model.sites import Recorder
from oracles import OracleModel, Reference
from oracles.blocks import StreamCall, blocks
from oracles.reference import feed_kind, op_kind
from oracles.stream import stream_records

PROMPT = 250  # decode from position 250: an HCA entry (ratio 128) completes at 255, CSA entries every 4 tokens
REL_L2 = 1e-5  # fp32 GEMMs over more rows round otherwise; a call's records are 1e-7..1e-6 apart at most
SIZES = [1] * 20 + [5] + [1] * 19  # decode calls and one 5-token call (a verify-like call), 44 tokens


@pytest.fixture(scope="module")
def stream():
    plan = plan_checkpoint(None)
    ckpt = plan.open()
    ids = plan.prompt(PROMPT + sum(SIZES))
    dec = default_decoder(ckpt, "reference", len(ids), "cpu")
    calls, start = [], 0
    for n in [PROMPT, *SIZES]:
        dec.rec = Recorder(device=None)
        dec.prefill(ids[start : start + n])
        calls.append(StreamCall(ids[start : start + n], dec.rec))
        start += n
    return ckpt, calls


def _assert_same(block: Recorder, alone: Recorder, k: int) -> None:
    assert set(block.records) == set(alone.records), f"call {k}: sites differ"
    for site in alone.records:
        a, b = alone.get(site), block.get(site)
        assert a.shape == b.shape, f"call {k} {site}: {tuple(b.shape)} vs {tuple(a.shape)} call by call"
        if a.is_floating_point():
            assert torch.equal(a.isfinite(), b.isfinite()), f"call {k} {site}: -inf where the other is finite"
            a, b = a[a.isfinite()].double(), b[b.isfinite()].double()
            rel = float((b - a).norm() / a.norm().clamp_min(1e-30))
            assert rel <= REL_L2, f"call {k} {site}: relative l2 {rel:.2e} > {REL_L2:.0e}"
        else:
            assert torch.equal(a, b), f"call {k} {site}: integers differ"


@pytest.mark.parametrize("mode", ["free", "layer", "op"])
def test_a_block_of_calls_gives_each_call_its_call_by_call_records(stream, mode):
    ckpt, calls = stream
    model = OracleModel(ckpt, torch.float32)
    alone, blocked = Reference(model, mode), Reference(model, mode)
    want = [alone.run(c.ids, c.feed) for c in calls]
    got = blocked.run_calls(calls, limit=16)
    kind = {"layer": feed_kind(6, 4), "op": op_kind}.get(mode, lambda c: None)
    assert [len(b) for b in blocks(calls, 16, kind)] == [1, 16, 12, 12]  # the prompt alone, then <= 16 tokens
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same(g, w, k)
    entries = sum(len(g.get("L3.attn.compressed_kv")) for g in got[1:])
    assert entries == 1 and len(got[6].get("L3.attn.compressed_kv")) == 1  # position 255 is call 6's token


def test_the_layer_major_stream_in_blocks_gives_the_call_by_call_records(stream):
    ckpt, calls = stream
    model = OracleModel(ckpt, torch.float32)
    alone = Reference(model, "layer")
    want = [alone.run(c.ids, c.feed) for c in calls]
    for k, (g, w) in enumerate(zip(stream_records(model, "layer", calls, limit=64), want, strict=True)):
        _assert_same(g, w, k)


def test_a_call_whose_records_lack_rows_runs_alone_in_layer_mode(stream):
    ckpt, calls = stream
    short = Recorder(device=None)
    short.records = {s: [(0, r[0][1][:0])] if s == "L1.residual" else r for s, r in calls[3].feed.records.items()}
    odd = [*calls[:3], StreamCall(calls[3].ids, short), *calls[4:6]]
    assert [len(b) for b in blocks(odd, 64, feed_kind(6, 4))] == [1, 2, 1, 2]


def test_calls_whose_decoder_reports_the_top_k_at_other_layers_are_not_one_block(stream):
    _, calls = stream
    quiet = Recorder(device=None)
    quiet.records = {s: r for s, r in calls[3].feed.records.items() if not s.endswith("indexer.topk")}
    mixed = [*calls[:3], StreamCall(calls[3].ids, quiet), *calls[4:6]]
    assert any(s.endswith("indexer.topk") for s in calls[2].feed.records)  # the others report it
    assert [len(b) for b in blocks(mixed, 64, feed_kind(6, 4))] == [1, 2, 1, 2]


def _reaching(feed: Recorder, layer: int, window_col: int, position: int, entry_col: int, entry: int) -> Recorder:
    """``feed`` with layer ``layer``'s visible set changed at one window and one entry column (a planted fault)."""
    site = f"L{layer}.attn.visible"
    visible = feed.get(site).clone()
    visible[:, window_col], visible[:, 128 + entry_col] = position, entry
    out = Recorder(device=None)
    out.records = {s: ([(0, visible)] if s == site else r) for s, r in feed.records.items()}
    return out


def test_op_mode_in_a_block_reads_what_each_call_alone_reads_when_the_decoder_sees_past_its_rows(stream):
    """Visible sets that reach past the call (a later window position of the block, an entry emitted later in the
    block, a window position the call no longer keeps): the block's replay gives the call-by-call records."""
    ckpt, calls = stream
    model = OracleModel(ckpt, torch.float32)
    planted = list(calls)
    # call 3 is position 252 (window 125 .. 252): 253 and 254 come in calls 4 and 5, CSA entry 63 in call 6 (255)
    planted[3] = StreamCall(calls[3].ids, _reaching(_reaching(calls[3].feed, 2, -1, 254, 0, 63), 4, 0, 124, 1, 63))
    planted[4] = StreamCall(calls[4].ids, _reaching(calls[4].feed, 3, -1, 254, 0, 1))  # HCA: 254 reads entry 0
    alone, blocked = Reference(model, "op"), Reference(model, "op")
    want = [alone.run(c.ids, c.feed) for c in planted]
    got = blocked.run_calls(planted, limit=16)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same(g, w, k)
    clean = Reference(model, "op").run_calls(calls[:8], limit=16)
    assert not torch.equal(clean[3].get("L2.attn.core"), got[3].get("L2.attn.core"))  # the plant reaches the core
    assert not torch.equal(clean[4].get("L3.attn.core"), got[4].get("L3.attn.core"))
