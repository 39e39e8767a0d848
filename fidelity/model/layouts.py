"""Tensor-name maps between canonical DSv4 names and the three on-disk layouts (spec §2).

Canonical names are the official inference names (``inference/model.py``), e.g. ``embed.weight``,
``layers.3.attn.wq_a.weight``, ``layers.3.ffn.experts.7.w1.weight``; a quantized weight ``X.weight``
keeps its ue8m0 scale next to it.

Layouts:

- ``deepseek`` (the HF release, ``deepseek-ai/DeepSeek-V4-*``): canonical names, **no** ``model.``
  prefix, scales named ``X.scale``. Evidence: transformers' ``conversion_mapping.py`` anchors
  ``^embed\\.weight`` / ``^head\\.weight`` / ``^hc_head_fn`` (bare top-level keys); its FP8 quantizer
  renames ``^(.+)\\.scale`` -> ``\\1.weight_scale_inv`` on load (so the release says ``.scale``); vLLM's
  DSv4 weight mapper tests list ``layers.5.attn.wq_a.scale``, ``layers.0.ffn.gate.bias``,
  ``embed.weight`` as the release's names. On load we also accept the V3-era spellings that
  ``convert.py`` normalises: a ``model.`` prefix, ``X.weight_scale_inv`` and ``ffn.gate.e_score_correction_bias``.
- ``official`` (``convert.py`` output): the same names; only the storage differs (``wo_a`` dequantized
  to BF16, experts viewed as ``float4_e2m1fn_x2``), see ``fidelity.model.checkpoint``.
- ``transformers``: what ``DeepseekV4ForCausalLM.save_pretrained`` writes in transformers 5.24 (the
  conversion map run backwards: ``model.`` + canonical, except ``model.embed_tokens.weight``,
  ``head.weight``, ``model.hc_head.hc_{fn,base,scale}`` and ``attn.norm.weight`` for ``attn.kv_norm``),
  and, on load only, the raw module names of the HF state dict (``model.layers.i.self_attn.q_a_proj.weight``,
  fused ``mlp.experts.gate_up_proj [E, 2*inter, dim]`` gate-then-up and ``mlp.experts.down_proj [E, dim, inter]``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

LAYOUTS = ("deepseek", "official", "transformers")
INDEX_FILE = "model.safetensors.index.json"  # the shard map of a sharded checkpoint

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_TP_FILE = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")

# transformers module names, canonical per-layer suffix -> HF suffix (``model.layers.{i}.`` prefix)
_HF_MODULE_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_HF_MODULE_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_HF_SAVED_TOP = {**_HF_MODULE_TOP, "head.weight": "head.weight"}


@dataclass(frozen=True)
class Source:
    """Where a canonical tensor lives in a file: ``key``, optionally ``index`` into a fused tensor.

    ``fused_shape`` is the full shape the fused tensor must have (checked once per fused key).
    """

    key: str
    index: tuple[int, int, int] | None = None  # (expert, row_start, row_stop)
    fused_shape: tuple[int, ...] | None = None


def split_layer(name: str) -> tuple[int | None, str]:
    """``layers.3.attn.wkv.weight`` -> (3, ``attn.wkv.weight``); top-level names -> (None, name)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def scale_key(weight_key: str) -> str:
    """Release scale name of a quantized weight: ``X.weight`` -> ``X.scale`` (spec §2, convert.py)."""
    return weight_key.removesuffix(".weight") + ".scale"


def release_aliases(name: str) -> list[str]:
    """Stored spellings accepted for a canonical name in the deepseek/official layouts (first = written)."""
    names = [name]
    if name.endswith(".gate.bias"):
        names.append(name.removesuffix(".bias") + ".e_score_correction_bias")
    return names + ["model." + n for n in names]


def release_scale_aliases(weight_name: str) -> list[str]:
    """Stored spellings accepted for the scale of canonical weight ``weight_name`` (first = written)."""
    base = weight_name.removesuffix(".weight")
    names = [base + ".scale", base + ".weight_scale_inv"]
    return names + ["model." + n for n in names]


def hf_saved_key(name: str) -> str:
    """What ``save_pretrained`` writes for canonical ``name`` (transformers 5.24)."""
    layer, rest = split_layer(name)
    if layer is None:
        return _HF_SAVED_TOP.get(name, "model." + name)
    if rest == "attn.kv_norm.weight":
        rest = "attn.norm.weight"
    return f"model.layers.{layer}.{rest}"


def hf_module_source(name: str, n_experts: int, inter: int, dim: int) -> Source:
    """Where canonical ``name`` lives in the HF state dict (module names; fused experts sliced)."""
    layer, rest = split_layer(name)
    if layer is None:
        return Source(_HF_MODULE_TOP.get(name, "model." + name))
    prefix = f"model.layers.{layer}."
    m = _EXPERT.match(rest)
    if m is None:
        return Source(prefix + _HF_MODULE_LAYER.get(rest, rest))
    j, w = int(m.group(1)), m.group(2)
    if w == "w2":
        return Source(prefix + "mlp.experts.down_proj", (j, 0, dim), (n_experts, dim, inter))
    start = 0 if w == "w1" else inter
    return Source(prefix + "mlp.experts.gate_up_proj", (j, start, start + inter), (n_experts, 2 * inter, dim))


def transformers_sources(name: str, n_experts: int, inter: int, dim: int) -> list[Source]:
    """Accepted transformers-layout sources for ``name``: the save_pretrained key first, then module names."""
    saved = Source(hf_saved_key(name))
    module = hf_module_source(name, n_experts, inter, dim)
    return [saved] if module == saved else [saved, module]


def is_ignored_key(key: str) -> bool:
    """MTP tensors (``mtp.*``, any prefix) are accepted and ignored."""
    return key.startswith(("mtp.", "model.mtp."))


def tp_shard_info(filename: str) -> tuple[int, int] | None:
    """``model{rank}-mp{n}.safetensors`` -> (rank, n); None for other names."""
    m = _TP_FILE.match(filename)
    return (int(m.group(1)), int(m.group(2))) if m else None


_HF_MARKERS = ("model.embed_tokens.weight", "lm_head.weight", "model.hc_head.hc_fn")


def detect_layout(keys: Iterable[str], filenames: Iterable[str], wo_a_dtype: str | None) -> str:
    """Guess the layout from stored key names, file names and the stored dtype of a ``wo_a`` weight.

    transformers: HF-only names (``model.embed_tokens.weight``, ``lm_head.weight``, ``.self_attn.``,
    ``.mlp.``, ``model.hc_head.``); official: ``model{r}-mp{n}.safetensors`` files or a non-FP8 ``wo_a``
    (convert.py dequantizes it to BF16); deepseek otherwise.
    """
    for key in keys:
        if key in _HF_MARKERS or ".self_attn." in key or ".mlp." in key:
            return "transformers"
    if any(tp_shard_info(f) for f in filenames):
        return "official"
    if wo_a_dtype is not None and wo_a_dtype not in ("F8_E4M3", "F8_E4M3FN"):
        return "official"
    return "deepseek"
