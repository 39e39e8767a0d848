"""A paged KV cache (profile field ``kv_cache = paged:<block>``, ``fidelity.decoders.production.cache``): the same
logits as the flat layout bit for bit (chunked prefill across the window and compression boundaries, decode, fork,
rollback, graph decode), rows really stored in permuted blocks, a port that addresses the paged rows by the flat
slot caught, bad values refused, and the cache sizes counted in whole blocks."""

from __future__ import annotations

import pytest
import torch

from fidelity.decoders.base import Call
from fidelity.decoders.production import ProductionModel, get_profile
from fidelity.decoders.production.cache import KVStore, decode_gathers
from fidelity.decoders.production.cache_sizes import cache_bytes, format_memory, profile_formats
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.graph_decode import GraphDecodeSession
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize

TINY = ModelConfig.preset("tiny")  # window 128, index_topk 32, ratios (0, 0, 4, 128, 4, 128)
CONTEXT = 142
CHUNKS = ((0, 50), (50, 131))  # prefill chunks: cross the window (128), CSA blocks and the HCA block ending at 127
PROMPT = CHUNKS[-1][1]
PACKED = "kv_storage=fp8,indexer_storage=packed"  # packed FP8 KV rows (attended in place) and packed FP4 keys


@pytest.fixture(scope="module")
def tiny():
    return synthesize(TINY, seed=0)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(2, TINY.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))


def _profile(fields: str, paged: str | None) -> str:
    return "reference:" + ",".join(f for f in (fields, paged and f"kv_cache={paged}") if f)


