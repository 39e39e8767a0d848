"""The recall ablation (``fidelity.studies.recall_ablation``): variants built as named, same ids, tables."""

from __future__ import annotations

import pytest
import torch

from fidelity.model.default import default_checkpoint
from fidelity.model.load import load_checkpoint
from fidelity.studies import recall, recall_ablation


@pytest.fixture(scope="module")
def trained():
    return load_checkpoint(default_checkpoint())


def test_random_variants_change_only_the_named_indexer_fields(trained):
    base = trained.config
    for name, v in recall_ablation.VARIANTS.items():
        ckpt = recall_ablation.variant_checkpoint(v, trained) if v.weights == "trained" else None
        if ckpt is not None:
            assert ckpt is trained
            continue
        cfg = base.replace(**dict(v.changes))
        assert {f for f in ("index_n_heads", "index_head_dim", "index_topk")
                if getattr(cfg, f) != getattr(base, f)} == {k for k, _ in v.changes}, name
    dsv4 = dict(recall_ablation.VARIANTS["random-64x128"].changes)
    assert (dsv4["index_n_heads"], dsv4["index_head_dim"], dsv4["index_topk"]) == (64, 128, 512)


def test_ablation_runs_each_variant_on_the_same_ids_and_tabulates(trained):
    ids = torch.randint(0, trained.config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    res = recall_ablation.run_ablation(trained, [("trained-4x64", [256]), ("random-64x128", [256])], [8, 16],
                                       ["fp32", "fp4"], queries=8, ids_for=lambda n: ids[:n])
    assert [m["indexer"] for m in res.meta["runs"]] == ["4x64", "64x128"]
    t = recall_ablation.tables(res)
    exact = t["pooled"][t["pooled"]["precision"] == "fp32"]
    assert set(exact["variant"]) == {"trained-4x64", "random-64x128"} and (exact["recall"] == 1).all()
    table = recall_ablation.ablation_table(t["pooled"], t["misses"], ks=(8, 16))
    assert list(table["variant"]) == ["trained-4x64"] * 2 + ["random-64x128"] * 2
    assert ((table["fp4"] > 0) & (table["fp4"] <= 1)).all()
    with pytest.raises(recall.RecallError, match="variant"):
        recall_ablation.run_ablation(trained, [("nope", [256])], [8], ["fp4"])
