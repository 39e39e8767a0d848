"""Known-answer tests of the oracle's op functions (spec §3-§4)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fidelity.model.config import ModelConfig
from oracles import attention as attn
from oracles.compressor import CompressorState, CompressorWeights, compress
from oracles.indexer import index_scores, select_topk, stable_topk_indices
from oracles.mhc import hc_post, hc_split, sinkhorn
from oracles.moe import gate
from oracles.rope import apply_rope, inv_freq, yarn_correction_range

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)


@pytest.fixture(autouse=True)
def _float64_by_default():
    """The known answers are written in float64; restore the default for the other test modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_sinkhorn_twenty_iterations_are_doubly_stochastic_and_end_column_normalised():
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0))
    comb = sinkhorn(logits, 20, 1e-6)
    cols, rows = comb.sum(-2), comb.sum(-1)
    assert torch.allclose(cols, torch.ones_like(cols), atol=1e-5)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-3)
    # peaky logits converge more slowly: 20 iterations leave rows ~1% off (what the probes must tolerate)
    peaky = sinkhorn(logits * 3, 20, 1e-6)
    assert (peaky.sum(-1) - 1).abs().max() < 2e-2
    assert (comb > 0).all()


def test_sinkhorn_one_iteration_is_softmax_plus_eps_then_column_division():
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    eps = 1e-6
    expect = logits.softmax(-1) + eps
    expect = expect / (expect.sum(-2, keepdim=True) + eps)
    assert torch.equal(sinkhorn(logits, 1, eps), expect)


def test_hc_split_uses_scale_per_group_and_two_sigmoid_post():
    hc = 4
    mixes = torch.randn(3, (2 + hc) * hc, generator=torch.Generator().manual_seed(2))
    scale, base = torch.tensor([0.5, 2.0, 1.5]), torch.randn((2 + hc) * hc, generator=torch.Generator().manual_seed(3))
    pre, post, comb = hc_split(mixes, scale, base, hc, 20, 1e-6)
    assert torch.allclose(pre, torch.sigmoid(mixes[:, :4] * 0.5 + base[:4]) + 1e-6)
    assert torch.allclose(post, 2 * torch.sigmoid(mixes[:, 4:8] * 2.0 + base[4:8]))
    assert torch.allclose(comb, sinkhorn((mixes[:, 8:] * 1.5 + base[8:]).view(3, 4, 4), 20, 1e-6))


def test_hc_post_applies_comb_transposed():
    residual = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(4))
    comb = torch.zeros(1, 4, 4)
    comb[0, 0, 1] = 1.0  # C[j=0, k=1]: stream 1 receives residual stream 0
    out = hc_post(torch.zeros(1, 8), residual, torch.zeros(1, 4), comb)
    assert torch.equal(out[0, 1], residual[0, 0])
    assert torch.equal(out[0, 0], torch.zeros(8))


def test_window_holds_128_positions_including_self():
    win = attn.window_positions(torch.tensor([0, 5, 127, 200]), 128)
    assert win.shape == (4, 128)
    assert win[0].tolist() == [-1] * 127 + [0]
    assert win[1, -6:].tolist() == [0, 1, 2, 3, 4, 5] and (win[1, :-6] == -1).all()
    assert win[2].tolist() == list(range(128))
    assert win[3].tolist() == list(range(73, 201))


def test_compressed_entry_visible_only_once_its_block_is_complete():
    # j < (t+1)//r: the block ending at t counts, a block still open does not.
    ent = attn.hca_entries(torch.tensor([126, 127, 254, 255]), 128, 2)
    assert ent.tolist() == [[-1, -1], [0, -1], [0, -1], [0, 1]]


