"""The production top-k on a CUDA device (skipped without one): the CPU stable sort's picks on every route (the
Triton radix selection among them), for fp32 and bf16 scores, where CUDA's own float sort differs (it orders -0.0
below +0.0 and a negative NaN last), also inside a CUDA graph (graph decode captures it)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production.kernels.radix_topk import MAX_K  # noqa: E402
from fidelity.decoders.production.topk import CUDA_KEYS_MIN_ROWS, ROUTES, default_route, stable_topk  # noqa: E402

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38]


def _scores(rows: int, n: int, seed: int, dtype: torch.dtype = torch.float32, k: int = 512) -> torch.Tensor:
    """bf16-valued scores whose top-k boundary falls among zeros of both signs: k/2 random nonzero values (about
    k/4 of them positive) in a row of +0.0 and -0.0, the last eighth -inf, and NaNs of both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(rows, n, generator=g) < 0.5, -0.0, 0.0)
    hot = torch.rand(rows, n, generator=g).argsort(dim=-1)[:, : k // 2]
    x.scatter_(1, hot, torch.randn(rows, k // 2, generator=g).bfloat16().float())
    x[:, n - n // 8:] = float("-inf")
    x[0, 200:203] = float("nan")
    x[-1, 300:302] = -float("nan")
    return x.to(dtype)


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.float().cpu().sort(dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rows,n,k", [(1, 32768, 512), (1, 262144, 1024), (64, 8192, 512), (3, 700, 700),
                                      (CUDA_KEYS_MIN_ROWS, 8192, 512), (512, 32768, 512), (5, 70001, MAX_K),
                                      (2, 5000, 1)])
def test_every_route_on_cuda_equals_the_cpu_stable_sort(rows, n, k, route, dtype):
    x = _scores(rows, n, seed=n + k, dtype=dtype, k=k)
    assert torch.equal(stable_topk(x.cuda(), k, route).cpu(), _reference(x, k))


def test_cuda_default_route_is_the_radix_selection_and_above_its_largest_k_the_torch_routes():
    for dtype in (torch.float32, torch.bfloat16):
        assert default_route(_scores(1, 1000, 0, dtype).cuda(), 512) == "radix"
        assert default_route(_scores(CUDA_KEYS_MIN_ROWS, 1000, 0, dtype).cuda(), 1000) == "radix"
    big = MAX_K + 1
    assert default_route(_scores(1, 2 * big, 0).cuda(), big) == "sort"
    assert default_route(_scores(CUDA_KEYS_MIN_ROWS, 2 * big, 0).cuda(), big) == "keys"
    assert default_route(_scores(CUDA_KEYS_MIN_ROWS, 2 * big, 0, torch.bfloat16).cuda(), big) == "sort"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.sampled_from(SPECIALS), st.integers(-6, 6).map(lambda v: v / 4),
                          st.floats(width=32, allow_nan=True, allow_infinity=True)), min_size=1, max_size=40),
       st.integers(1, 4), st.integers(1, 30000), st.sampled_from([torch.float32, torch.bfloat16]), st.data())
def test_radix_route_equals_the_cpu_stable_sort_on_rows_of_few_distinct_values(pool, rows, n, dtype, data):
    """Rows drawn from a small pool of values (specials included): every threshold is a heavy tie, spread over
    many chunks, at any k the route takes."""
    g = torch.Generator().manual_seed(n)
    x = torch.tensor(pool, dtype=torch.float32)[torch.randint(len(pool), (rows, n), generator=g)].to(dtype)
    k = data.draw(st.integers(1, min(n, MAX_K)))
    assert torch.equal(stable_topk(x.cuda(), k, "radix").cpu(), _reference(x, k))


def test_radix_route_refuses_k_above_its_largest():
    with pytest.raises(ValueError, match=f"1 <= k <= min\\({MAX_K}, entries per row\\).*k={MAX_K + 1}"):
        stable_topk(torch.zeros(1, 2 * MAX_K, device="cuda"), MAX_K + 1, "radix")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_replays_in_a_cuda_graph(route, dtype):
    x = _scores(2, 65536, seed=1, dtype=dtype).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        stable_topk(x, 512, route)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        picks = stable_topk(x, 512, route)
    for seed in (2, 3):
        fresh = _scores(2, 65536, seed=seed, dtype=dtype)
        x.copy_(fresh.cuda())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(picks.cpu(), _reference(fresh, 512))
