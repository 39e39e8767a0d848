"""The indexer recall study (``fidelity.studies.recall``): definitions on hand-checkable tensors, and a small real run
on the trained default (1024 tokens, k 8 and 32) for self-recall, bounds, causality and the CLI."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from fidelity.cli import main
from fidelity.model.default import default_checkpoint
from fidelity.model.load import load_checkpoint
from fidelity.studies import recall
from oracles.model import OracleModel

CONTEXT, TOPKS = 1024, (8, 32)


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_checkpoint())


@pytest.fixture(scope="module")
def inputs(ckpt):
    ids, _ = recall.context_ids(ckpt, CONTEXT)
    return recall.collect_inputs(OracleModel(ckpt), ids, recall.query_positions(CONTEXT, 24), chunk=512)


@pytest.fixture(scope="module")
def study(ckpt):
    return recall.run_study(ckpt, [CONTEXT], TOPKS, ["fp32", "bf16", "fp4", "fp4-packed"], queries=24, chunk=512)


def test_tie_aware_recall_forgives_only_picks_that_tie_the_kth_exact_score():
    scores = torch.tensor([[5.0, 3.0, 3.0, 1.0]])
    ref = torch.tensor([[0, 1]])  # the exact top-2, ties to the lower id
    tied, wrong = torch.tensor([[0, 2]]), torch.tensor([[0, 3]])
    assert recall.set_recall(tied, ref, 4).item() == 0.5
    assert recall.tie_recall(tied, ref, scores).item() == 1.0  # entry 2 scores 3.0 == the k-th score
    assert recall.tie_recall(wrong, ref, scores).item() == 0.5  # entry 3 scores below it
    assert recall.set_recall(torch.tensor([[-1, -1]]), torch.tensor([[-1, -1]]), 4).item() == 1.0  # nothing to find


def test_mass_recall_is_the_share_of_the_reference_mass_kept():
    ref, mass = torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    assert recall.mass_recall(ref, ref, mass, 5).item() == pytest.approx(1.0)
    assert recall.mass_recall(torch.tensor([[1, 4, -1, -1]]), ref, mass, 5).item() == pytest.approx(0.3)
    assert recall.mass_recall(torch.tensor([[3, 4, -1, -1]]), ref, mass, 5).item() == 0.0


def test_selection_mass_is_a_share_of_one_softmax_with_window_and_sink():
    win = torch.tensor([[[0.0, -torch.inf]]])  # one head, one valid window row
    ent = torch.tensor([[[1.0, 2.0, 3.0]]])
    sink = torch.tensor([0.5])
    mass = recall.selection_mass(win, ent, sink, torch.tensor([[2, 0, -1]]))
    z = 1 + torch.e**3 + torch.e + torch.e**0.5
    assert torch.allclose(mass, torch.tensor([[torch.e**3 / z, torch.e / z, 0.0]]), rtol=1e-6)


def test_the_exact_path_recalls_itself_and_every_metric_lies_in_0_1(study):
    q = study.queries
    exact = q[q["precision"] == "fp32"]
    assert len(exact) == 2 * len(TOPKS) * 24  # two CSA layers, 24 queries each
    for col in ("recall", "recall_tie", "mass_recall"):
        assert (exact[col] == 1.0).all(), col
    for col in ("recall", "recall_tie", "recall_bf16", "recall_bf16_tie", "mass_recall", "dense_share"):
        assert q[col].between(0.0, 1.0 + 1e-12).all(), col
    assert (q["recall_tie"] >= q["recall"]).all()
    assert (q[q["precision"] == "bf16"]["recall_bf16"] == 1.0).all()
    assert (q["k_eff"] == q["visible"].clip(upper=q["k"])).all() and q["selective"].any() and (~q["selective"]).any()
    assert set(study.misses["precision"]) <= {"bf16", "fp4", "fp4-packed"}  # the exact path misses nothing
    assert (study.misses["margin"] >= 0).all() and (study.misses["distance"] >= 0).all()


def test_packed_fp4_keys_score_bit_for_bit_as_the_fp4_rows(inputs):
    for inp in inputs.values():
        assert torch.equal(recall.precision_scores(inp, "fp4"), recall.precision_scores(inp, "fp4-packed"))


def test_no_precision_selects_an_entry_at_or_past_t_plus_1_over_4(inputs):
    for inp in inputs.values():
        limit = (inp.positions + 1) // 4
        for p in recall.PRECISIONS:
            scores = recall.precision_scores(inp, p)
            j = torch.arange(scores.shape[1])[None]
            assert (scores[j >= limit[:, None]] == float("-inf")).all(), p
            for k in TOPKS:
                picks = recall.select(scores, inp.positions, k, exact=p == "fp32")
                assert (picks < limit[:, None]).all(), (p, k)
                assert ((picks >= 0).sum(1) == limit.clamp(max=k)).all(), (p, k)  # min(k, visible) picks


def test_chunked_oracle_prefill_gives_the_same_inputs(ckpt, inputs):
    ids, _ = recall.context_ids(ckpt, CONTEXT)
    positions = recall.query_positions(CONTEXT, 24)
    whole = recall.collect_inputs(OracleModel(ckpt), ids, positions, chunk=CONTEXT)
    for i, inp in inputs.items():
        for name in ("index_q", "index_w", "keys", "attn_q", "kv", "entries"):
            assert torch.allclose(getattr(inp, name), getattr(whole[i], name), rtol=1e-4, atol=1e-5), (i, name)


def test_query_positions_spread_over_the_context_and_every_block_phase():
    pos = recall.query_positions(16384, 256)
    assert len(pos) == 256 and pos.max() < 16384 and pos.min() >= 0
    assert set((pos % 4).tolist()) == {0, 1, 2, 3}
    assert (pos[1:] - pos[:-1]).max() <= 2 * 16384 // 256


@pytest.mark.parametrize(("args", "field"), [
    (dict(contexts=[1 << 21], topks=[32], precisions=["fp4"]), "context: expected an integer in [8, 1048576]"),
    (dict(contexts=[1024], topks=[0], precisions=["fp4"]), "topk: expected positive integers, found 0"),
    (dict(contexts=[1024], topks=[32], precisions=["fp2"]), "precision: expected some of"),
])
def test_bad_requests_name_the_field_expected_and_found(ckpt, args, field):
    with pytest.raises(recall.RecallError, match=field.replace("[", r"\[").replace("]", r"\]")):
        recall.check_request(ckpt.config, args["contexts"], args["topks"], args["precisions"], 16)


def test_cli_writes_the_table_and_files_and_refuses_bad_inputs(tmp_path, capsys):
    out = tmp_path / "recall"
    rc = main(["recall", "--contexts", "512", "--topk", "8", "--precisions", "fp4", "bf16", "--queries", "8",
               "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "| 512 | fp4 | 8 |" in text
    for name in ("recall.json", "summary.csv", "summary_pooled.csv", "misses.csv", "queries.csv.gz", "recall.png",
                 "report.md", "report.html"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text()
    assert md.index("## Headline\n\nfp4 at k 8, context 512: recall ") < md.index("## Run") < md.index("## Plots")
    page = (out / "report.html").read_text()
    assert "<style>" in page and ">nan<" not in page and "data:image/png;base64," in page
    assert main(["recall", "--contexts", "512", "--topk", "-1", "--out", str(out)]) == 2
    assert "topk: expected positive integers, found -1" in capsys.readouterr().err
    assert main(["recall", "--contexts", "512", "--precisions", "int3", "--out", str(out)]) == 2
    assert "precision: expected some of" in capsys.readouterr().err


def test_recall_floors_follow_the_runs_top_k():
    from fidelity.harness.thresholds import RECALL_FLOOR, default_thresholds, recall_floor

    assert recall_floor("quantized") == RECALL_FLOOR["quantized"] == recall_floor("quantized", 32) == 10 / 32
    assert recall_floor("quantized", 512) == recall_floor("quantized", 600) == 319 / 512  # largest studied k <= 600
    assert recall_floor("quantized", 16) == 10 / 32 and recall_floor("bf16", 1024) == 0.85
    floors = [t.value for t in default_thresholds("reference", [2, 4], index_topk=1024) if t.metric == "recall"]
    assert floors == [700 / 1024]


def test_recall_floors_follow_the_runs_context():
    from fidelity.harness.thresholds import default_thresholds, recall_floor

    assert recall_floor("quantized", 512, 4096) == recall_floor("quantized", 512, 65536) == 319 / 512
    assert recall_floor("quantized", 512, 65537) == recall_floor("quantized", 512, 262144) == 53 / 512
    assert recall_floor("quantized", 512, 1 << 20) == 53 / 512  # past the longest studied context: its floors
    assert recall_floor("bf16", 32, 1 << 20) == 0.85

    def floors(**kw):
        return [t.value for t in default_thresholds("reference", [2, 4], **kw) if t.metric == "recall"]

    assert floors(index_topk=32, context=2000) == [10 / 32]
    assert floors(index_topk=32, context=200_000) == []  # a clean FP4 indexer can miss a whole top-32 at 256K


def test_a_long_runs_recall_floor_comes_from_its_prompt_and_decode_length():
    """``rules_for`` with the run's context (what ``run_job`` and the mutant runs pass) and the defaults a stored
    run is re-judged with (``run_rules``, from its manifest's prompt_len + decode_steps) pick the same band."""
    from fidelity.harness.judgement import rules_for, run_rules
    from fidelity.model.config import ModelConfig

    cfg = ModelConfig.preset("tiny")

    def recall(rules):
        return [t.value for t in rules if t.metric == "recall"]

    assert recall(rules_for("reference", cfg, context=1000)) == [10 / 32]
    assert recall(rules_for("reference", cfg, context=100_000)) == []
    manifest = {"profile": "reference", "config": cfg.to_official_dict(), "prompt_len": 100_000, "decode_steps": 8}
    assert recall(run_rules(manifest, pd.DataFrame())[0]) == []
