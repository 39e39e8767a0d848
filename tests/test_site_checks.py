"""Self-consistency at the sites (``fidelity.studies.site_checks``): derived scripts compare two plays of a sequence
per position and per compressed entry, and catch what the logits bounds let through."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fidelity.api import plan_checkpoint
from fidelity.decoders.faults import inject
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.model.config import ModelConfig
from fidelity.studies.catalogue import Feed, Script
from fidelity.studies.derive import derive
from fidelity.studies.fuzz_judge import judge_self
from fidelity.studies.play import play
from fidelity.studies.scenarios import self_consistency
from fidelity.studies.site_checks import SiteRows, compare

from .fuzz_plants import LatePassMask


@pytest.fixture(scope="module")
def default():
    plan = plan_checkpoint(None)
    return plan.open(), plan.prompt(700)


def _fresh(ckpt, cls=ProductionDecoder):
    return lambda n: cls(ckpt, max_context=n)


def test_a_late_pass_mask_breaks_the_index_mask_where_only_bounds_are_promised(default):
    """383 + 17 tokens against 400 in one call: no equal bits promised, and the planted mask passes the logits bounds
    (cos_min 0.997); the index scores' masked entries, which no rounding moves, differ from position 383 on. The
    clean decoder passes the same pair at every site."""
    ckpt, ids = default
    script = Script("x", ((0, ((0, 400),)),), (Feed(((0, 383),)), Feed(((0, 17),))))
    v = judge_self(script, ids, _fresh(ckpt, LatePassMask))
    pair = v.pairs[0]
    assert pair["bitwise promised"] == "no" and pair["cos_min"] > 0.99
    assert v.check == "chunked==whole at L2.indexer.scores" and not v.bound_only
    assert pair["site_check"] == "structure" and "first at position 383" in pair["site_detail"]
    clean = judge_self(script, ids, _fresh(ckpt))
    assert clean.check == "" and clean.pairs[0]["site"] == ""


def test_a_batched_key_range_passes_the_logits_and_fails_batched_equals_alone_at_the_index_scores(default):
    """sglang#12583's mechanism (fault ``batch-key-range``): the second sequence of a batched call scores the first
    sequence's key range. Its logits stay within the bounds (the catalogue's pairs never caught it); at the sites
    its index scores' masked entries differ from the same sequence played alone."""
    ckpt, ids = default
    script = Script("x", ((0, ((0, 300),)), (1, ((300, 300),))), (Feed(((0, 130), (1, 260))),
                                                                  Feed(((0, 1), (1, 1)))))
    with inject("batch-key-range"):
        logits_only = self_consistency(replace(derive(script), site_pairs=False), ids, _fresh(ckpt))
        at_sites = self_consistency(derive(script), ids, _fresh(ckpt))
    assert all(p["passed"] for p in logits_only)
    bad = [p for p in at_sites if not p["passed"]]
    assert [(p["b"], p["site"], p["site_check"]) for p in bad] == [("played / seq 1", "L2.indexer.scores",
                                                                    "structure")]
    assert all(p["passed"] for p in self_consistency(derive(script), ids, _fresh(ckpt)))


def _played(ckpt, ids, script) -> SiteRows:
    keep: dict[int, SiteRows] = {}
    play(ProductionDecoder(ckpt, max_context=512), ids, script, keep=keep)
    return keep[0]


def test_one_zeroed_compressed_entry_among_a_hundred_fails_its_site_and_is_named(default):
    """Two plays of the same calls hold the same bits at every site; one compressed entry of L2 zeroed in one of them
    fails ``L2.attn.compressed_kv`` (bits where promised, the bounds otherwise), named by its entry index."""
    ckpt, ids = default
    script = Script("x", ((0, ((0, 420),)),), (Feed(((0, 300),)), Feed(((0, 120),))))
    a, b = _played(ckpt, ids, script), _played(ckpt, ids, script)
    positions = list(range(420))
    assert compare(a, b, positions, True, ckpt.config).site == ""
    first, block = b.blocks["L2.attn.compressed_kv"][0]
    assert first == 0 and block.shape[0] == 75
    block[37] = 0
    bits = compare(a, b, positions, True, ckpt.config)
    assert (bits.site, bits.check) == ("L2.attn.compressed_kv", "bits")
    assert "1 of 105 rows" in bits.detail and "entry 37" in bits.detail
    bound = compare(a, b, positions, False, ckpt.config)
    assert (bound.site, bound.check) == ("L2.attn.compressed_kv", "bound") and "worst entry 37" in bound.detail


def test_a_compressed_entry_is_kept_under_its_index_whichever_call_emits_it(default):
    """Entry e of a layer of ratio r is the call's that reaches position (e + 1) r - 1: 9 tokens then 300 give L2
    (ratio 4) entries 0-1 then 2-76 and L3 (ratio 128) entries 0-1 from the second call."""
    ckpt, ids = default
    rows = _played(ckpt, ids, Script("x", ((0, ((0, 309),)),), (Feed(((0, 9),)), Feed(((0, 300),)))))
    assert [(first, len(t)) for first, t in rows.blocks["L2.attn.compressed_kv"]] == [(0, 2), (2, 75)]
    assert [(first, len(t)) for first, t in rows.blocks["L3.attn.compressed_kv"]] == [(0, 2)]
    _, have = rows.dense("L2.indexer.keys")
    assert have.all() and len(have) == 77


def test_a_decoder_without_per_sequence_records_is_judged_by_its_logits_and_says_so(default):
    ckpt, ids = default

    def fresh(n: int) -> ProductionDecoder:
        d = ProductionDecoder(ckpt, max_context=n)
        d.records_sequences = False
        return d

    script = Script("x", ((0, ((0, 40),)),), (Feed(((0, 24),)), Feed(((0, 16),))))
    v = judge_self(script, ids, fresh)
    assert v.check == "" and v.pairs[0]["site_detail"] == "not recorded"


def test_index_scores_of_different_widths_compare_on_the_entries_both_could_see():
    """A row recorded in a call that knew 2 entries against the same row from a call that knew 5: the columns one
    side lacks are masked, so equal scores are equal."""
    cfg = ModelConfig.preset("tiny")
    a, b = SiteRows(), SiteRows()
    row = torch.tensor([[0.5, -1.0, float("-inf")]])
    a.blocks["L2.indexer.scores"] = [(7, row)]
    b.blocks["L2.indexer.scores"] = [(7, torch.cat([row, torch.full((1, 2), float("-inf"))], 1))]
    assert compare(a, b, [7], True, cfg).site == ""
    b.blocks["L2.indexer.scores"][0][1][0, 2] = 0.25
    got = compare(a, b, [7], True, cfg)
    assert (got.site, got.check) == ("L2.indexer.scores", "structure")


def test_id_sets_count_each_rows_distinct_ids_as_python_sets_do():
    """Top-k picks and expert ids compared per row as sets: repeated ids count once, negative ids are none, and the
    shared count is the intersection's, whatever the widths."""
    from fidelity.studies.site_checks import _id_sets

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(0, 7, (1,), generator=g))
        x = torch.randint(-1, 6, (n, width), generator=g)
        y = torch.randint(-1, 6, (n, width + int(torch.randint(0, 3, (1,), generator=g))), generator=g)
        nx, ny, shared = _id_sets(x, y)
        px = [frozenset(v for v in row if v >= 0) for row in x.tolist()]
        py = [frozenset(v for v in row if v >= 0) for row in y.tolist()]
        assert nx.tolist() == [len(p) for p in px] and ny.tolist() == [len(q) for q in py]
        assert shared.tolist() == [len(p & q) for p, q in zip(px, py, strict=True)]
