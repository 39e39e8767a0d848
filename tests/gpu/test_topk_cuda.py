"""The production top-k on a CUDA device (skipped without one): the CPU stable sort's picks on every route, for
fp32 and bf16 scores, where CUDA's own float sort differs (it orders -0.0 below +0.0 and a negative NaN last),
also inside a CUDA graph (graph decode captures it)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.production.topk import CUDA_KEYS_MIN_ROWS, ROUTES, default_route, stable_topk  # noqa: E402


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
                                      (CUDA_KEYS_MIN_ROWS, 8192, 512), (512, 32768, 512)])
def test_every_route_on_cuda_equals_the_cpu_stable_sort(rows, n, k, route, dtype):
    x = _scores(rows, n, seed=n + k, dtype=dtype, k=k)
    assert torch.equal(stable_topk(x.cuda(), k, route).cpu(), _reference(x, k))


def test_cuda_default_route_is_the_sort_except_for_fp32_prefill_chunks():
    assert default_route(_scores(1, 1000, 0).cuda()) == "sort"
    assert default_route(_scores(CUDA_KEYS_MIN_ROWS, 1000, 0).cuda()) == "keys"
    assert default_route(_scores(CUDA_KEYS_MIN_ROWS, 1000, 0, torch.bfloat16).cuda()) == "sort"


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
