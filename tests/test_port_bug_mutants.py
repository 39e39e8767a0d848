"""Port-bug mutants from the public record (``fidelity.studies.mutants.CATALOGUE``): what the matrix on the tiny preset
cannot show. ``tid2eid-bf16`` needs more than 257 routed experts (every smaller id is exact in bf16) and no id that
rounds past the table (384: 383 -> 384), so a small model with 385 is synthesized here and the mutant is caught at
its hash layer's routing, on the production decoder and on transformers'; the fault rules themselves are checked
against their threads' arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.faults import inject
from fidelity.decoders.production.topk import topk_width
from fidelity.decoders.transformers import FAULTS as HF_FAULTS
from fidelity.decoders.transformers import TransformersDecoder
from fidelity.model.config import ModelConfig
from fidelity.model.formats import FP8_AMAX_FLOOR, FP8_MAX, ue8m0_scale
from fidelity.model.synthesize import synthesize
from fidelity.studies.detection import gate_failures, matrix_table
from fidelity.studies.mutant_runs import MutantSettings, run_mutants
from fidelity.studies.mutants import BY_NAME

# 385 experts: ids 257..383 odd move to an even bf16 neighbour and 384 is exact, so no id leaves the range
WIDE = replace(ModelConfig.preset("tiny"), n_layers=2, n_hash_layers=1, compress_ratios=(0, 0),
               n_routed_experts=385)


@pytest.fixture(scope="module")
def wide():
    return synthesize(WIDE, seed=0)


def _first(matrix, expect: str):
    rows = matrix[(matrix["probe"] == "first") & (matrix["mutant"] == "tid2eid-bf16") & (matrix["expect"] == expect)]
    assert len(rows) == 1
    return rows.iloc[0]


def test_tid2eid_bf16_cannot_show_on_the_tiny_preset_and_is_not_run_there():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    matrix = run_mutants(ckpt, ["tid2eid-bf16"], MutantSettings(seed=0))
    assert set(matrix["mutant"]) == {"tid2eid-bf16"}  # no run at all, not even the clean decoder's
    row = _first(matrix, "cannot show")
    assert not row["detected"] and row["note"] == "8 routed experts: every id (<= 256) is exact in bf16"
    assert gate_failures(matrix) == []
    assert matrix_table(matrix)["first detection"].tolist() == [f"cannot show: {row['note']}"]
    assert BY_NAME["tid2eid-bf16"].cannot_show(replace(WIDE, n_routed_experts=257)) is not None
    assert BY_NAME["tid2eid-bf16"].cannot_show(replace(WIDE, n_routed_experts=258)) is None


def test_tid2eid_bf16_cannot_show_where_an_id_rounds_past_the_expert_table():
    """V4-Pro's 384 experts: id 383 becomes 384 in bf16, an index past the table, which every decoder fails on (a
    crash, not a fault for the probes): listed as cannot show with that reason, not run (it stopped the whole
    matrix with an IndexError before)."""
    pro = replace(WIDE, n_routed_experts=384)
    assert "id 383 becomes 384" in BY_NAME["tid2eid-bf16"].cannot_show(pro)
    matrix = run_mutants(synthesize(pro, seed=0), ["tid2eid-bf16"], MutantSettings(seed=0))
    row = _first(matrix, "cannot show")
    assert not row["detected"] and "past the expert table" in row["note"] and gate_failures(matrix) == []
    assert BY_NAME["tid2eid-bf16"].cannot_show(replace(WIDE, n_routed_experts=383)) is None  # 382 -> 382


def test_tid2eid_bf16_is_caught_at_the_hash_layers_routing_with_385_experts(wide):
    table = wide["layers.0.ffn.gate.tid2eid"]
    cast = table.to(torch.bfloat16).to(table.dtype)
    assert (cast != table).any() and bool(cast.max() < WIDE.n_routed_experts)  # ids move, none out of range
    matrix = run_mutants(wide, ["tid2eid-bf16"], MutantSettings(seed=0))
    assert gate_failures(matrix) == []
    row = _first(matrix, "caught")
    assert row["detected"] and row["located"] and row["site"] == "L0.moe.experts" and row["step"] == 0
    routing = matrix[(matrix["mutant"] == "tid2eid-bf16") & (matrix["probe"] == "routing")].iloc[0]
    assert routing["detected"] and routing["site"] == "L0.moe.experts"


def test_transformers_carries_tid2eid_bf16_at_run_time(wide):
    assert {"tid2eid-bf16", "index-topk-hardcoded"} <= set(HF_FAULTS)
    matrix = run_mutants(wide, ["tid2eid-bf16"], MutantSettings(seed=0, decode_steps=1),
                         decoder=lambda: TransformersDecoder.from_checkpoint(wide, "fp32"), known=HF_FAULTS)
    assert gate_failures(matrix) == []
    row = _first(matrix, "caught")
    assert row["located"] and row["site"] == "L0.moe.experts"


def test_ue8m0_round_after_dequantizes_with_the_rounded_up_scale():
    """The codes span +-448 with the exact scale; dequantized with the power-of-two one, each 1x64 block grows by
    s_pow2 / s_exact (sglang#28418: 1.31 on average, below 2)."""
    kv = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)).mul(3).to(torch.bfloat16)
    right = ops.kv_round(kv, 64, "fp8")
    with inject("ue8m0-round-after"):
        wrong = ops.kv_round(kv, 64, "fp8")
    assert torch.equal(wrong[:, -64:], kv[:, -64:])  # rope dims untouched
    blocks = kv[:, :448].float().unflatten(-1, (7, 64))
    amax = blocks.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR)
    growth = ue8m0_scale(amax, FP8_MAX, FP8_AMAX_FLOOR) / (amax / FP8_MAX)
    assert bool((growth >= 1).all() and (growth < 2).all() and (growth > 1.01).any())
    top = wrong[:, :448].float().unflatten(-1, (7, 64)).abs().amax(-1)
    assert torch.equal(top, FP8_MAX * ue8m0_scale(amax, FP8_MAX, FP8_AMAX_FLOOR))  # the max code 448, scaled up
    assert not torch.equal(wrong, right)


def test_index_topk_hardcoded_doubles_the_width_everywhere_it_is_read():
    assert topk_width(32) == 32
    with inject("index-topk-hardcoded"):
        assert topk_width(32) == 64
