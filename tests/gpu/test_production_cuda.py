"""The production decoder and the runner on a CUDA device (skipped without one): the GPU path gives the same
numbers as the CPU emulation to the stated level, selects its kernels by default, and records which ran."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import (  # noqa: E402
    ProductionModel,
    fallbacks,  # noqa: E402
    routes,
)
from fidelity.decoders.production.faults import inject  # noqa: E402
from fidelity.decoders.production.graph_decode import GraphDecodeSession  # noqa: E402
from fidelity.decoders.production.registry import forcing, implementations_used, reset_used  # noqa: E402
from fidelity.harness.runner import Runner, RunSpec  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.default import default_prompt  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


class _HostToDevice(TorchDispatchMode):
    """Bytes copied from host tensors to the device by the ops run under it (``_to_copy`` and ``copy_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and out.device.type != "cpu":
                self.bytes += src.numel() * src.element_size()
        return out


def test_a_later_prefill_chunk_copies_no_index_table_from_the_host(tiny):
    """A prefill chunk on CUDA builds its window and compressed-entry index tables on the device: the second
    1024-token chunk copies under 64 KiB from the host (the ids; its window table alone is 1 MB of int64, and at
    1M context a 16K chunk's HCA table was 1 GB copied every chunk)."""
    ids = default_prompt(4096, 2048)
    session = ProductionModel(tiny, max_context=2048, device="cuda").session()
    session.prefill(ids[:1024])
    with _HostToDevice() as copies:
        session.prefill(ids[1024:])
    assert copies.bytes < 64 * 1024, copies.bytes


def test_cuda_production_matches_cpu_emulation():
    """On a config without discrete choices (top-k >= entries, every expert active, no hash layers): GPU
    rounding differs from the CPU's, and on the default config that flips bf16 top-k ties and routing
    near-ties (measured: cos 0.98 at one decode step), which the harness reports as flips, not as error."""
    cfg = ModelConfig.preset("tiny").replace(index_topk=1024, n_activated_experts=8, n_hash_layers=0)
    ckpt = synthesize(cfg, seed=0)
    ids = default_prompt(4096, 300)
    cpu = ProductionModel(ckpt, "bf16", max_context=320).session()
    gpu = ProductionModel(ckpt, "bf16", max_context=320, device="cuda").session()
    a = torch.cat([cpu.prefill(ids)[-1:], *(cpu.step(t)[None] for t in ids[:8])])
    b = torch.cat([gpu.prefill(ids)[-1:], *(gpu.step(t)[None] for t in ids[:8])]).cpu()
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
    assert cos.min() > 0.999, cos


def test_fp8_fmha_profile_runs_the_attention_kernel_on_cuda():
    """Profile fp8-fmha (e4m3 Q, K/V and P) on the GPU: the attention kernel runs (no fallback to the emulation
    is logged), and its logits stay close to those of the same CUDA model with the attention emulated. Not as
    close as under bf16: the next layer rounds q and kv to e4m3, which turns a one-ulp bf16 difference in an
    attention output into a whole e4m3 step (2^-4 relative) wherever a value sits near a rounding boundary;
    measured on the H200: cosine 0.998-0.9996 per step against this emulated-attention run, 0.992-0.999 against
    the CPU emulation. The op-level property test pins the kernel itself (99.96% of outputs bit-equal)."""
    cfg = ModelConfig.preset("tiny").replace(index_topk=1024, n_activated_experts=8, n_hash_layers=0)
    ckpt = synthesize(cfg, seed=0)
    ids = default_prompt(4096, 300)
    runs = {}
    for impl in ("triton", "cpu"):
        with forcing({"sparse_attention": impl}):
            fallbacks.reset()
            reset_used()
            s = ProductionModel(ckpt, "fp8-fmha", max_context=320, device="cuda").session()
            runs[impl] = torch.cat([s.prefill(ids)[-1:], *(s.step(t)[None] for t in ids[:8])]).cpu()
            assert implementations_used()["sparse_attention"] == impl
            if impl == "triton":
                assert "sparse_attention" not in fallbacks.counts(), fallbacks.counts()
    cos = torch.nn.functional.cosine_similarity(runs["triton"].double(), runs["cpu"].double(), dim=-1)
    assert cos.min() > 0.995, cos


def test_runner_on_cuda_records_the_implementations_that_ran(tiny):
    spec = RunSpec(prompt=default_prompt(4096, 200), decode_steps=2, device="cuda", modes=("op",))
    df, manifest = Runner(tiny, spec).run()
    assert set(df["step"]) == {0, 1, 2}
    assert manifest["implementations"]["sparse_attention"] == manifest["implementations"]["hc_pre"] == "triton"
    assert set(manifest["implementations"].values()) <= {"cpu", "triton"}
    assert manifest["kernel_fallbacks"] == {}  # every kernel took the tiny model's inputs (this run's calls only)
    assert "NVIDIA" in manifest["device"] or "H" in manifest["device"]


def test_packed_fp4_indexer_keys_are_scored_by_the_fp4_kernel_on_cuda():
    """Profile fp4-indexer-packed on the GPU: the indexer reads the packed FP4 cache through the
    ``index_scores_fp4`` kernel, and the logits equal those of the bf16-key storage (reference profile) on the
    GPU (FP4 keys score bit-identically to their dequantized bf16 copy on the bf16-MMA path used at these
    sizes)."""
    cfg = ModelConfig.preset("tiny").replace(index_topk=1024, n_activated_experts=8, n_hash_layers=0)
    ckpt = synthesize(cfg, seed=0)
    ids = default_prompt(4096, 300)
    runs = {}
    for profile in ("reference", "fp4-indexer-packed"):
        s = ProductionModel(ckpt, profile, max_context=320, device="cuda").session()
        runs[profile] = torch.cat([s.prefill(ids)[-1:], *(s.step(t)[None] for t in ids[:8])]).cpu()
        if profile != "reference":
            assert implementations_used()["index_scores_fp4"] == "triton"
    assert torch.equal(runs["reference"], runs["fp4-indexer-packed"])


def test_graph_decode_replays_give_the_eager_steps_bit_for_bit(tiny):
    """GraphDecodeSession on CUDA: one eager step, one capture, then replays; a fault injected mid-run (and
    removed again) triggers a re-capture. Every step's logits equal the eager session's under the same fault
    schedule, bit for bit (same kernels, same shapes per element; extra masked picks change nothing)."""
    ids = default_prompt(4096, 140)
    schedule = [() if t < 20 or t >= 30 else ("window-no-self",) for t in range(40)]
    runs = {}
    for name in ("eager", "graph"):
        model = ProductionModel(tiny, "reference", max_context=144, device="cuda")
        s = model.session() if name == "eager" else GraphDecodeSession(model)
        s.prefill(ids[:100])
        out = []
        for t, faults in zip(ids[100:], schedule, strict=True):
            with inject(*faults):
                out.append(s.step(t))
        runs[name] = torch.stack(out).cpu()
    assert s.replays == 40 - 3
    assert torch.equal(runs["eager"], runs["graph"]), (runs["eager"] != runs["graph"]).float().mean()


@pytest.mark.parametrize("profile", ["fp4-indexer-packed", "fp8-kv-storage"])
def test_graph_decode_captures_the_packed_storage_profiles(tiny, profile):
    ids = default_prompt(4096, 112)
    runs = {}
    for name in ("eager", "graph"):
        model = ProductionModel(tiny, profile, max_context=120, device="cuda")
        s = model.session() if name == "eager" else GraphDecodeSession(model)
        s.prefill(ids[:100])
        runs[name] = torch.stack([s.step(t) for t in ids[100:]]).cpu()
    assert s.replays == 11
    assert torch.equal(runs["eager"], runs["graph"])


def test_fp8_stored_decode_attends_the_packed_rows_with_the_584_byte_kernel():
    """``kv_storage=fp8`` on CUDA, tiny widened to the kernel's shapes (head_dim 512, 32 heads): decode attends the
    packed cache rows through ``sparse_attention_fp8kv``'s ``ws`` route (no fallback), with the bits of the gather
    path it replaces (the rows dequantized into the bf16 workspace, then the bf16 ``ws`` kernel; the
    ``decode-buffer-kept`` fault still takes it), and graph replays give the eager steps' bits."""
    cfg = ModelConfig.preset("tiny").replace(head_dim=512, n_heads=32, index_topk=1024, n_activated_experts=8,
                                             n_hash_layers=0)
    ckpt = synthesize(cfg, seed=0)
    ids = default_prompt(4096, 140)
    runs = {}
    for name in ("packed", "gather", "graph"):
        routes.reset()
        fallbacks.reset()
        model = ProductionModel(ckpt, "fp8-kv-storage", max_context=160, device="cuda")
        s = GraphDecodeSession(model) if name == "graph" else model.session()
        s.prefill(ids[:128])
        with inject(*(("decode-buffer-kept",) if name == "gather" else ())):
            runs[name] = torch.stack([s.step(t) for t in ids[128:]]).cpu()
        if name == "packed":
            assert set(routes.counts("sparse_attention_fp8kv")) == {"ws"}, routes.counts("sparse_attention_fp8kv")
            assert "sparse_attention_fp8kv" not in fallbacks.counts(), fallbacks.counts()
    assert torch.equal(runs["packed"], runs["gather"])
    assert torch.equal(runs["packed"], runs["graph"])


def test_fused_norm_profile_runs_both_fused_kernels_and_graph_decode_replays_them():
    """Profile fused-norm on CUDA, tiny widened to head_dim 512 (the KV-path kernel's width) and flip-free:
    ``rms_norm_act_quant`` and ``kv_norm_rope_fp8`` run as kernels (no fallback logged); the logits stay within cosine
    0.999 of the unfused reference on the same GPU (the KV kernel's FMA rotation flips a bf16 rounding on a few
    elements, which the next layer's e4m3 rounding can grow); graph decode replays the eager steps bit for bit."""
    cfg = ModelConfig.preset("tiny").replace(head_dim=512, index_topk=1024, n_activated_experts=8, n_hash_layers=0)
    ckpt = synthesize(cfg, seed=0)
    ids = default_prompt(4096, 300)
    runs = {}
    for name, profile in (("reference", "reference"), ("fused", "fused-norm"), ("graph", "fused-norm")):
        fallbacks.reset()
        reset_used()
        model = ProductionModel(ckpt, profile, max_context=320, device="cuda")
        s = GraphDecodeSession(model) if name == "graph" else model.session()
        runs[name] = torch.cat([s.prefill(ids)[-1:], *(s.step(t)[None] for t in ids[:8])]).cpu()
        if name == "fused":
            used = implementations_used()
            assert used["rms_norm_act_quant"] == used["kv_norm_rope_fp8"] == "triton", used
            assert not {"rms_norm_act_quant", "kv_norm_rope_fp8"} & set(fallbacks.counts()), fallbacks.counts()
    cos = torch.nn.functional.cosine_similarity(runs["fused"].double(), runs["reference"].double(), dim=-1)
    assert cos.min() > 0.999, cos
    assert torch.equal(runs["fused"], runs["graph"])


def test_decode_steps_read_the_stored_weights_and_graph_replays_give_their_bits(tiny):
    """On the GPU a decode step reads the FP8 weights (wo_a's grouped projection too) and FP4 routed experts as
    stored, and the compressors' bf16 wkv / wgate as one stacked weight (the GEMV kernels ``fp8_weight_linear`` /
    ``fp4_picked_linear`` / ``fp32_linear``, no fallback); a CUDA-graph replay gives the eager steps' bits; the
    logits agree with the same model with the ops on their emulations (the dequantized weights)."""
    ids = default_prompt(4096, 48)

    def run(session) -> torch.Tensor:
        out = [session.prefill(ids[:40])[-1]]
        return torch.stack(out + [session.step(int(t)) for t in ids[40:]]).cpu()

    fallbacks.reset()
    model = ProductionModel(tiny, max_context=64, device="cuda")
    eager = model.session()
    kernels = run(eager)
    assert torch.equal(run(GraphDecodeSession(model)), kernels)
    used = eager.counts["implementations"]
    gemvs = ("fp8_weight_linear", "fp4_picked_linear", "fp32_linear")
    assert all(set(used[op]) == {"triton"} for op in gemvs), used
    assert not set(gemvs) & set(fallbacks.counts()), fallbacks.counts()
    with forcing(dict.fromkeys(gemvs, "cpu")):
        emulated = run(ProductionModel(tiny, max_context=64, device="cuda").session())
    cos = torch.nn.functional.cosine_similarity(kernels[1:].double(), emulated[1:].double(), dim=-1)
    assert cos.min() > 0.999, cos
    assert torch.equal(kernels[0], emulated[0])  # the prefill (40 rows) reads the dequantized weights either way
