"""The production top-k on a CUDA device (skipped without one): the same picks as the stable sort, also inside a
CUDA graph (graph decode captures it)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.production.topk import CUDA_KEYS_MIN_ROWS, ROUTES, default_route, stable_topk  # noqa: E402


def _scores(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, n, device="cuda", generator=g).bfloat16().float()  # bf16 values: many exact ties
    x[:, n - n // 8:] = float("-inf")
    x[:, :64] = 0.0
    x[:, 64:128] = -0.0
    x[0, 200:203] = float("nan")
    return x


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rows,n,k", [(1, 32768, 512), (1, 262144, 1024), (64, 8192, 512), (3, 700, 700),
                                      (CUDA_KEYS_MIN_ROWS, 8192, 512), (512, 32768, 512)])
def test_every_route_on_cuda_equals_the_stable_sort(rows, n, k, route):
    x = _scores(rows, n, seed=n + k)
    assert torch.equal(stable_topk(x, k, route), x.sort(dim=-1, descending=True, stable=True).indices[:, :k])


def test_cuda_default_route_is_the_sort_for_decode_and_the_keys_for_prefill_chunks():
    assert default_route(_scores(1, 1000, 0)) == "sort"
    assert default_route(_scores(CUDA_KEYS_MIN_ROWS, 1000, 0)) == "keys"


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_replays_in_a_cuda_graph(route):
    x = _scores(2, 65536, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        stable_topk(x, 512, route)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        picks = stable_topk(x, 512, route)
    for seed in (2, 3):
        x.copy_(_scores(2, 65536, seed=seed))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(picks, x.sort(dim=-1, descending=True, stable=True).indices[:, :512])
