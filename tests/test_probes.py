"""Known-answer tests of the probes (docs/design.md "Probes") on hand-built inputs."""

import math

import pytest
import torch

from oracles.attention import hca_entries, window_positions
from probes import (
    collect,
    collect_columns,
    expected_visible,
    gate_range,
    indexer_recall,
    memory_stats,
    residual_norms,
    similarity,
    similarity_per_position,
    sinkhorn,
    to_rows,
    token_agreement,
    unravel,
    visible_range,
)

F32, F64, I64 = torch.float32, torch.float64, torch.int64
INF = float("inf")


def vals(metrics: dict) -> dict:
    """0-d metric tensors -> Python numbers (test side only)."""
    return {k: v.item() for k, v in metrics.items()}


# ---- similarity -------------------------------------------------------------------------------------------


def test_identical_tensors_give_perfect_scores_and_infinite_sqnr():
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    m = vals(similarity(x, x.clone()))
    assert m["cos"] == pytest.approx(1.0) and m["calc_diff"] == pytest.approx(0.0, abs=1e-15)
    assert m["rel_l2"] == 0 and m["max_abs"] == 0 and m["max_abs_index"] == -1
    assert m["sqnr_db"] == INF  # documented: zero error -> +inf
    assert m["nonfinite_mismatch"] == 0 and m["nonfinite_first"] == -1 and m["compared"] == 60


def test_similarity_known_values_and_worst_coordinate():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    test = torch.tensor([[3.0, 4.5], [0.0, 0.0]])
    m = vals(similarity(ref, test))
    assert m["rel_l2"] == pytest.approx(0.1) and m["sqnr_db"] == pytest.approx(20.0)
    assert m["max_abs"] == pytest.approx(0.5) and unravel(m["max_abs_index"], ref.shape) == (0, 1)
    assert m["calc_diff"] == pytest.approx(1 - 2 * 27.0 / (25 + 29.25))  # <x,y> = 9 + 18
    orth = vals(similarity(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])))
    assert orth["cos"] == 0 and orth["calc_diff"] == 1
    zeros = vals(similarity(torch.zeros(3), torch.zeros(3)))
    assert zeros["cos"] == 1 and zeros["calc_diff"] == 0 and zeros["sqnr_db"] == INF


def test_planted_nan_and_neg_inf_are_reported_at_their_coordinate_and_numbers_stay_finite():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(3, 4, 5, generator=g, dtype=F32)
    test = ref + 1e-3 * torch.randn(3, 4, 5, generator=g, dtype=F32)
    test[1, 2, 3] = float("nan")
    test[2, 0, 1] = -INF
    m = vals(similarity(ref, test.to(torch.bfloat16)))
    assert m["nonfinite_mismatch"] == 2 and m["test_nonfinite"] == 2 and m["compared"] == 58
    assert unravel(m["nonfinite_first"], ref.shape) == (1, 2, 3)
    for k in ("cos", "calc_diff", "rel_l2", "max_abs", "sqnr_db"):
        assert math.isfinite(m[k]), k
    assert m["cos"] > 0.999


