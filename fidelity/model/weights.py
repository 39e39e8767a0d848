"""The weight schema of a DSv4 config (spec §2): every canonical tensor's name, shape and release format, the one
list the loader, the writer, the synthesizer and both models read (:func:`expected_tensors`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from fidelity.model.config import ModelConfig

FP8_BLOCK = (128, 128)
FP4_BLOCK = 32
QUANTIZED = ("fp8", "fp4")
FLOAT_DT = ("F32", "BF16", "F16")  # safetensors dtypes a transformers-layout float tensor may take
PACKED_FP4_DT = ("I8", "U8", "F4")  # ... and a packed FP4 weight



# ---- what a config implies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor: logical ``shape`` and release format ``fmt`` (bf16/fp32/int64/fp8/fp4), spec §2."""

    name: str
    shape: tuple[int, ...]
    fmt: str

    @property
    def quantized(self) -> bool:
        return self.fmt in QUANTIZED


def fp32_nbytes(config: ModelConfig) -> int:
    """Bytes of every canonical tensor of ``config`` in fp32 (what a model that dequantized everything holds)."""
    return 4 * sum(math.prod(spec.shape) for spec in expected_tensors(config).values())


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """ue8m0 scale shape of an FP8 weight [out, in]: [ceil(out/128), ceil(in/128)] (spec §2)."""
    return (-(-shape[0] // FP8_BLOCK[0]), -(-shape[1] // FP8_BLOCK[1]))


def fp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed codes [out, in/2], ue8m0 scales [out, in/32]) of an FP4 weight [out, in] (spec §2)."""
    return (shape[0], shape[1] // 2), (shape[0], shape[1] // FP4_BLOCK)


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every canonical tensor of ``config`` (MTP excluded) -> TensorSpec, in forward order (spec §2).

    Formats follow the release: FP8 128x128 for the attention/shared-expert projections (bf16 if
    ``config.dtype != "fp8"``), FP4 1x32 routed experts when ``config.expert_dtype == "fp4"`` (else the FP8
    rule), bf16 norms/embeddings/gates/compressors, fp32 sinks/hc/ape/bias, int64 ``tid2eid``.
    """
    c = config
    specs: dict[str, TensorSpec] = {}

    def add(name: str, shape: tuple[int, ...], fmt: str) -> None:
        specs[name] = TensorSpec(name, tuple(int(s) for s in shape), fmt)

    add("embed.weight", (c.vocab_size, c.dim), "bf16")
    for i in range(c.n_layers):
        _layer_specs(c, i, add)
    add("norm.weight", (c.dim,), "bf16")
    add("hc_head_fn", (c.hc_mult, c.hc_mult * c.dim), "fp32")
    add("hc_head_base", (c.hc_mult,), "fp32")
    add("hc_head_scale", (1,), "fp32")
    add("head.weight", (c.vocab_size, c.dim), "bf16")
    return specs


def _linear_fmt(c: ModelConfig) -> str:
    return "fp8" if c.dtype == "fp8" else "bf16"


def _layer_specs(c: ModelConfig, i: int, add: Callable[[str, tuple[int, ...], str], None]) -> None:
    p, mix = f"layers.{i}.", (2 + c.hc_mult) * c.hc_mult
    add(p + "attn_norm.weight", (c.dim,), "bf16")
    for hc in ("hc_attn", "hc_ffn"):
        add(p + hc + "_fn", (mix, c.hc_mult * c.dim), "fp32")
        add(p + hc + "_base", (mix,), "fp32")
        add(p + hc + "_scale", (3,), "fp32")
    _attn_specs(c, i, add)
    add(p + "ffn_norm.weight", (c.dim,), "bf16")
    _ffn_specs(c, i, add)


def _attn_specs(c: ModelConfig, i: int, add: Callable[[str, tuple[int, ...], str], None]) -> None:
    p, w, hd, r = f"layers.{i}.attn.", _linear_fmt(c), c.head_dim, c.ratio(i)
    add(p + "attn_sink", (c.n_heads,), "fp32")
    add(p + "wq_a.weight", (c.q_lora_rank, c.dim), w)
    add(p + "q_norm.weight", (c.q_lora_rank,), "bf16")
    add(p + "wq_b.weight", (c.n_heads * hd, c.q_lora_rank), w)
    add(p + "wkv.weight", (hd, c.dim), w)
    add(p + "kv_norm.weight", (hd,), "bf16")
    add(p + "wo_a.weight", (c.o_groups * c.o_lora_rank, c.n_heads * hd // c.o_groups), w)
    add(p + "wo_b.weight", (c.dim, c.o_groups * c.o_lora_rank), w)
    if r > 0:
        _compressor_specs(c, p + "compressor.", r, hd, add)
    if r == 4:
        add(p + "indexer.wq_b.weight", (c.index_n_heads * c.index_head_dim, c.q_lora_rank), w)
        add(p + "indexer.weights_proj.weight", (c.index_n_heads, c.dim), "bf16")
        _compressor_specs(c, p + "indexer.compressor.", 4, c.index_head_dim, add)


def _compressor_specs(
    c: ModelConfig, p: str, ratio: int, hd: int, add: Callable[[str, tuple[int, ...], str], None]
) -> None:
    coff = 2 if ratio == 4 else 1
    add(p + "wkv.weight", (coff * hd, c.dim), "bf16")
    add(p + "wgate.weight", (coff * hd, c.dim), "bf16")
    add(p + "ape", (ratio, coff * hd), "fp32")
    add(p + "norm.weight", (hd,), "bf16")


def _ffn_specs(c: ModelConfig, i: int, add: Callable[[str, tuple[int, ...], str], None]) -> None:
    p, w = f"layers.{i}.ffn.", _linear_fmt(c)
    ex = "fp4" if c.expert_dtype == "fp4" else w
    add(p + "gate.weight", (c.n_routed_experts, c.dim), "bf16")
    if c.is_hash_layer(i):
        add(p + "gate.tid2eid", (c.vocab_size, c.n_activated_experts), "int64")
    else:
        add(p + "gate.bias", (c.n_routed_experts,), "fp32")
    for j in range(c.n_routed_experts):
        _mlp_specs(c, f"{p}experts.{j}.", ex, add)
    _mlp_specs(c, p + "shared_experts.", w, add)


def _mlp_specs(c: ModelConfig, p: str, fmt: str, add: Callable[[str, tuple[int, ...], str], None]) -> None:
    add(p + "w1.weight", (c.moe_inter_dim, c.dim), fmt)
    add(p + "w2.weight", (c.dim, c.moe_inter_dim), fmt)
    add(p + "w3.weight", (c.moe_inter_dim, c.dim), fmt)


# ---- how a layout stores each tensor ------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredForm:
    """What one stored tensor must look like: its shape and the safetensors dtypes accepted."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


def stored_forms(spec: TensorSpec, layout: str) -> tuple[StoredForm, StoredForm | None]:
    """What the stored weight (and its scale, if any) must look like in ``layout`` (spec §2, convert.py)."""
    if layout == "transformers":
        dtypes = ("I64", "I32") if spec.fmt == "int64" else FLOAT_DT
        return StoredForm(spec.shape, dtypes), None
    if spec.fmt == "fp8" and layout == "official" and spec.name.endswith("attn.wo_a.weight"):
        return StoredForm(spec.shape, ("BF16",)), None
    if spec.fmt == "fp8":
        return StoredForm(spec.shape, ("F8_E4M3",)), StoredForm(fp8_scale_shape(spec.shape), ("F8_E8M0",))
    if spec.fmt == "fp4":
        packed, scales = fp4_shapes(spec.shape)
        return StoredForm(packed, PACKED_FP4_DT), StoredForm(scales, ("F8_E8M0",))
    plain = {"bf16": ("BF16",), "fp32": ("F32",), "int64": ("I64", "I32")}
    return StoredForm(spec.shape, plain[spec.fmt]), None


_ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "F4": 1, "BF16": 2, "F32": 4, "I64": 8}


def stored_nbytes(spec: TensorSpec, layout: str = "deepseek") -> int:
    """Bytes the tensor (and its scale) take on disk in ``layout`` (the release's by default); no data read."""
    if layout == "transformers":
        return math.prod(spec.shape) * (8 if spec.fmt == "int64" else 4)
    return sum(math.prod(f.shape) * _ITEMSIZE[f.dtypes[0]] for f in stored_forms(spec, layout) if f is not None)
