"""Op ``grouped_expert`` (the routed experts of a prefill chunk on the stored FP4 experts) on the CPU: its emulation
gives the model's per-expert loop's bits (tiny checkpoint, hash and score layers, plain and fused-norm inputs;
random inputs with uneven expert loads), bad inputs raise naming the tensor (fp32 scales too: the stored experts'
scales are e8m0 bytes), the model's stored-expert stacks hold those bytes as stored, and its Triton kernel under the
CPU interpreter gives the emulation's bits (``tests/interpreted/grouped_expert_checks.py``, in a subprocess; scale
bytes 0, 1, 127, 254, 255 included)."""

from dataclasses import replace

import pytest
import torch

from fidelity.decoders.production import ProductionModel, ops
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.moe import by_expert
from fidelity.model.config import ModelConfig
from fidelity.model.formats import decode_e8m0
from fidelity.model.synthesize import synthesize
from fidelity.testing.strategies import _fp4_stored

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


def stored_stacks(ckpt, i: int) -> tuple[torch.Tensor, ...]:
    """Layer i's routed experts as ``ProductionModel.stored_experts`` stacks them: (w13 codes, w13 scales, w2 codes,
    w2 scales), the scales as stored: e8m0 bytes uint8."""
    def stack(m: str) -> tuple[torch.Tensor, torch.Tensor]:
        st = [ckpt.stored(f"layers.{i}.ffn.experts.{e}.{m}.weight") for e in range(ckpt.config.n_routed_experts)]
        return torch.stack([s.data.view(torch.uint8) for s in st]), torch.stack([s.scale.view(torch.uint8) for s in st])

    (c1, s1), (c2, s2), (c3, s3) = stack("w1"), stack("w2"), stack("w3")
    return torch.cat((c1, c3), 1), torch.cat((s1, s3), 1), c2, s2


def per_expert_loop(h, weights, experts, w13, s13, w2, s2, limit, act):
    """The model's per-expert loop (``MoE.forward`` off the GPU) on these weights: [n, k, dim] bf16."""
    f, k = w13.shape[1] // 2, experts.shape[1]
    out = torch.zeros((*experts.shape, w2.shape[1]), dtype=BF16)
    for e, rows, slot in by_expert(experts):
        w = ops._fp4_dequantized(w13[e], s13[e])

        def linear(x, weight, a):
            return ops.quantized_linear(x.xq, weight) if isinstance(x, Fp8Input) else ops.act_linear(x, weight, a)

        out[rows, slot] = ops.expert(h[rows], w[:f], ops._fp4_dequantized(w2[e], s2[e]), w[f:], limit,
                                     weights[rows, slot, None], act, linear)
    assert out.shape[1] == k
    return out


@pytest.mark.parametrize("profile", ["reference", "fused-norm", "bf16"])
def test_emulation_gives_the_models_per_expert_loop_bits_on_the_tiny_checkpoint(tiny, profile):
    cfg = tiny.config
    session = ProductionModel(tiny, profile, max_context=64).session()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    for i in (0, cfg.n_hash_layers):  # a hash layer and a score layer
        assert cfg.is_hash_layer(i) == (i == 0)
        y = (torch.randn(40, cfg.dim, generator=g) * 2).to(BF16)
        layer = session.model.layer(i)
        h = layer.norm(y, layer.ffn_norm)
        x = h.y if isinstance(h, Fp8Input) else h
        weights, experts = layer.moe.route(session, x, ids)
        picked, order = experts.sort(dim=1)
        got = ops.grouped_expert(h.xq if isinstance(h, Fp8Input) else h, weights.gather(1, order), picked,
                                 *stored_stacks(tiny, i), cfg.swiglu_limit, session.profile.gemm_act,
                                 isinstance(h, Fp8Input))
        assert got.shape == (40, cfg.n_activated_experts, cfg.dim)
        moe = layer.moe.forward(session, h, ids)  # the per-expert loop (no stored experts off the GPU)
        assert torch.equal(ops.moe_sum(got, layer.moe.shared_expert(h)).view(torch.int16), moe.view(torch.int16)), i


