"""The production top-k picks exactly what the CPU's stable descending sort of the scores picks, on both torch
routes (the Triton ``radix`` route: ``tests/gpu/test_topk_cuda.py``) and for fp32 and bf16 scores (ties to the
lower id, -0.0 equal to +0.0, NaN of either sign above +inf)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fidelity.decoders.production import kernels, routes, topk
from fidelity.decoders.production.ops import ordered_scores
from fidelity.decoders.production.topk import TORCH_ROUTES, order_keys, stable_topk

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38]
DTYPES = (torch.float32, torch.bfloat16)


def _sorted_picks(x: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: the CPU's stable sort of the scores as fp32 (bf16 -> fp32 is exact)."""
    return x.float().cpu().sort(dim=-1, descending=True, stable=True).indices[..., :k]


@settings(max_examples=300)
@given(st.lists(st.one_of(st.sampled_from(SPECIALS), st.integers(-6, 6).map(lambda v: v / 4),
                          st.floats(width=32, allow_nan=True, allow_infinity=True)), min_size=1, max_size=200),
       st.integers(1, 3), st.sampled_from(TORCH_ROUTES), st.sampled_from(DTYPES), st.data())
def test_every_route_equals_the_stable_descending_sort_on_ties_signed_zeros_nans_and_infinities(values, rows, route,
                                                                                              dtype, data):
    x = torch.tensor(values, dtype=torch.float32).repeat(rows, 1)
    x[1:] = x[1:].roll(1, dims=-1)  # a different arrangement per row
    x = x.to(dtype)
    k = data.draw(st.integers(0, x.shape[-1]))
    assert torch.equal(stable_topk(x, k, route), _sorted_picks(x, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("route", TORCH_ROUTES)
def test_every_route_matches_the_sort_on_bf16_valued_scores_at_a_decode_size(route, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 40000, generator=g).bfloat16().float()  # bf16 values: thousands of exact ties
    x[:, 30000:] = float("-inf")  # entries past the causal limit
    x[0, :100] = 0.0
    x[1, :100] = -0.0
    x[2, :30000] = 0.0  # the whole visible row ties
    x[3, 1:30000:2] = -0.0  # +0 and -0 interleaved: one tie
    x[3, 30000:] = 0.0
    x = x.to(dtype)
    assert torch.equal(stable_topk(x, 512, route), _sorted_picks(x, 512))
    assert torch.equal(stable_topk(x[None], 512, route), _sorted_picks(x, 512)[None])  # leading dims


@pytest.mark.parametrize("route", TORCH_ROUTES)
def test_every_route_takes_k_zero_and_k_equal_to_the_row(route):
    x = torch.tensor([[1.0, float("-inf"), 1.0, 0.5]])
    assert stable_topk(x, 0, route).shape == (1, 0)
    assert stable_topk(x, 4, route).tolist() == [[0, 2, 3, 1]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_scores_go_to_the_lower_entry_id_and_minus_zero_ties_plus_zero(dtype):
    x = torch.tensor([[0.0, -0.0, 1.0, 0.0, -0.0, float("nan"), 1.0, -float("nan")]], dtype=dtype)
    for route in TORCH_ROUTES:
        assert stable_topk(x, 8, route).tolist() == [[5, 7, 2, 6, 0, 1, 3, 4]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ordered_scores_follow_the_numbers_order(dtype):
    x = torch.tensor([-float("inf"), -2.0, -1.0, -0.0, 0.0, 1.0, 2.0, float("inf"), float("nan"), -float("nan")],
                     dtype=dtype)
    o = ordered_scores(x).tolist()
    assert o[:3] == sorted(o[:3]) and o[2] < o[3] == o[4] < o[5] < o[6] < o[7] < o[8] == o[9]


def test_order_keys_are_distinct_and_ordered_by_score_then_reversed_id():
    x = torch.tensor([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0, float("inf"), float("nan"), float("-inf")])
    keys = order_keys(x)
    assert len(set(keys.tolist())) == len(x)
    assert keys.argsort().tolist() == [8, 0, 1, 3, 2, 4, 5, 6, 7]  # -0 ties +0: the lower id (2) ranks higher


@pytest.mark.parametrize("route", TORCH_ROUTES)
def test_stable_topk_refuses_k_outside_the_row_and_other_dtypes(route):
    with pytest.raises(ValueError, match=r"k must lie in \[0, 3\].*found 4"):
        stable_topk(torch.zeros(1, 3), 4, route)
    with pytest.raises(ValueError, match="found -1"):
        stable_topk(torch.zeros(1, 3), -1, route)
    with pytest.raises(TypeError, match="float32 or bfloat16, found torch.float16"):
        stable_topk(torch.zeros(1, 3, dtype=torch.float16), 1, route)


def test_stable_topk_refuses_an_unknown_route():
    with pytest.raises(ValueError, match="route must be one of .*found 'bitonic'"):
        stable_topk(torch.zeros(1, 3), 1, "bitonic")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the radix route runs on CUDA here")
def test_radix_route_on_cpu_scores_says_it_needs_a_cuda_device():
    routes.reset()
    with pytest.raises(ValueError, match="route 'radix' needs triton and the scores on a CUDA device, found scores on "
                                         "cpu" + ("" if kernels.HAVE_TRITON else " and no triton")):
        stable_topk(torch.zeros(1, 3), 1, "radix")
    with pytest.raises(TypeError, match="float32 or bfloat16, found torch.float16"):
        stable_topk(torch.zeros(1, 3, dtype=torch.float16), 1, "radix")
    assert routes.counts("topk") == {}  # refused calls are not counted


def test_cpu_scores_default_to_the_keys_route_and_the_route_calls_are_counted():
    routes.reset()
    stable_topk(torch.zeros(2, 5), 2)
    stable_topk(torch.zeros(2, 5), 2, "sort")
    assert topk.default_route(torch.zeros(2, 5), 2) == "keys"
    assert routes.counts("topk") == {"keys": 1, "sort": 1}
