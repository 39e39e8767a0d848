"""Writing a checkpoint (:func:`save_checkpoint`): a layout written atomically (temp dir + rename), quantized as the
release is."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from fidelity.model import formats
from fidelity.model.checkpoint import Checkpoint
from fidelity.model.config import ModelConfig
from fidelity.model.layouts import (
    INDEX_FILE,
    LAYOUTS,
    hf_saved_key,
    scale_key,
)
from fidelity.model.weights import FP4_BLOCK, FP8_BLOCK, stored_forms, stored_nbytes

# ---- writing -----------------------------------------------------------------------------------------------


def save_checkpoint(
    ckpt: Checkpoint,
    directory: str | Path,
    layout: str = "deepseek",
    *,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``ckpt`` as ``layout`` into ``directory`` atomically (temp dir next to it, then rename).

    deepseek: release names, FP8 e4m3 128x128 + e8m0 ``.scale``, FP4 experts int8-packed + e8m0 1x32 scales,
    config.json in transformers' spelling (as the HF release).  official: the same tensors with ``wo_a``
    dequantized to bf16, one ``model0-mp1.safetensors``, config.json in ModelArgs spelling.  transformers:
    ``save_pretrained`` names, every float tensor as fp32 (exact), config.json in transformers' spelling without
    ``quantization_config``.  Quantized tensors already stored quantized are written as is; others are
    quantized with :mod:`fidelity.model.formats` (exact iff their values are representable).
    ``max_shard_bytes``: split into ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.
    A non-empty existing directory is replaced only with ``overwrite=True``.  Returns the directory.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, found {layout!r}")
    target = Path(directory)
    _check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _write_tensors(ckpt, tmp, layout, max_shard_bytes)
        config = _config_dict(ckpt.config, layout)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp and safetensors make them private; a checkpoint is an ordinary folder
        for f in tmp.iterdir():
            f.chmod(0o644)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target}: directory exists and is not empty (pass overwrite=True to replace it)")


def _replace_dir(tmp: Path, target: Path) -> None:
    if not target.exists():
        tmp.rename(target)
        return
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _config_dict(config: ModelConfig, layout: str) -> dict:
    if layout == "official":
        return config.to_official_dict()
    d = config.to_hf_dict()
    d["max_position_embeddings"] = int(d["max_position_embeddings"])  # transformers' config wants an int
    if layout == "transformers":
        d.pop("quantization_config", None)  # weights are unquantized fp32
        d["dtype"] = "float32"
    return d


def _shards(ckpt: Checkpoint, layout: str, max_shard_bytes: int | None) -> list[list[str]]:
    """Group canonical names into shards of at most ``max_shard_bytes`` (a tensor and its scale together)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in ckpt.names():
        n = stored_nbytes(ckpt.spec(name), layout)
        if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def _shard_name(i: int, n: int, layout: str) -> str:
    if n > 1:
        return f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return "model0-mp1.safetensors" if layout == "official" else "model.safetensors"


def _write_tensors(ckpt: Checkpoint, out: Path, layout: str, max_shard_bytes: int | None) -> None:
    shards = _shards(ckpt, layout, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        fname = _shard_name(i, len(shards), layout)
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            tensors.update(_to_layout(ckpt, name, layout))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _to_layout(ckpt: Checkpoint, name: str, layout: str) -> dict[str, torch.Tensor]:
    """Stored key -> tensor for canonical ``name`` in ``layout``."""
    spec = ckpt.spec(name)
    if layout == "transformers":
        x = ckpt[name]
        return {hf_saved_key(name): (x.long() if spec.fmt == "int64" else x.float()).contiguous()}
    want, want_scale = stored_forms(spec, layout)
    if spec.fmt == "fp8" and want_scale is not None:
        codes, scale = _as_quantized(ckpt, name, "fp8")
        return {name: codes, scale_key(name): scale}
    if spec.fmt == "fp4":
        packed, scale = _as_quantized(ckpt, name, "fp4")
        return {name: packed.view(torch.int8), scale_key(name): scale}
    dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}[want.dtypes[0]]
    return {name: ckpt[name].to(dtype).contiguous()}


def _as_quantized(ckpt: Checkpoint, name: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, e8m0 scale) of ``name``: as stored when already ``fmt``, else quantized from its values."""
    st = ckpt.stored(name)
    if st.fmt == fmt:
        data = st.data.view(torch.uint8) if fmt == "fp4" else st.data
        return data.contiguous(), st.scale.view(torch.float8_e8m0fnu).contiguous()
    x = ckpt[name]
    codes, scale = formats.quantize_fp8(x, FP8_BLOCK) if fmt == "fp8" else formats.quantize_fp4(x, FP4_BLOCK)
    return codes, scale.view(torch.float8_e8m0fnu)