@pytest.mark.parametrize("act", ["fp8", "bf16"])
def test_emulation_gives_the_loops_bits_with_uneven_expert_loads(act):
    g = torch.Generator().manual_seed(2)
    n, k, e_count, dim, f = 50, 3, 8, 256, 128
    w13, s13 = _fp4_stored(g, e_count, 2 * f, dim, 4.0)
    w2, s2 = _fp4_stored(g, e_count, dim, f, 1.0)
    experts = torch.stack([torch.tensor([1, 5, 6])[torch.randperm(3, generator=g)] for _ in range(n)])
    experts[:4] = torch.tensor([[2, 1, 5], [1, 6, 2], [5, 1, 2], [1, 2, 6]])  # 0, 3, 4, 7 get no token; 1 all
    x = (torch.randn(n, dim, generator=g) * 3).to(BF16)
    weights = torch.rand(n, k, generator=g)
    got = ops.grouped_expert(x, weights, experts, w13, s13, w2, s2, 10.0, act)
    want = per_expert_loop(x, weights, experts, w13, s13, w2, s2, 10.0, act)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def bad_inputs():
    g = torch.Generator().manual_seed(3)
    w13, s13 = _fp4_stored(g, 4, 256, 128, 1.0)
    w2, s2 = _fp4_stored(g, 4, 128, 128, 1.0)
    return {"x": torch.randn(3, 128).to(BF16), "weights": torch.rand(3, 2),
            "experts": torch.tensor([[0, 1], [2, 3], [1, 2]]), "w13": w13, "w13_scales": s13, "w2": w2,
            "w2_scales": s2, "limit": 10.0, "act": "fp8"}


@pytest.mark.parametrize(("name", "bad", "match"), [
    ("w13", lambda t: t.view(torch.int8), "w13: expected packed FP4 codes uint8"),
    ("w13", lambda t: t[:, :, :32], "w13: expected"),
    ("w13_scales", lambda t: t.to(torch.float16), "w13_scales: expected e8m0 scale bytes uint8"),
    ("w13_scales", decode_e8m0,
     "w13_scales: expected e8m0 scale bytes uint8 \\[4, 256, 4\\], found torch.float32 \\[4, 256, 4\\]"),
    ("w2", lambda t: t[:3], "w2: expected packed FP4 codes uint8 \\[4, 128, 64\\]"),
    ("w2_scales", lambda t: t[..., :2], "w2_scales: expected e8m0 scale bytes uint8 \\[4, 128, 4\\]"),
    ("w2_scales", decode_e8m0,
     "w2_scales: expected e8m0 scale bytes uint8 \\[4, 128, 4\\], found torch.float32 \\[4, 128, 4\\]"),
    ("x", lambda t: t.float(), "x: expected bf16"),
    ("weights", lambda t: t[:, :1], "weights: expected fp32 \\[3, 2\\]"),
    ("experts", lambda t: t.float(), "experts: expected integer ids"),
    ("experts", lambda t: t + 2, "experts: expected ids in \\[0, 4\\), found \\[2, 5\\]"),
    ("experts", lambda t: t - 1, "experts: expected ids in \\[0, 4\\), found \\[-1, 2\\]"),
])
def test_bad_inputs_raise_naming_the_tensor(name, bad, match):
    args = bad_inputs()
    args[name] = bad(args[name])
    with pytest.raises(ValueError, match=match):
        ops.grouped_expert(**args)


def test_no_tokens_give_an_empty_result():
    args = bad_inputs()
    args.update(x=args["x"][:0], weights=args["weights"][:0], experts=args["experts"][:0])
    assert ops.grouped_expert(**args).shape == (0, 2, 128)


def test_the_cpu_prefill_keeps_the_per_expert_loop(tiny):
    """Off the GPU the model holds no stored experts, so ``moe`` runs the loop it ran before (its bits)."""
    model = ProductionModel(tiny, max_context=64)
    assert model.stored_experts(0) is None


