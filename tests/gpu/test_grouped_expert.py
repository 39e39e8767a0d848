"""The grouped expert kernels (``kernels/grouped_expert.py``) on a CUDA device: against the emulation (the per-expert
cuBLAS path) within the op's contract at Flash's shapes, and the production model's prefill with them against the
per-expert loop within the model-level bound of ``test_production_cuda.py``; e8m0 scale bytes at the ends of the
format (0, 1, 127, 254, 255) within the contract, NaN where the emulation has NaN."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ProductionModel, fallbacks, ops  # noqa: E402
from fidelity.decoders.production.kernels.grouped_expert import grouped_expert_cuda  # noqa: E402
from fidelity.decoders.production.registry import implementations_used, reset_used  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.default import default_prompt  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402
from fidelity.testing.cases import U_BF16, U_FP8  # noqa: E402
from tests import fp4_scale_bytes  # noqa: E402
from tests.gpu.kernel_helpers import BF16, CUDA, row_calc_diff  # noqa: E402

CONTRACT_CALC_DIFF = (2 * U_FP8 + 4 * U_BF16) ** 2 / 2  # the grouped_expert contract's per-row limit


def random_fp4(g: torch.Generator, e_count: int, rows: int, cols: int, log2_scale: int) -> tuple[torch.Tensor, ...]:
    """Uniform random e2m1 code bytes uint8 [e_count, rows, cols/2] and 1x32 scales 2^(log2_scale + {-1, 0, 1})
    as e8m0 bytes uint8 [e_count, rows, cols/32] (w13 at -5: pre-activations reach past the clamp at 10)."""
    codes = torch.randint(0, 256, (e_count, rows, cols // 2), generator=g, dtype=torch.uint8)
    steps = torch.randint(-1, 2, (e_count, rows, cols // 32), generator=g)
    return codes, (127 + log2_scale + steps).to(torch.uint8)


def flash_inputs(n: int, act: str, seed: int = 0) -> dict:
    """Flash's routed experts (dim 4096, moe_inter_dim 2048, 256 experts, top-6) as stored, n tokens routed by
    random scores with a skew (a few experts take many tokens), on the device."""
    g = torch.Generator().manual_seed(seed)
    w13, s13 = random_fp4(g, 256, 4096, 4096, -5)
    w2, s2 = random_fp4(g, 256, 4096, 2048, -7)
    scores = torch.rand(n, 256, generator=g) + torch.linspace(0, 0.5, 256)
    weights, experts = scores.topk(6, dim=-1)
    args = {"x": (torch.randn(n, 4096, generator=g) * 2).to(BF16), "weights": weights / weights.sum(-1, keepdim=True),
            "experts": experts.sort(dim=1).values, "w13": w13, "w13_scales": s13, "w2": w2, "w2_scales": s2,
            "limit": 10.0, "act": act}
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("act", ["fp8", "bf16"])
def test_kernel_meets_the_contract_against_the_emulation_at_flash_shapes(act):
    args = flash_inputs(4096, act)
    got, want = grouped_expert_cuda(**args), ops.grouped_expert(**args)
    diff = row_calc_diff(got, want)
    assert diff.max() <= CONTRACT_CALC_DIFF, diff.max()
    same = (got.view(torch.int16) == want.view(torch.int16)).float().mean()
    assert same > 0.5, same  # the accumulation order moves a few bf16 roundings only


def test_a_chunk_of_one_expert_and_empty_experts_is_computed_in_full():
    args = flash_inputs(300, "fp8", seed=1)
    args["experts"][:, 0] = 7  # expert 7 in every token: several M-tiles; most experts empty
    args["experts"] = args["experts"].sort(dim=1).values
    got, want = grouped_expert_cuda(**args), ops.grouped_expert(**args)
    assert row_calc_diff(got, want).max() <= CONTRACT_CALC_DIFF


@pytest.mark.parametrize("act", ["fp8", "bf16"])
def test_scale_bytes_at_the_ends_of_the_format_meet_the_contract_with_the_emulations_nans(act):
    """e8m0 bytes 0, 1, 2, 127, 250, 253, 254, 255 in w2 and w13 (``tests/fp4_scale_bytes.py``): NaN exactly where the
    emulation has NaN (expert 2's byte-255 columns, every column of expert 3's slots), each row within the
    contract elsewhere (the dense w13 GEMMs sum in another order than cuBLAS, so not bit-equal)."""
    args = {name: t.to(CUDA) if isinstance(t, torch.Tensor) else t
            for name, t in {**fp4_scale_bytes.grouped_case(), "act": act}.items()}
    got, want = grouped_expert_cuda(**args), ops.grouped_expert(**args)
    assert fp4_scale_bytes.grouped_case_lost(want, args["experts"]) == ""
    assert torch.equal(got.isnan(), want.isnan())
    assert row_calc_diff(got.nan_to_num(0.0), want.nan_to_num(0.0)).max() <= CONTRACT_CALC_DIFF


@pytest.mark.parametrize("profile", ["reference", "fused-norm", "bf16"])
def test_prefill_with_the_grouped_kernel_matches_the_per_expert_loop(profile, monkeypatch):
    """Logits of a prefill on a config without discrete choices (as test_cuda_production_matches_cpu_emulation)
    with the grouped kernel vs the per-expert loop (stored experts withheld from prefill rows): cosine > 0.999."""
    cfg = ModelConfig.preset("tiny").replace(index_topk=1024, n_activated_experts=8, n_hash_layers=0)
    ckpt, ids = synthesize(cfg, seed=0), default_prompt(4096, 300)
    reset_used()
    fallbacks.reset()
    grouped = ProductionModel(ckpt, profile, max_context=320, device="cuda").session().prefill(ids).cpu()
    assert implementations_used().get("grouped_expert") == "triton"
    assert "grouped_expert" not in fallbacks.counts()
    model = ProductionModel(ckpt, profile, max_context=320, device="cuda")
    monkeypatch.setattr(model, "stored_experts", lambda i: None)
    loop = model.session().prefill(ids).cpu()
    cos = torch.nn.functional.cosine_similarity(grouped.double(), loop.double(), dim=-1)
    assert cos.min() > 0.999, cos
