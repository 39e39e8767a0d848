"""The indexer key cache at DeepSeek-V4's widths (head_dim 512, index_head_dim 128, top-512): keys cut to 64 of
their 128 dims (``indexer-key-width``) or written at the KV row stride (``indexer-key-stride``: sized from head_dim,
so every fourth slot holds a key) are caught at the first CSA layer's ``indexer.keys`` / ``indexer.scores`` at step
0, in the production decoder and planted in transformers' model; with more entries than top-512 the picks move."""

from __future__ import annotations

import pytest
import torch

from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.faults import inject
from fidelity.decoders.transformers import FAULTS as HF_FAULTS
from fidelity.model.sites import Recorder
from fidelity.model.synthesize import synthesize
from fidelity.studies.detection import gate_failures
from fidelity.studies.mutant_runs import MutantSettings, run_mutants
from fidelity.studies.mutants import BY_NAME
from tests.flash_heads import FLASH_HEADS, TINY

KEY_FAULTS = ["indexer-key-width", "indexer-key-stride"]
FIRST_SITE = {"indexer-key-width": "L2.indexer.keys", "indexer-key-stride": "L2.indexer.scores"}
PAST_TOPK = 4 * 544  # a prompt with 544 CSA entries: more than top-512, so the selection must choose


@pytest.fixture(scope="module")
def flash_heads():
    return synthesize(FLASH_HEADS, seed=0)


def _caught(matrix) -> dict[str, tuple[int, str, bool]]:
    first = matrix[(matrix["probe"] == "first") & (matrix["expect"] == "caught")]
    return {r.mutant: (int(r.step), r.site, bool(r.located)) for r in first.itertuples()}


def test_the_stride_fault_needs_kv_rows_wider_than_the_keys():
    assert BY_NAME["indexer-key-stride"].cannot_show(TINY) is None  # 128 vs 64: every other slot
    assert BY_NAME["indexer-key-stride"].cannot_show(FLASH_HEADS) is None
    same = TINY.replace(head_dim=64, rope_head_dim=64)
    assert "head_dim = index_head_dim = 64" in BY_NAME["indexer-key-stride"].cannot_show(same)


def test_production_key_faults_are_caught_at_the_first_csa_layer_at_step_0(flash_heads):
    matrix = run_mutants(flash_heads, KEY_FAULTS, MutantSettings(seed=0, decode_steps=1))
    assert gate_failures(matrix) == []
    assert _caught(matrix) == {name: (0, FIRST_SITE[name], True) for name in KEY_FAULTS}


def test_key_faults_planted_in_transformers_are_caught_at_the_same_sites(flash_heads):
    from fidelity.decoders.transformers import TransformersDecoder

    assert set(KEY_FAULTS) <= set(HF_FAULTS)
    matrix = run_mutants(flash_heads, KEY_FAULTS, MutantSettings(seed=0, decode_steps=1),
                         decoder=lambda: TransformersDecoder.from_checkpoint(flash_heads, "fp32"), known=HF_FAULTS)
    assert gate_failures(matrix) == []
    assert _caught(matrix) == {name: (0, FIRST_SITE[name], True) for name in KEY_FAULTS}


@pytest.fixture(scope="module")
def through_l2():
    """Layers 0-2 of FLASH_HEADS (SWA, SWA, CSA): the prefills below need no layer past the first CSA one."""
    return synthesize(FLASH_HEADS.first_layers(3), seed=0)


def _prefill_picks(ckpt, ids: torch.Tensor, fault: str | None) -> dict[str, torch.Tensor]:
    rec = Recorder([r"L\d+\.indexer\.(keys|topk)"])
    session = ProductionModel(ckpt, "reference", max_context=len(ids) + 1).session(rec)
    if fault is None:
        session.prefill(ids)
    else:
        with inject(fault):
            session.prefill(ids)
    return {name: rows[0][1] for name, rows in rec.records.items()}


def test_past_top_512_each_key_fault_moves_the_picks_at_step_0(through_l2):
    """544 entries at the last query: the clean top-512 drops 32 of them; keys missing their rope half, or three
    of every four slots empty, change which 512 are kept. The stride fault leaves the keys as written intact."""
    ids = torch.randint(3, FLASH_HEADS.vocab_size, (PAST_TOPK,), generator=torch.Generator().manual_seed(0))
    clean = _prefill_picks(through_l2, ids, None)
    width, stride = (_prefill_picks(through_l2, ids, f) for f in KEY_FAULTS)
    assert clean["L2.indexer.topk"].shape == (PAST_TOPK, 512)
    assert (clean["L2.indexer.topk"][-1] >= 0).all()  # the last query keeps 512 of its 544 entries
    assert not torch.equal(width["L2.indexer.keys"], clean["L2.indexer.keys"])
    assert torch.equal(stride["L2.indexer.keys"], clean["L2.indexer.keys"])
    for faulted in (width, stride):
        last = set(faulted["L2.indexer.topk"][-1].tolist())
        assert last != set(clean["L2.indexer.topk"][-1].tolist())