def test_stored_experts_hold_the_e8m0_scale_bytes_as_stored(tiny, monkeypatch):
    """With the GPU path forced (as ``test_production`` does on the CPU), ``stored_experts`` stacks each weight's
    1x32 scales as the checkpoint stores them: e8m0 bytes uint8 [E, out, in/32] (1 byte per 32 weights, not an fp32
    decoded copy), w1 and w3 views of the stacked pair; the codes uint8 [E, out, in/2]."""
    monkeypatch.setattr(ProductionModel, "_gemv_ready", lambda self: True)
    cfg = tiny.config
    i, e_count = cfg.n_hash_layers, cfg.n_routed_experts
    (c1, s1), (c2, s2), (c3, s3), (c13, s13) = ProductionModel(tiny, max_context=64).stored_experts(i)
    for m, (codes, scales) in {"w1": (c1, s1), "w2": (c2, s2), "w3": (c3, s3)}.items():
        st = [tiny.stored(f"layers.{i}.ffn.experts.{e}.{m}.weight") for e in range(e_count)]
        out, half = st[0].data.shape
        assert st[0].scale.dtype == torch.float8_e8m0fnu and tuple(st[0].scale.shape) == (out, 2 * half // 32)
        assert codes.dtype == scales.dtype == torch.uint8, m
        assert tuple(codes.shape) == (e_count, out, half) and tuple(scales.shape) == (e_count, out, 2 * half // 32), m
        assert torch.equal(scales, torch.stack([s.scale.view(torch.uint8) for s in st])), m
        assert torch.equal(codes, torch.stack([s.data.view(torch.uint8) for s in st])), m
    assert s13.dtype == torch.uint8 and torch.equal(s13, torch.cat((s1, s3), 1))
    assert s1.data_ptr() == s13.data_ptr() and s3.data_ptr() == s13[:, s1.shape[1]:].data_ptr()
    assert tuple(c13.shape) == (e_count, 2 * c1.shape[1], c1.shape[2])


def test_stored_experts_refuse_scales_that_are_not_e8m0_bytes(tiny, monkeypatch):
    """A checkpoint whose FP4 scales came decoded (fp32) is refused naming the weight, not stacked as bytes."""
    monkeypatch.setattr(ProductionModel, "_gemv_ready", lambda self: True)
    real = tiny.stored

    def decoded(name):
        st = real(name)
        return replace(st, scale=decode_e8m0(st.scale)) if st.fmt == "fp4" else st

    monkeypatch.setattr(tiny, "stored", decoded)
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight: expected FP4 scales as e8m0 bytes "
                                         r"\(float8_e8m0fnu or uint8\), found torch\.float32"):
        ProductionModel(tiny, max_context=64).stored_experts(0)


INTERPRETED_CHECKS = ["bf16_bits", "fp8_bits_with_the_interpreters_quantizer", "quantized_input_bits",
                      "uneven_loads_over_several_tiles", "bad_codes_raise_in_the_kernel_path",
                      "scale_bytes_0_1_127_254_255_give_the_emulations_bits",
                      "scale_bytes_0_1_127_254_255_give_the_emulations_bits_bf16",
                      "fp32_scales_raise_in_the_kernel_path"]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    pytest.importorskip("triton")
    from tests.interpreted import run_checks

    return run_checks("grouped_expert_checks")


def test_the_interpreted_run_reports_every_check(interpreted):
    assert sorted(interpreted) == sorted(INTERPRETED_CHECKS)


@pytest.mark.parametrize("check", INTERPRETED_CHECKS)
def test_interpreted_grouped_expert_kernel_check_passes(interpreted, check):
    assert interpreted[check] == "", f"{check}: {interpreted[check]}"


def test_the_routed_experts_of_a_decode_step_leave_no_reference_cycle(tiny):
    """``routed_on_stored`` hands ``expert`` a linear with a ``pair`` attribute; were ``pair`` to refer to that
    linear, the cycle would keep each call's expert ids alive until a gc pass (seen on CUDA as retained_growth)."""
    import gc

    cfg = tiny.config
    moe = ProductionModel(tiny, "reference", max_context=64).layer(cfg.n_hash_layers).moe
    w13, s13, w2, s2 = stored_stacks(tiny, cfg.n_hash_layers)
    f = w13.shape[1] // 2
    stacks = ((w13[:, :f], s13[:, :f]), (w2, s2), (w13[:, f:], s13[:, f:]), (w13, s13))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, cfg.dim, generator=g).to(BF16)
    experts = torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.n_activated_experts][None]
    weights = torch.rand(1, cfg.n_activated_experts, generator=g)
    gc.collect()
    gc.disable()
    try:
        out = moe.routed_on_stored(h, weights, experts, stacks)
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert out.shape == (1, cfg.n_activated_experts, cfg.dim)
