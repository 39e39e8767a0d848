"""Shared by the GPU kernel tests (tests/gpu/test_<kernel>.py): tolerances, hypothesis settings (derandomized, no
deadline), comparisons and input builders used by more than one kernel's tests."""

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from fidelity.model.formats import dequantize_fp4
from fidelity.testing import Case

BF16 = torch.bfloat16
CUDA = "cuda"
ROW_CALC_DIFF = (2 * 1.25 * 2.0**-8) ** 2 / 2
ROW_CALC_DIFF_E4M3 = (2 * 1.25 * 2.0**-4) ** 2 / 2  # the same rule with P on the e4m3 grid (3 mantissa bits)
PROPS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


def gen(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def row_calc_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row calc_diff (last dim), fp64, rows where both are all-zero count as 0."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    den = (a * a).sum(-1) + (b * b).sum(-1)
    return torch.where(den > 0, 1 - 2 * (a * b).sum(-1) / den.clamp(min=1e-300), 0.0)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (+0 == -0)."""
    a, b = a.double(), b.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def ws_runs_here() -> bool:
    """The warp-specialized (Gluon) kernels run here: sm_90 and Triton 3.6."""
    import triton

    return torch.cuda.get_device_capability() == (9, 0) and triton.__version__.startswith("3.6.")


def fp4_keys(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An FP4 key cache (packed uint8 [e, d/2], scale bytes [e, d/32]) dequantized to bf16 [e, d], exactly."""
    return dequantize_fp4(packed, scales, 32).to(BF16)


def index_scores_bound(q, keys, w) -> torch.Tensor:
    """The index_scores contract's elementwise bound (fidelity.testing), recomputed here in fp64."""
    q, keys, w = q.double(), keys.double(), w.double().abs()
    terms = torch.einsum("nhd,ed->nhe", q, keys).relu()
    absdots = torch.einsum("nhd,ed->nhe", q.abs(), keys.abs())
    return 4 * 2.0**-8 * (terms * w[..., None]).sum(1) + q.shape[-1] * 2.0**-23 * (absdots * w[..., None]).sum(1)


def decode_rows(g: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 rows of shape ``shape`` with magnitudes 2^-30..2^30 per row."""
    return (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-30, 31, (*shape[:-1], 1), generator=g))).to(
        BF16)


_T_EDGES = (0, 1, 2, 3, 4, 5, 7, 8, 126, 127, 128, 129, 255, 256, 511, 512, 513)


@st.composite
def attention_cases(draw):
    """q [n, H, d], kv [window rows | compressed rows], idx = 128 window entries (positions t-127..t, -1 before 0,
    valid first or in position order) + a top-k part over the visible compressed entries j < (t+1)//ratio
    (HCA: all of them; CSA: a random subset; ragged / all -1 / empty cache)."""
    h = draw(st.sampled_from((4, 64, 128)))
    d = 128 if h == 4 else draw(st.sampled_from((128, 512)))
    n = draw(st.integers(1, 4))
    t_last = draw(st.one_of(st.sampled_from(_T_EDGES), st.integers(0, 2000)))
    ratio = draw(st.sampled_from((4, 128)))
    topk = draw(st.sampled_from((0, 1, 63, 64, 65, 128, 512)))
    picks = draw(st.sampled_from(("visible", "ragged", "all_masked")))
    valid_first = draw(st.booleans())
    g = gen(draw)
    positions = [max(0, t_last - n + 1 + i) for i in range(n)]
    n_comp = (t_last + 1) // ratio
    idx = torch.full((n, 128 + topk), -1, dtype=torch.int32)
    for i, t in enumerate(positions):
        win = torch.arange(t - 127, t + 1)
        win = torch.where(win >= 0, win, -1)
        if valid_first:
            win = torch.cat((win[win >= 0], win[win < 0]))
        idx[i, :128] = win.to(torch.int32)
        visible = (t + 1) // ratio
        if topk and visible and picks != "all_masked":
            chosen = torch.randperm(visible, generator=g)[: min(topk, visible)]
            if picks == "ragged":
                chosen = chosen[torch.rand(len(chosen), generator=g) < 0.6]
            idx[i, 128 : 128 + len(chosen)] = (t_last + 1 + chosen).to(torch.int32)
    kv_scale = draw(st.sampled_from((0.25, 1.0, 4.0)))
    temperature = draw(st.sampled_from((0.5, 1.0, 4.0)))
    kv = (torch.randn(t_last + 1 + n_comp, d, generator=g) * kv_scale).to(BF16)
    q = (torch.randn(n, h, d, generator=g) * (temperature / kv_scale)).to(BF16)
    sink = torch.randn(h, generator=g) * 2 + draw(st.sampled_from((0.0, 4.0, -8.0)))
    args = {"q": q, "kv": kv, "idx": idx, "sink": sink, "scale": d**-0.5, "fmt": "bf16"}
    return Case(args, note=f"H={h} d={d} t={t_last} ratio={ratio} topk={topk} picks={picks} n_comp={n_comp}")


@st.composite
def norm_cases(draw):
    n = draw(st.sampled_from((1, 2, 3, 5, 8, 1024)))  # 1024: the prefill launch (2 rows per program)
    d = draw(st.sampled_from((128, 512, 1024, 4096, 7168)))
    g = gen(draw)
    scales = torch.exp2(torch.empty(n, 1).uniform_(-10, 10, generator=g))
    x = torch.randn(n, d, generator=g) * scales
    if draw(st.integers(0, 4)) == 4:
        x[int(torch.randint(0, n, (1,), generator=g))] = 0.0
    if draw(st.integers(0, 4)) == 4:
        x.view(-1)[int(torch.randint(0, n * d, (1,), generator=g))] = math.nan
    w = torch.randn(d, generator=g) * draw(st.sampled_from((0.1, 1.0, 30.0)))
    # the launch variants: the default (1024 rows of d = 4096 / 7168: persistent), one-shot with 2 rows per program
    # with and without cache hints, persistent with 2 rows per loop step (ragged tails at odd n)
    cfg = draw(st.sampled_from(({}, {"rows": 2, "stream": True}, {"rows": 2, "num_warps": 4, "stream": False},
                                {"per_sm": 1, "rows": 2, "num_warps": 8}, {"per_sm": 0})))
    return x.to(BF16), w, cfg