def test_topk_marks_invisible_picks_and_padding_minus_one():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0]]).repeat(2, 1)
    positions = torch.tensor([7, 15])  # 2 and 4 visible entries at ratio 4
    masked = scores.masked_fill(torch.arange(4)[None] >= ((positions + 1) // 4)[:, None], float("-inf"))
    picks = select_topk(masked, positions, 4, 6)
    assert picks[0].tolist() == [0, 1, -1, -1, -1, -1]
    assert picks[1].tolist() == [0, 1, 2, 3, -1, -1]


def test_index_score_is_weighted_sum_of_relu_dots_with_causal_mask():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [n=1, h=2, d=2]
    keys = torch.tensor([[2.0, -3.0], [1.0, 1.0]])
    w = torch.tensor([[0.5, 2.0]])
    s = index_scores(q, keys, w, torch.tensor([7]), 4)
    assert s.tolist() == [[0.5 * 2 + 2.0 * 0, 0.5 * 1 + 2.0 * 1]]
    s = index_scores(q, keys, w, torch.tensor([6]), 4)
    assert s[0, 1] == float("-inf")


def test_sparse_attention_sink_only_in_denominator():
    q = torch.tensor([[[1.0, 0.0]]])  # [n, H=1, d]
    rows = torch.tensor([[[2.0, 3.0], [9.0, 9.0]]])
    valid = torch.tensor([[True, False]])
    o = attn.sparse_attention(q, rows, valid, torch.tensor([0.7]), 1.0)
    p = math.exp(2.0) / (math.exp(2.0) + math.exp(0.7))
    assert torch.allclose(o, torch.tensor([[[2.0 * p, 3.0 * p]]]))


def test_rope_rotates_interleaved_pairs_of_the_last_dims_and_inverse_undoes_it():
    x = torch.arange(8.0).view(1, 8)
    freqs = torch.tensor([1.0, 0.5])  # rotates dims 4..7 as pairs (4,5), (6,7)
    y = apply_rope(x, torch.tensor([2]), freqs)
    assert torch.equal(y[0, :4], x[0, :4])
    c, s = math.cos(2.0), math.sin(2.0)
    assert torch.allclose(y[0, 4:6], torch.tensor([4 * c - 5 * s, 4 * s + 5 * c]))
    assert torch.allclose(apply_rope(y, torch.tensor([2]), freqs, inverse=True), x)


def test_yarn_on_compressed_layers_only_with_flash_correction_range():
    cfg = ModelConfig.preset("flash")
    assert yarn_correction_range(32, 1, 64, 160000.0, 65536) == (15, 25)
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert torch.allclose(inv_freq(cfg, 0), plain)
    f = inv_freq(cfg, 4)
    base = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert torch.allclose(f[:15], base[:15])  # high frequencies kept
    assert torch.allclose(f[25:], base[25:] / 16)  # low frequencies interpolated by the factor


def test_overlap_compressor_entry_pools_previous_block_first_half_and_current_second_half():
    g = torch.Generator().manual_seed(5)
    d, dim, r = 2, 3, 4
    w = CompressorWeights(torch.randn(2 * d, dim, generator=g), torch.randn(2 * d, dim, generator=g),
                          torch.randn(r, 2 * d, generator=g), torch.ones(d))
    x = torch.randn(8, dim, generator=g)
    entries = compress(x, torch.arange(8), CompressorState(), w, torch.zeros(1), 0.0)
    assert entries.shape == (2, d)
    kv, score = x @ w.wkv.T, x @ w.wgate.T + w.ape[torch.arange(8) % 4]
    slots_kv = torch.cat((kv[0:4, :d], kv[4:8, d:]))
    slots_score = torch.cat((score[0:4, :d], score[4:8, d:]))
    pooled = (slots_score.softmax(0) * slots_kv).sum(0)
    expect = pooled / pooled.square().mean().sqrt()
    assert torch.allclose(entries[1], expect)
    first = (score[0:4, d:].softmax(0) * kv[0:4, d:]).sum(0)
    assert torch.allclose(entries[0], first / first.square().mean().sqrt())


def test_compressor_applies_rope_at_the_first_position_of_the_block():
    g = torch.Generator().manual_seed(6)
    d, dim, r = 4, 3, 128
    w = CompressorWeights(torch.randn(d, dim, generator=g), torch.randn(d, dim, generator=g),
                          torch.zeros(r, d), torch.ones(d))
    x = torch.randn(256, dim, generator=g)
    freqs = torch.tensor([0.3])
    roped = compress(x, torch.arange(256), CompressorState(), w, freqs, 0.0)
    plain = compress(x, torch.arange(256), CompressorState(), w, torch.zeros(1), 0.0)
    assert torch.allclose(roped[1], apply_rope(plain[1:2], torch.tensor([128]), freqs)[0])


def test_gate_bias_selects_experts_but_does_not_weight_them():
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=4, n_activated_experts=2, route_scale=1.5)
    x = torch.eye(4)[:1] * 3  # token strongly prefers expert 0
    weight = torch.eye(4)
    bias = torch.tensor([-100.0, 0.1, 0.0, 50.0])
    weights, ids = gate(x, weight, bias, None, torch.tensor([0]), cfg)
    assert sorted(ids[0].tolist()) == [1, 3]
    s = torch.nn.functional.softplus(x @ weight.T).sqrt()[0]
    expect = s[ids[0]] / s[ids[0]].sum() * 1.5
    assert torch.allclose(weights[0], expect)


def test_hash_gate_routes_by_token_id():
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=4, n_activated_experts=2)
    tid2eid = torch.tensor([[0, 1], [2, 3], [3, 0]])
    _, ids = gate(torch.randn(2, 4), torch.randn(4, 4), None, tid2eid, torch.tensor([2, 1]), cfg)
    assert ids.tolist() == [[3, 0], [2, 3]]


def test_topk_breaks_exact_ties_towards_the_lower_entry():
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])
    assert select_topk(scores, torch.tensor([19]), 4, 3)[0].tolist() == [1, 0, 2]


# ---- the oracle's fast paths equal their plain definitions -------------------------------------------------------
TIE_VALUES = st.sampled_from([-math.inf, -1.5, -0.0, 0.0, 0.25, 1.0, math.inf, math.nan])


@settings(max_examples=200)
@given(st.integers(1, 4).flatmap(lambda n: st.integers(1, 24).flatmap(lambda e: st.tuples(
    st.lists(st.lists(TIE_VALUES, min_size=e, max_size=e), min_size=n, max_size=n), st.integers(0, e)))))
def test_stable_topk_picks_what_a_stable_descending_sort_picks(case):
    """Few distinct values (ties everywhere), signed zeros, +-inf and NaN: the same k ids in the same order."""
    rows, k = case
    for dtype in (torch.float32, torch.float64):
        scores = torch.tensor(rows, dtype=dtype)
        expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(stable_topk_indices(scores, k), expected)


def test_hca_attention_over_shared_entries_equals_attention_over_gathered_rows():
    g = torch.Generator().manual_seed(5)
    n, heads, d, w, e = 6, 3, 16, 5, 9
    q, window, entries = torch.randn(n, heads, d, generator=g), torch.randn(n, w, d, generator=g), \
        torch.randn(e, d, generator=g)
    window_valid = torch.rand(n, w, generator=g) > 0.3
    entry_valid = torch.rand(n, e, generator=g) > 0.4
    entry_valid[0] = False  # a query that sees no compressed entry
    sink = torch.randn(heads, generator=g)
    got = attn.window_and_entries_attention(q, window, window_valid, entries, entry_valid, sink, 0.25)
    rows = torch.cat((window, entries.expand(n, e, d)), dim=1)
    want = attn.sparse_attention(q, rows, torch.cat((window_valid, entry_valid), dim=1), sink, 0.25)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
