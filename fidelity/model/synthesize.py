"""Deterministic random DSv4 checkpoints, stored exactly as a release stores them (spec §2).

``synthesize(config, seed)`` draws every tensor of :func:`fidelity.model.weights.expected_tensors` from its own
CPU generator, seeded from ``(seed, tensor name)``, so a tensor does not depend on the others or on the
order of generation.  Normal draws are Irwin-Hall sums of 4 integer uniforms (``torch.randint``, mt19937),
added exactly in int32 and scaled with IEEE float32 ops, so the same seed gives bit-identical tensors on every
machine (torch's own ``randn`` takes a different SIMD path on AVX2 / non-AVX2 CPUs).  Values are then stored
as the release does: FP8 e4m3 128x128 / FP4 e2m1 1x32 codes with ue8m0 scales (quantized once with
:mod:`fidelity.model.formats`), bf16 rounded RNE.  Re-quantizing the dequantized values may shift a block's scale
by one binade (when its amax rounded down) but always gives the same values, so round trips are exact.

Init (N = unit-variance Irwin-Hall(4), |N| <= 2*sqrt(3); fan_in = shape[-1]), chosen so that activations stay
O(1) through every layer (residual RMS grows slowly, like sqrt(layers)) and nothing saturates:

- linear weights (wq_a, wq_b, wkv, wo_a, wo_b, compressor/indexer projections, gate, experts, head):
  ``N / sqrt(fan_in)``, so each projection keeps unit RMS; attention logits q.k/sqrt(head_dim) ~ N(0, 1).
- ``embed.weight``: ``N`` (unit-RMS residual streams at the start).
- RMSNorm weights (``*norm.weight``): ``1 + 0.1 N``.
- ``attn_sink``: ``N`` (nonzero sinks, some heads with a visible sink share).
- ``ape`` (compressor position biases): ``0.5 N``.
- ``hc_*_fn`` / ``hc_head_fn``: ``0.5 N / sqrt(hc*dim)``: the mixes (rsqrt-normalised) are ~ N(0, 0.25).
- ``hc_*_scale`` / ``hc_head_scale``: ``1 + 0.1 N``.
- ``hc_*_base`` [(2+hc)*hc]: pre and post parts ``0.5 N`` (sigmoids around 0.5, unsaturated); comb part
  ``0.5 N + 1`` on the diagonal of the hc x hc block (streams mix but keep some identity; non-symmetric).
  ``hc_head_base``: ``0.5 N``.
- ``ffn.gate.bias``: ``0.1 N`` (moves some top-k choices, does not dominate sqrt(softplus) scores ~ 0.5-1.3).
- ``ffn.gate.tid2eid`` [vocab, k]: k distinct random experts per token id (uniform).
- shared expert outlier channels: every 16th intermediate channel of ``shared_experts.w1/w3`` is scaled by
  ``OUTLIER_GAIN`` (and the matching ``w2`` column by its inverse), so a few pre-activations exceed
  ``swiglu_limit`` (10) as in trained models: the clamp binds and a port without it is visible.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

from fidelity.model import formats
from fidelity.model.checkpoint import Checkpoint, StoredTensor
from fidelity.model.config import ModelConfig
from fidelity.model.weights import FP4_BLOCK, FP8_BLOCK, TensorSpec, expected_tensors

__all__ = ["store", "synthesize", "synth_tensor"]

_IH_SCALE = math.sqrt(3.0) / 2**24  # 1 / std of a sum of 4 uniforms on [0, 2^24)
_HC_BASE = re.compile(r"(^|\.)hc_(attn|ffn)_base$")


def synthesize(config: ModelConfig, seed: int = 0, *, lazy: bool = False, device: str | torch.device = "cpu",
               keep: bool | None = None) -> Checkpoint:
    """A random checkpoint (layout "synthetic") for ``config``; same ``seed`` -> bit-identical tensors.

    Eager by default (all tensors held quantized in memory). ``lazy=True`` generates each tensor when it is
    first read, in its stored format; ``keep`` (default: on a GPU) holds what was generated so that a second read
    costs nothing. ``device``: where tensors are generated and held. A GPU draws from its own generator, so its
    tensors differ from the CPU's (the same on every run of the same GPU kind); the CPU's are the same everywhere.
    """
    specs = expected_tensors(config)
    device = torch.device(device)
    if lazy or device.type != "cpu":
        held: dict[str, StoredTensor] = {}
        keep = device.type != "cpu" if keep is None else keep

        def fetch(name: str) -> StoredTensor:
            st = held.get(name) or synth_tensor(specs[name], config, seed, device)
            if keep:
                held[name] = st
            return st

        ckpt = Checkpoint(config, fetch, list(specs), layout="synthetic")
        if not lazy:
            for name in specs:
                fetch(name)
    else:
        ckpt = Checkpoint.from_tensors(config, {name: synth_tensor(spec, config, seed) for name, spec in specs.items()})
    ckpt.origin["seed"] = seed
    return ckpt


def synth_tensor(spec: TensorSpec, config: ModelConfig, seed: int = 0,
                 device: str | torch.device = "cpu") -> StoredTensor:
    """Tensor ``spec.name`` of ``synthesize(config, seed)``, stored in its release format ``spec.fmt``, made
    on ``device``."""
    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, spec.name))
    if spec.fmt == "int64":
        return StoredTensor.plain(_tid2eid(spec.shape, config.n_routed_experts, gen))
    return store(_values(spec, config, gen), spec.fmt)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """~N(0, 1) float32: Irwin-Hall sum of 4 integer uniforms in [0, 2^24) (exact in int32), centred and scaled
    to unit variance with IEEE float32 ops only, so the result is the same on every machine."""
    acc = torch.zeros(shape, dtype=torch.int32, device=gen.device)
    for _ in range(4):
        acc += torch.randint(0, 2**24, shape, generator=gen, dtype=torch.int32, device=gen.device)
    return (acc - 2**25).float() * _IH_SCALE


def _values(spec: TensorSpec, config: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """float32 values of ``spec`` following the init table of the module docstring."""
    name, shape = spec.name, spec.shape
    z = _normal(shape, gen)
    if name == "embed.weight":
        return z
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * z
    if name.endswith("attn_sink"):
        return z
    if name.endswith(".ape"):
        return 0.5 * z
    if name.endswith("_fn"):
        return 0.5 * z / math.sqrt(shape[-1])
    if name.endswith("_scale"):
        return 1.0 + 0.1 * z
    if _HC_BASE.search(name):
        return _hc_base(z, config.hc_mult)
    if name.endswith("_base"):
        return 0.5 * z
    if name.endswith("gate.bias"):
        return 0.1 * z
    return _outlier_channels(z / math.sqrt(shape[-1]), name)


OUTLIER_GAIN = 6.0
OUTLIER_STRIDE = 16
_SHARED = re.compile(r"shared_experts\.(w1|w2|w3)\.weight$")


def _outlier_channels(x: torch.Tensor, name: str) -> torch.Tensor:
    """Scale every OUTLIER_STRIDE-th intermediate channel of a shared expert (rows of w1/w3, columns of w2)."""
    m = _SHARED.search(name)
    if m is None:
        return x
    if m.group(1) == "w2":
        x[:, ::OUTLIER_STRIDE] /= OUTLIER_GAIN
    else:
        x[::OUTLIER_STRIDE] *= OUTLIER_GAIN
    return x


def _hc_base(z: torch.Tensor, hc: int) -> torch.Tensor:
    """[(2+hc)*hc]: pre/post ``0.5 N``; comb ``0.5 N`` + 1 on the diagonal of the hc x hc block."""
    base = 0.5 * z
    base[2 * hc :] += torch.eye(hc, dtype=base.dtype, device=base.device).flatten()
    return base


def _tid2eid(shape: tuple[int, ...], n_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[vocab, k] int64: k distinct experts per row, uniform (ties broken by expert id, so exact)."""
    vocab, k = shape
    keys = torch.randint(0, 2**24, (vocab, n_experts), generator=gen, dtype=torch.int64, device=gen.device)
    keys = keys * n_experts + torch.arange(n_experts, dtype=torch.int64, device=gen.device)
    return keys.topk(k, dim=1).indices.to(torch.int64)


def store(x: torch.Tensor, fmt: str) -> StoredTensor:
    """Store float32 ``x`` in release format ``fmt`` (one quantization, as a release is made)."""
    if fmt == "bf16":
        return StoredTensor.plain(x.to(torch.bfloat16))
    if fmt == "fp32":
        return StoredTensor.plain(x)
    if fmt == "fp8":
        codes, scale = formats.quantize_fp8(x, FP8_BLOCK)
    else:
        codes, scale = formats.quantize_fp4(x, FP4_BLOCK)
        codes = codes.view(torch.int8)  # the release stores packed FP4 as I8
    return StoredTensor(codes, fmt, scale.view(torch.float8_e8m0fnu))