def test_matching_nonfinite_patterns_agree_and_sign_of_inf_matters():
    ref = torch.tensor([float("nan"), INF, -INF, 1.0])
    assert similarity(ref, ref.clone())["nonfinite_mismatch"].item() == 0
    flipped = torch.tensor([float("nan"), -INF, -INF, 1.0])
    m = vals(similarity(ref, flipped))
    assert m["nonfinite_mismatch"] == 1 and m["nonfinite_first"] == 1 and m["max_abs"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_the_cpu_all_finite_shortcut_gives_the_masked_paths_values_and_metrics_bit_for_bit(dtype):
    from probes.similarity import _finite_pair, _masked_pair

    g = torch.Generator().manual_seed(0)
    ref = (torch.randn(7, 3, 16, generator=g) * 100).to(dtype)
    test = (ref.double() + torch.randn(7, 3, 16, generator=g, dtype=torch.float64)).to(dtype)
    ref.view(-1)[5] = -0.0 if dtype.is_floating_point else 0
    ref, test = ref.reshape(7, 48), test.reshape(7, 48)  # seven pairs, flattened
    fast, masked = _finite_pair(ref, test), _masked_pair(ref, test)
    for a, b in zip(fast[:2], masked[:2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
    assert fast[2].keys() == masked[2].keys()
    for name, value in fast[2].items():
        assert value.dtype == masked[2][name].dtype and torch.equal(value, masked[2][name]), name


def test_a_nonfinite_coordinate_on_the_cpu_takes_the_masked_path():
    ref, test = torch.ones(4), torch.ones(4)
    test[2] = float("nan")
    out = similarity(ref, test)
    assert out["nonfinite_mismatch"] == 1 and out["nonfinite_first"] == 2 and out["compared"] == 3


def test_similarity_per_position_gives_one_value_per_token():
    ref = torch.ones(4, 2, 3)
    test = ref.clone()
    test[2, 1, 0] = 3.0
    test[3, 0, 0] = float("nan")
    m = similarity_per_position(ref, test)
    assert all(v.shape == (4,) for v in m.values())
    assert m["max_abs"].tolist() == [0, 0, 2, 0] and m["nonfinite_mismatch"].tolist() == [0, 0, 0, 1]
    assert m["cos"][[0, 1, 3]].tolist() == [1, 1, 1] and m["cos"][2] < 1


# ---- mHC Sinkhorn -----------------------------------------------------------------------------------------


def _doubly_stochastic_non_symmetric() -> torch.Tensor:
    cyclic = torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=F64)
    return (0.6 * cyclic + 0.3 * torch.eye(3, dtype=F64) + 0.1 / 3).expand(2, 3, 3).clone()


def test_transposed_comb_is_caught_by_orientation_not_by_sums():
    ref = _doubly_stochastic_non_symmetric()
    test = ref.transpose(-1, -2)
    m = vals(sinkhorn(test, ref))
    assert m["row_dev"] < 1e-12 and m["col_dev"] < 1e-12 and m["negative_count"] == 0
    assert m["orientation_flip"] == 1 and m["transposed_err"] == 0 and m["orientation_err"] == pytest.approx(0.6)
    same = vals(sinkhorn(ref.clone(), ref))
    assert same["orientation_flip"] == 0 and same["orientation_err"] == 0


def test_sinkhorn_reports_sum_deviation_and_negatives():
    comb = _doubly_stochastic_non_symmetric()
    comb[1, 0, 0] -= 0.2
    m = vals(sinkhorn(comb))
    assert m["row_dev"] == pytest.approx(0.2) and m["col_dev"] == pytest.approx(0.2)
    assert m["negative_count"] == 0 and "orientation_flip" not in m
    comb[0, 2, 2] = -0.5
    m = vals(sinkhorn(comb))
    assert m["negative_count"] == 1 and m["min_value"] == -0.5


def test_gate_range_measures_how_far_pre_and_post_leave_their_ranges():
    post = torch.tensor([[0.0, 2.0, 1.0, 0.5]], dtype=F32)
    assert vals(gate_range(post, 0.0, 2.0))["range_excess"] == 0
    post[0, 1] = 2.25
    assert vals(gate_range(post, 0.0, 2.0))["range_excess"] == 0.25
    pre = torch.tensor([[0.5, -0.125, 1.0, 0.25]], dtype=torch.bfloat16)
    assert vals(gate_range(pre, 0.0, 1.0 + 1e-6))["range_excess"] == 0.125
    pre[0, 0] = float("nan")
    assert vals(gate_range(pre, 0.0, 1.0 + 1e-6))["range_excess"] == INF
    assert vals(gate_range(torch.zeros(0, 4), 0.0, 2.0))["range_excess"] == 0


# ---- residual norms ---------------------------------------------------------------------------------------


def test_residual_norms_per_stream():
    streams = torch.arange(1.0, 5.0)[None, :, None].expand(3, 4, 8) * torch.tensor([1.0, -1.0]).repeat(4)
    m = residual_norms(streams)
    assert [m[f"rms_stream{k}"].item() for k in range(4)] == [1, 2, 3, 4] and m["rms_max"].item() == 4
    assert m["rms"].item() == pytest.approx(7.5 ** 0.5)  # over every stream: sqrt((1 + 4 + 9 + 16) / 4)
    per = residual_norms(streams, per_position=True)
    assert per["rms_stream2"].tolist() == [3, 3, 3] and per["rms"].tolist() == pytest.approx([7.5 ** 0.5] * 3)
    assert sorted(residual_norms(streams, prefix="ref_")) == ["ref_rms", "ref_rms_max"] + [
        f"ref_rms_stream{k}" for k in range(4)]


# ---- indexer recall ---------------------------------------------------------------------------------------


def test_identical_sets_give_recall_one():
    scores = torch.tensor([[5.0, 4, 3, 2, -INF], [1.0, 2, 3, 4, 5]])
    ref = torch.tensor([[0, 1, 2], [4, 3, 2]])
    m = vals(indexer_recall(ref.clone(), ref, scores))
    assert m["recall"] == 1 and m["hits"] == 6 and m["true_miss"] == 0 and m["near_tie_miss"] == 0
    assert m["first_true_miss_query"] == -1 and m["rank_disp_max"] == 0
    assert vals(indexer_recall(ref.flip(-1), ref, scores))["recall"] == 1  # order does not matter


def test_size_mismatch_counts_the_queries_whose_number_of_picks_is_not_the_oracles():
    scores = torch.arange(8.0).repeat(3, 1)
    ref = torch.tensor([[7, 6, -1], [7, 6, -1], [7, 6, -1]])
    test = torch.tensor([[7, 6, 5, 4], [5, 4, -1, -1], [6, 6, 7, -1]])  # wider; other picks, same count; a repeat
    out = indexer_recall(test, ref, scores)
    assert out["size_mismatch"] == 1 and out["recall"] == pytest.approx(2 / 3)


def test_misses_split_into_near_ties_and_true_misses():
    scores = torch.tensor([[5.0, 4, 3, 2.9, 1, -INF], [9.0, 8, 7, 6, 5, 4]])
    ref = torch.tensor([[0, 1, 2], [0, 1, 2]])
    test = torch.tensor([[0, 1, 2], [1, 3, 4]])  # query 1 misses 0 (gap 2/7) and 2 (exact kth)
    m = vals(indexer_recall(test, ref, scores, margin=0.1))
    assert m["recall"] == pytest.approx((1 + 1 / 3) / 2)
    assert m["near_tie_miss"] == 1 and m["true_miss"] == 1 and m["first_true_miss_query"] == 1
    assert m["near_tie_extra"] == 0 and m["true_extra"] == 2  # 6 and 5 are > 10% below kth 7
    loose = vals(indexer_recall(test, ref, scores, margin=0.5))
    assert loose["near_tie_miss"] == 2 and loose["true_miss"] == 0 and loose["first_true_miss_query"] == -1


def test_exact_zero_score_ties_are_near_ties_even_with_zero_margin():
    scores = torch.tensor([[2.0, 0, 0, 0, -INF]])  # ReLU zeros: three entries tie at 0
    ref, test = torch.tensor([[0, 1, -1]]), torch.tensor([[0, 3, -1]])
    m = vals(indexer_recall(test, ref, scores, margin=0.0))
    assert m["near_tie_miss"] == 1 and m["true_miss"] == 0 and m["near_tie_extra"] == 1 and m["recall"] == 0.5
    assert m["rank_disp_max"] == 0  # entry 3 sits inside the tie interval of ranks 1..3


def test_rank_displacement_hand_example_and_invisible_picks():
    scores = torch.tensor([[10.0, 9, 8, 7, -INF]])
    ref = torch.tensor([[0, 1, 2]])
    m = vals(indexer_recall(torch.tensor([[2, 0, 1]]), ref, scores))
    # test ranks 0, 1, 2 vs oracle ranks 2, 0, 1 -> displacements 2, 1, 1
    assert m["rank_disp_mean"] == pytest.approx(4 / 3) and m["rank_disp_max"] == 2 and m["ranked"] == 3
    bad = vals(indexer_recall(torch.tensor([[0, 1, 4]]), ref, scores))
    assert bad["test_invisible"] == 1 and bad["true_extra"] == 1 and bad["ranked"] == 2


def test_empty_reference_sets_give_vacuous_recall():
    scores = torch.full((2, 3), -INF)
    none = torch.full((2, 2), -1)
    m = vals(indexer_recall(none, none, scores))
    assert m["recall"] == 1 and m["recall_queries"] == 0 and m["true_miss"] == 0


# ---- visible range ----------------------------------------------------------------------------------------

POS = torch.tensor([0, 126, 127, 128, 300])


def test_expected_visible_matches_the_oracle_layout():
    pos = torch.arange(0, 600, 37)
    hca = torch.cat((window_positions(pos, 128), hca_entries(pos, 128, 4)), dim=1)
    assert torch.equal(expected_visible(pos, 128, 128, None, 4), hca)
    picks = torch.tensor([[3, 1, -1]]).expand(len(pos), 3)
    assert torch.equal(expected_visible(pos, 128, 4, picks, 0)[:, 128:], picks)
    assert expected_visible(pos, 128, 0, None, 0).shape == (len(pos), 128)


def test_identical_visible_sets_report_nothing():
    ref = expected_visible(POS, 128, 4, None, 20)
    m = vals(visible_range(ref.clone(), ref, POS, 128))
    assert m["missing"] == 0 and m["extra"] == 0 and m["first_query"] == -1 and m["first_kind"] == -1


@pytest.mark.parametrize("layout_width", [127, 128])
def test_window_of_127_misses_exactly_t_minus_127(layout_width):
    ref = expected_visible(POS, 128, 0, None, 0)
    test = expected_visible(POS, 127, 0, None, 0)
    if layout_width == 128:
        test = torch.nn.functional.pad(test, (1, 0), value=-1)
    m = vals(visible_range(test, ref, POS, 128, test_window=layout_width))
    assert m["missing_window"] == 3 and m["extra"] == 0 and m["bad_queries"] == 3  # t = 127, 128, 300
    assert (m["first_row"], m["first_query"], m["first_kind"], m["first_kv"]) == (2, 127, 0, 0)


def test_window_excluding_self_misses_t_and_adds_t_minus_128():
    ref = expected_visible(POS, 128, 0, None, 0)
    test = ref - 1
    test[test < 0] = -1
    m = vals(visible_range(test, ref, POS, 128))
    assert m["missing_window"] == 5 and m["extra_window"] == 2  # extra 0 (t=128) and 172 (t=300)
    assert (m["first_query"], m["first_kind"], m["first_kv"]) == (0, 0, 0)


def test_compressed_off_by_one_adds_entry_t_plus_1_div_ratio():
    pos = torch.tensor([0, 2, 3, 6, 7, 40])  # (t+1)//4 = 0, 0, 1, 1, 2, 10
    ref = expected_visible(pos, 8, 4, None, 3)
    j = torch.arange(3)
    test = torch.cat((ref[:, :8], torch.where(j <= ((pos + 1) // 4)[:, None], j, -1)), dim=1)
    m = vals(visible_range(test, ref, pos, 8))
    assert m["extra_compressed"] == 5 and m["missing"] == 0 and m["extra_window"] == 0
    assert (m["first_row"], m["first_kind"], m["first_kv"]) == (0, 3, 0)


def test_first_offender_orders_by_query_then_kind_then_kv():
    pos = torch.tensor([10, 11])
    ref = expected_visible(pos, 4, 4, torch.tensor([[0, 1], [2, 0]]), 0)
    test = ref.clone()
    test[1, 0] = 5  # extra window token 5 for query 11 (it replaced 8: also a missing window)
    test[1, 4] = -1  # missing compressed entry 2
    m = vals(visible_range(test, ref, pos, 4))
    assert m["missing_window"] == 1 and m["missing_compressed"] == 1 and m["extra_window"] == 1
    assert (m["first_row"], m["first_query"], m["first_kind"], m["first_kv"]) == (1, 11, 0, 8)
    test[1, 0] = 8
    m = vals(visible_range(test, ref, pos, 4))
    assert (m["first_query"], m["first_kind"], m["first_kv"]) == (11, 1, 2)


# ---- tokens and memory ------------------------------------------------------------------------------------


def test_token_agreement_margins_and_rank():
    ref = torch.tensor([1.0, 5.0, 3.0, 0.0])
    test = torch.tensor([1.0, 4.0, 4.5, 4.2])
    m = vals(token_agreement(test, ref))
    assert m["agree"] == 0 and m["ref_token"] == 1 and m["test_token"] == 2
    assert m["ref_margin"] == 2 and m["test_margin"] == pytest.approx(0.3) and m["test_rank_of_ref_token"] == 2
    assert vals(token_agreement(ref, ref))["agree"] == 1
    batched = token_agreement(torch.stack((test, ref)), torch.stack((ref, ref)))
    assert batched["agree"].tolist() == [0, 1]


def test_memory_stats_on_cpu_reports_process_rss():
    m = memory_stats("cpu")
    assert set(m) == {"allocated_bytes", "reserved_bytes", "memory_supported", "memory_is_rss"}
    assert all(v.ndim == 0 and v.dtype == I64 for v in m.values())
    assert m["memory_supported"].item() == 0 or m["allocated_bytes"].item() > 0


# ---- device contract and rows -----------------------------------------------------------------------------


def _probe_inputs(device: str) -> dict[str, tuple]:
    """Arguments of every probe, built on the CPU and moved to ``device`` (the copy itself may sync)."""
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    pos = torch.arange(20, 28).to(device)
    picks = torch.tensor([[0, 2, 1, -1]] * 8).to(device)
    vis = expected_visible(pos, 4, 4, picks, 0)
    return {
        "similarity": (r(8, 3, 5), r(8, 3, 5)),
        "similarity_per_position": (r(8, 3, 5), r(8, 3, 5)),
        "sinkhorn": (r(8, 4, 4), r(8, 4, 4)),
        "residual_norms": (r(8, 4, 16),),
        "indexer_recall": (picks.flip(-1), picks, r(8, 6), 0.01),
        "visible_range": (vis.flip(-1), vis, pos, 4),
        "token_agreement": (r(50), r(50)),
    }


def _all_probe_calls(device: str, inputs: dict[str, tuple] | None = None) -> list[tuple[str, dict]]:
    inputs = _probe_inputs(device) if inputs is None else inputs
    probes = {"similarity": similarity, "similarity_per_position": similarity_per_position, "sinkhorn": sinkhorn,
              "residual_norms": residual_norms, "indexer_recall": indexer_recall, "visible_range": visible_range,
              "token_agreement": token_agreement}
    return [(name, probes[name](*args)) for name, args in inputs.items()]


def test_probes_never_read_values_back_meta_tensors_have_none():
    """Meta tensors carry no data: any .item() / .tolist() / bool() in a probe would raise here."""
    for name, metrics in _all_probe_calls("meta"):
        for k, v in metrics.items():
            assert isinstance(v, torch.Tensor) and v.device.type == "meta", (name, k)


def test_probes_return_0d_tensors_on_the_input_device():
    for name, metrics in _all_probe_calls("cpu"):
        want = 1 if name == "similarity_per_position" else 0
        assert all(isinstance(v, torch.Tensor) and v.ndim == want for v in metrics.values()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_probes_do_not_sync_on_cuda():
    inputs = _probe_inputs("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls = _all_probe_calls("cuda", inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.is_cuda for _, m in calls for v in m.values())
    mem = memory_stats("cuda")
    assert mem["memory_supported"].item() == 1 and mem["allocated_bytes"].item() > 0
    cpu_rows = collect(p for name, m in _all_probe_calls("cpu") for p in to_rows(name, 0, m))
    cuda_rows = collect(p for name, m in calls for p in to_rows(name, 0, m))
    assert [r["metric"] for r in cuda_rows] == [r["metric"] for r in cpu_rows]
    for c, g in zip(cpu_rows, cuda_rows, strict=True):  # same inputs -> same metrics on both devices
        assert g["value"] == pytest.approx(c["value"], rel=1e-9, abs=1e-12, nan_ok=True), (g["site"], g["metric"])


def test_collect_does_one_transfer_and_builds_tidy_rows(monkeypatch):
    transfers = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        transfers.append(self.shape)
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    pending = []
    for name, metrics in _all_probe_calls("cpu"):
        pending += to_rows(name, 3, metrics, positions=torch.arange(100, 108))
    assert transfers == []  # labelling does not transfer
    rows = collect(pending, step=2)
    assert len(transfers) == 1
    assert set(rows[0]) == {"site", "layer", "position", "metric", "value", "step"}
    per_pos = [r for r in rows if r["site"] == "similarity_per_position" and r["metric"] == "cos"]
    assert [r["position"] for r in per_pos] == list(range(100, 108))
    agg = next(r for r in rows if r["metric"] == "first_true_miss_query")
    assert agg["position"] == -1 and agg["layer"] == 3 and isinstance(agg["value"], float)


def test_collect_columns_hold_collects_rows_with_each_rows_own_extra_fields():
    import pandas as pd

    pending = []
    for name, metrics in _all_probe_calls("cpu"):
        pending += to_rows(name, 3, metrics, positions=torch.arange(100, 108))
    pending[5]["extra"] = {"rank": 1, "ranks": 2}  # a rank's row, as site_pairs.rank_rows makes them
    pending[9]["extra"] = {"step": 7}  # a row tagged with its own call
    want = pd.DataFrame(collect(pending, mode="free"))
    got = pd.DataFrame(collect_columns(pending, mode="free"))
    assert list(got.columns) == list(want.columns) and len(got) == len(want) > 50
    pd.testing.assert_frame_equal(got, want)


def test_pair_rows_collect_as_one_whole_call_row_per_pair_with_its_own_fields():
    import pandas as pd

    from probes.rows import PairRows

    value = torch.tensor([0.5, 0.25, 2.0])
    sites, layers, extras = ["L0.attn.q", "L1.attn.q", "L1.attn.q"], [0, 1, 1], [{"step": 3}, None, {"rank": 1}]
    lead = to_rows("logits", -1, {"cos": torch.tensor([1.0, 0.5])}, positions=[7, 8])
    got = pd.DataFrame(collect_columns([*lead, PairRows(sites, layers, "cos", value, extras)], mode="op"))
    rows = [*lead, *({"site": s, "layer": la, "metric": "cos", "value": v, "position": None,
                      **({"extra": e} if e else {})} for s, la, v, e in zip(sites, layers, value, extras, strict=True))]
    want = pd.DataFrame(collect(rows, mode="op"))
    pd.testing.assert_frame_equal(got, want)
    assert list(got["position"]) == [7, 8, -1, -1, -1] and list(got["step"].iloc[2:].fillna(-1)) == [3, -1, -1]


def test_routing_gap_is_the_oracle_score_gap_a_flip_inverts_and_infinite_without_scores():
    from probes.routing import routing_agreement

    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0], [1.0, 1.0, 0.5, 0.0]])
    ref = torch.tensor([[0, 1], [0, 1]])
    near = routing_agreement(torch.tensor([[0, 2], [0, 1]]), ref, scores)  # 4 -> 3 of max 5: 0.2
    assert float(near["routing_gap"]) == pytest.approx(0.2) and int(near["routing_flips"]) == 1
    assert float(routing_agreement(torch.tensor([[1, 0], [1, 0]]), ref, scores)["routing_gap"]) == 0
    assert float(routing_agreement(torch.tensor([[0, 2], [0, 1]]), ref)["routing_gap"]) == float("inf")  # hash
    fewer = routing_agreement(torch.tensor([[0], [0]]), ref, scores)  # an expert dropped for nothing
    assert float(fewer["routing_gap"]) == float("inf") and float(fewer["routing_agree"]) == 0


def test_miss_gap_measures_how_far_below_the_boundary_the_picks_reach():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, float("-inf")]])
    ref = torch.tensor([[0, 1, 2]])
    assert float(indexer_recall(torch.tensor([[0, 1, 3]]), ref, scores)["miss_gap"]) == pytest.approx(0.2)
    assert float(indexer_recall(torch.tensor([[0, 1, 2]]), ref, scores)["miss_gap"]) == 0
    assert float(indexer_recall(torch.tensor([[0, 1, -1]]), ref, scores)["miss_gap"]) == float("inf")
    assert float(indexer_recall(torch.tensor([[0, 1, 5]]), ref, scores)["miss_gap"]) == float("inf")  # invisible
