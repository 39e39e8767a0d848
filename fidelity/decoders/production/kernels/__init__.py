"""GPU production kernels (Triton) registered under the op names of their CPU emulations.

Importing this package never fails: without triton the submodules are not imported (``HAVE_TRITON`` is False), and
:func:`register_available` registers the ``"triton"`` implementations only when triton imports and
``torch.cuda.is_available()``. Registered wrappers accept tensors on any device (CPU inputs are run on the current
CUDA device and the results copied back), so the registry's contract tests apply unchanged.

Ops: ``sparse_attention`` (bf16 KV), ``sparse_attention_fp8kv`` (the packed 584 B/token FP8 cache), ``index_scores``
(bf16 keys), ``index_scores_fp4`` (packed FP4 keys; FP8 tensor cores for decode), ``rms_norm``, ``rms_norm_fp8``
(fused RMSNorm + 1x128 e4m3 quantization; ``rms_norm_act_quant`` the same storing code x scale),
``rms_norm_weightless`` (the per-head query norm in bf16 steps), ``hc_pre`` (fused mixes + Sinkhorn + collapse),
``hc_post`` (post * f + comb-mixed residual in one pass), ``hc_head`` (the final collapse: hc_pre's split-K mixes,
one finishing launch), ``act_linear`` (1x128 FP8 activation quantization in one launch, then the emulation's fp32
GEMM), ``kv_round`` (the 1x64 FP8 round of the KV nope dims), ``indexer_round`` (Hadamard + FP4 round of indexer q /
keys), ``apply_rope``, ``expert`` (its SwiGLU middle in one launch), ``gate`` (after its GEMM),
``compressor_decode`` (a compressor's decode step after its projections), ``kv_norm_rope_fp8`` (kv_norm + RoPE +
that round in one pass, head_dim 512), ``fp8_weight_linear`` / ``fp4_picked_linear`` (decode GEMVs reading the
stored FP8 / FP4 weights; the FP8 one also for wo_a's grouped bf16-input projection), ``fp32_linear`` (the
compressors' fp32 projections at decode, one GEMV over the stored bf16 wkv and wgate). Every plain Triton kernel
here is launched with programmatic dependent launch on sm_90 (``pdl.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

try:  # triton is optional: CPU-only installs have none
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

# op name -> (module, attribute) of the registered wrapper
KERNELS = {
    "sparse_attention": ("sparse_attention", "sparse_attention"),
    "sparse_attention_fp8kv": ("sparse_attention", "sparse_attention_fp8kv_op"),
    "index_scores": ("indexer", "index_scores"),
    "index_scores_fp4": ("indexer", "index_scores_packed"),
    "rms_norm": ("rms_norm", "rms_norm"),
    "rms_norm_fp8": ("rms_norm", "rms_norm_fp8"),
    "rms_norm_act_quant": ("rms_norm", "rms_norm_act_quant"),
    "rms_norm_weightless": ("rms_norm", "rms_norm_weightless"),
    "hc_pre": ("mhc", "hc_pre"),
    "hc_post": ("mhc", "hc_post"),
    "hc_head": ("mhc", "hc_head"),
    "act_linear": ("act_quant", "act_linear"),
    "kv_round": ("act_quant", "kv_round"),
    "indexer_round": ("indexer_round", "indexer_round"),
    "apply_rope": ("rope", "apply_rope"),
    "expert": ("expert", "expert"),
    "gate": ("gate", "gate"),
    "compressor_decode": ("compressor", "compressor_decode"),
    "kv_norm_rope_fp8": ("kv_path", "kv_path"),
    "fp8_weight_linear": ("weight_gemv", "fp8_weight_linear_op"),
    "fp4_picked_linear": ("weight_gemv", "fp4_picked_linear_op"),
    "fp32_linear": ("weight_gemv", "fp32_linear_op"),
}


def available() -> bool:
    """True when the Triton kernels can run here (triton imports and a CUDA device is visible)."""
    return HAVE_TRITON and torch.cuda.is_available()


def load(name: str) -> Callable:
    """The registered wrapper of op ``name`` (imports its module; needs triton)."""
    import importlib

    module, attr = KERNELS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def register_available(register: Callable[[str, str, Callable], None], known: set[str] | None = None) -> list[str]:
    """Register every kernel as implementation ``"triton"`` when :func:`available`; ops not in ``known`` (when
    given) are skipped, so no op appears in the registry without its CPU emulation. Returns the names."""
    if not available():
        return []
    names = [n for n in KERNELS if known is None or n in known]
    for name in names:
        register(name, "triton", load(name))
    return names