def _run(session, ids: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """Every logit of a prefill in ``CHUNKS`` and ``steps`` decode steps: [PROMPT + steps, vocab]."""
    out = [session.prefill(ids[a:b]) for a, b in CHUNKS]
    out += [session.step(int(t))[None] for t in ids[PROMPT : PROMPT + steps]]
    return torch.cat(out)


@pytest.mark.parametrize("fields,paged", [("", "paged:16"), ("", "paged:1"), (PACKED, "paged:16"),
                                          (PACKED, "paged:64")])
def test_paged_cache_gives_the_flat_logits_bit_for_bit(tiny, ids, fields, paged):
    flat = _run(ProductionModel(tiny, _profile(fields, None), max_context=CONTEXT).session(), ids)
    got = _run(ProductionModel(tiny, _profile(fields, paged), max_context=CONTEXT).session(), ids)
    assert torch.equal(got, flat), (got != flat).sum()


def _scenario(dec: ProductionDecoder, ids: torch.Tensor) -> list[torch.Tensor]:
    """Chunked prefill, decode, a fork at a snapshot and one between snapshots (replayed), a rollback into a
    prefill chunk, each continued by a few tokens."""
    out = [dec.forward([Call(0, ids[a:b], a)])[0] for a, b in CHUNKS]
    out += [dec.forward([Call(0, ids[t : t + 1], t)])[0] for t in range(131, 136)]
    dec.fork(1, 0, 131)  # the end of the second chunk: a snapshot
    dec.fork(2, 0, 133)  # between two decode steps' snapshots: the nearest one restored
    dec.fork(3, 0, 90)  # inside a chunk: replayed from the snapshot at 50
    alt = ids.flip(0)
    for seq, at in ((1, 131), (2, 133), (3, 90)):
        out += [dec.forward([Call(seq, alt[at : at + 3], at)])[0]]
        out += [dec.forward([Call(seq, alt[t : t + 1], t)])[0] for t in range(at + 3, at + 5)]
    dec.rollback(0, 100)
    out += [dec.forward([Call(0, alt[100:131], 100)])[0], dec.forward([Call(0, alt[131:132], 131)])[0]]
    return out


@pytest.mark.parametrize("fields", ["", PACKED])
def test_paged_cache_forks_and_rolls_back_as_the_flat_one(tiny, ids, fields):
    flat = _scenario(ProductionDecoder(tiny, _profile(fields, None), max_context=CONTEXT), ids)
    paged = _scenario(ProductionDecoder(tiny, _profile(fields, "paged:16"), max_context=CONTEXT), ids)
    assert len(flat) == len(paged) == 18
    assert [i for i, (a, b) in enumerate(zip(flat, paged, strict=True)) if not torch.equal(a, b)] == []


def _reversed_rows(capacity: int, block: int) -> torch.Tensor:
    """Where slots 0..capacity-1 of a paged store live: logical block b at physical block n_blocks - 1 - b."""
    s, n_blocks = torch.arange(capacity), -(-capacity // block)
    return (n_blocks - 1 - s // block) * block + s % block


@pytest.mark.parametrize("fields", ["", PACKED])
def test_paged_rows_live_in_reversed_blocks_not_at_their_flat_slots(tiny, ids, fields):
    """The paged stores hold the flat stores' rows, each logical row s at the row of ``_reversed_rows``, so that
    storage read by the flat slot gives other rows than the logical read."""
    sessions = []
    for paged in (None, "paged:16"):
        s = ProductionModel(tiny, _profile(fields, paged), max_context=CONTEXT).session()
        s.prefill(ids[:PROMPT])
        sessions.append(s)
    flat, paged = sessions
    checked = 0
    for i in (2, 3):  # a CSA layer (KV rows and indexer keys) and an HCA layer
        for part in ("kv", "keys") if i == 2 else ("kv",):
            a, b = getattr(flat.layers[i], part), getattr(paged.layers[i], part)
            rows = _reversed_rows(b.capacity, 16)
            assert b.parts()[0].shape[0] == -(-b.capacity // 16) * 16  # storage in whole blocks
            for ta, tb in zip(a.parts(), b.parts(), strict=True):
                ta, tb = ta.view(torch.uint8), tb.view(torch.uint8)
                assert torch.equal(tb[rows], ta), f"layer {i} {part}"
                assert not torch.equal(tb[: b.capacity], ta), f"layer {i} {part}: stored at the flat slots"
                checked += 1
            assert torch.equal(b.read(slice(0, b.capacity)), a.read(slice(0, a.capacity)))  # the logical reads
    assert checked == (4 if fields else 3)


def test_packed_attention_addressed_by_the_flat_slot_is_caught(tiny, ids, monkeypatch):
    """A port that hands the FP8-layout attention the logical slots of a paged cache (as if flat) reads other rows:
    the logits move, so the bitwise comparison above would fail."""
    profile = _profile(PACKED, "paged:16")
    good = _run(ProductionModel(tiny, profile, max_context=CONTEXT).session(), ids, steps=3)
    monkeypatch.setattr(KVStore, "physical_slots", lambda self, slots: slots)
    bad = _run(ProductionModel(tiny, profile, max_context=CONTEXT).session(), ids, steps=3)
    assert torch.equal(bad[:PROMPT], good[:PROMPT])  # prefill does not attend in place
    assert not torch.equal(bad[PROMPT:], good[PROMPT:])


@pytest.mark.parametrize("value", ["paged:0", "paged:3", "paged:x", "paged", "paged:8192", "paged:016", "flat:4"])
def test_bad_kv_cache_values_are_refused_naming_the_field(value):
    with pytest.raises(ValueError) as err:
        get_profile(f"reference:kv_cache={value}")
    msg = str(err.value)
    assert "kv_cache: expected 'flat' or 'paged:<block>' with block a power of two in 1..4096" in msg
    assert f"found {value!r}" in msg


def test_kv_cache_values_and_the_builtin_paged_profile():
    assert get_profile("reference").kv_block == 0 and get_profile("reference").kv_cache == "flat"
    assert [get_profile(f"reference:kv_cache=paged:{b}").kv_block for b in (1, 16, 4096)] == [1, 16, 4096]
    paged = get_profile("paged-kv")
    assert (paged.kv_block, paged.changes()) == (64, {"kv_cache": "paged:64"})


@pytest.mark.parametrize("fields", ["", PACKED])
def test_graph_decode_on_a_paged_cache_equals_eager_bit_for_bit(tiny, ids, fields):
    profile = _profile(fields, "paged:16")
    eager = ProductionModel(tiny, profile, max_context=CONTEXT).session()
    graph = GraphDecodeSession(ProductionModel(tiny, profile, max_context=CONTEXT), graphs=False)
    a, b = _run(eager, ids), _run(graph, ids)
    assert torch.equal(a, b), (a != b).sum()
    for la, lb in zip(eager.layers, graph.layers, strict=True):
        for part in ("kv", "keys"):
            if getattr(la, part) is not None:
                assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                           for x, y in zip(getattr(la, part).parts(), getattr(lb, part).parts(), strict=True))
    flat = _run(ProductionModel(tiny, _profile(fields, None), max_context=CONTEXT).session(), ids)
    assert torch.equal(b, flat)


@pytest.mark.parametrize("profile", ["reference:kv_cache=paged:16", "paged-kv", f"reference:{PACKED},kv_cache=paged:1",
                                     "reference:kv_storage=fp8,indexer_storage=packed,indexer_qk=fp8,kv_cache=paged:256"])
def test_paged_cache_sizes_count_whole_blocks(profile):
    ckpt = synthesize(TINY, seed=0, lazy=True)  # sessions allocate caches without reading weights
    prof = get_profile(profile)
    for n in (1, 4, 129, 300, 1000):
        session = ProductionModel(ckpt, prof, max_context=n).session()
        report = cache_bytes(TINY, n, *profile_formats(prof), decode_gathers(prof), prof.kv_block)
        assert session.cache_bytes() == report.total(), f"max_context {n}"
        flat = cache_bytes(TINY, n, *profile_formats(prof), decode_gathers(prof))
        for i, layer in enumerate(session.layers):
            m, f = report.layers[TINY.layer_kinds[i]], flat.layers[TINY.layer_kinds[i]]
            got = layer.nbytes()
            assert got["kv"] % (prof.kv_block * report.kv_row) == 0  # whole blocks
            assert got["kv"] + got.get("indexer_keys", 0) == m.window + m.compressed_kv + m.indexer_keys + m.block_pad
            assert m.total - m.block_pad == f.total and 0 <= m.block_pad  # the flat figures, plus the pad rows
    big = cache_bytes(TINY, 1000, "bf16", "bf16", block=256)
    swa = big.layers["swa"]  # 128 window rows in one 256-row block: 128 pad rows of 2 * 64 B
    assert swa.block_pad == 128 * 2 * TINY.head_dim and "paged in blocks of 256 rows" in format_memory(big)
    with pytest.raises(ValueError, match="block: expected 0 \\(flat\\) or a power of two, found 3"):
        cache_bytes(TINY, 8, block=3)
