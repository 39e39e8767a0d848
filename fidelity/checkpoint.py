"""DSv4 checkpoints: canonical tensors over lazy safetensors access (spec §2; docs/design.md "Scale from the start").

A :class:`Checkpoint` maps canonical names (official inference names, e.g. ``layers.3.attn.wq_a.weight``) to
tensors.  Weights stay in their stored format (FP8/FP4 codes + ue8m0 scales, bf16, fp32) and are read from
disk and dequantized only when asked for; nothing materialises the whole model in fp32.

- :func:`expected_tensors`: the one list of canonical tensors, shapes and release formats for a config.
- :func:`load_checkpoint`: a directory with ``config.json`` + ``*.safetensors`` (single file, sharded with
  ``model.safetensors.index.json``), in any layout of :mod:`fidelity.layouts`, detected automatically.
  Every problem found is collected into one :class:`CheckpointError`.  No pickle anywhere.
- :func:`save_checkpoint`: writes a layout atomically (temp dir + rename), quantized as the release is.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fidelity import formats
from fidelity.config import ConfigError, ModelConfig
from fidelity.layouts import (
    LAYOUTS,
    Source,
    detect_layout,
    hf_saved_key,
    is_ignored_key,
    release_aliases,
    release_scale_aliases,
    scale_key,
    tp_shard_info,
    transformers_sources,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "StoredTensor",
    "TensorSpec",
    "expected_tensors",
    "load_checkpoint",
    "save_checkpoint",
]

FP8_BLOCK = (128, 128)
FP4_BLOCK = 32
QUANTIZED = ("fp8", "fp4")
INDEX_FILE = "model.safetensors.index.json"
MAX_LISTED = 200  # problems shown in the message; all of them stay in CheckpointError.problems

_FLOAT_DT = ("F32", "BF16", "F16")
_PACKED_FP4_DT = ("I8", "U8", "F4")
_PLAIN_FMT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64"}
_PLAIN_FMT.update({torch.int64: "int64", torch.int32: "int32"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; ``problems`` lists every problem found (tensor, expected, found, file)."""

    def __init__(self, problems: list[str], source: str = "checkpoint"):
        self.problems = list(problems)
        shown = [f"  - {p}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            shown.append(f"  ... and {len(self.problems) - MAX_LISTED} more (see CheckpointError.problems)")
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n" + "\n".join(shown))


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


# ---- stored tensors ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as stored: ``data`` (+ ue8m0 ``scale`` for fp8/fp4) and its format tag ``fmt``.

    fp8: data float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/128), ceil(in/128)].
    fp4: data int8/uint8/float4_e2m1fn_x2 [out, in/2] (low nibble = element 2i), scale float8_e8m0fnu [out, in/32].
    Otherwise ``fmt`` names data's dtype (bf16, fp32, fp16, fp64, int64, int32) and scale is None.
    """

    data: torch.Tensor
    fmt: str
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt in QUANTIZED and self.scale is None:
            raise ValueError(f"StoredTensor: fmt {self.fmt!r} needs a scale")
        if self.fmt not in QUANTIZED and self.fmt != _PLAIN_FMT.get(self.data.dtype):
            raise ValueError(f"StoredTensor: fmt {self.fmt!r} does not describe dtype {self.data.dtype}")

    @classmethod
    def plain(cls, data: torch.Tensor) -> StoredTensor:
        """An unquantized tensor (fmt from its dtype)."""
        return cls(data, _PLAIN_FMT[data.dtype])

    def dequantize(self) -> torch.Tensor:
        """Exact values (spec §2): fp8 codes*scale per 128x128 block, fp4 nibble*scale per 1x32 -> float32;
        unquantized data is returned unchanged."""
        if self.fmt == "fp8":
            return formats.dequantize_fp8(self.data, self.scale, FP8_BLOCK)
        if self.fmt == "fp4":
            return formats.dequantize_fp4(self.data, self.scale, FP4_BLOCK)
        return self.data


def _memory_problem(spec: TensorSpec, st: StoredTensor) -> str:
    """What is wrong with an in-memory StoredTensor for ``spec`` ("" if nothing)."""
    if spec.quantized and st.fmt == spec.fmt:
        want = fp4_shapes(spec.shape)[0] if spec.fmt == "fp4" else spec.shape
    else:
        want = spec.shape
    if tuple(st.data.shape) != tuple(want):
        return f"wrong shape for {spec.name!r} ({st.fmt}): expected {list(want)}, found {list(st.data.shape)}"
    return ""


def as_canonical(spec: TensorSpec, stored: StoredTensor) -> torch.Tensor:
    """Canonical value of a stored tensor: float32 for fp8/fp4 weights (however stored), int64 for ``tid2eid``,
    the stored dtype otherwise (bf16 stays bf16, fp32 stays fp32)."""
    x = stored.dequantize()
    if spec.quantized:
        return x.float()
    if spec.fmt == "int64":
        return x.long()
    return x


# ---- the checkpoint ----------------------------------------------------------------------------------------


class Checkpoint:
    """Canonical DSv4 tensors of one model: ``ckpt[name]`` (dequantized at use), ``ckpt.stored(name)``.

    ``config``: the ModelConfig; ``layout``: "deepseek" / "official" / "transformers" (from disk) or
    "synthetic"; ``path``: the directory (None in memory); ``ignored``: stored keys accepted but unused (MTP);
    ``origin``: how an in-memory checkpoint was made (``synthesize`` records its seed, the CLI its preset).
    """

    def __init__(
        self,
        config: ModelConfig,
        fetch: Callable[[str], StoredTensor],
        names: Iterable[str],
        *,
        layout: str,
        path: Path | None = None,
        ignored: Iterable[str] = (),
        close: Callable[[], None] | None = None,
    ):
        self.config = config
        self.layout = layout
        self.path = path
        self.ignored = list(ignored)
        self.origin: dict = {}
        self._specs = expected_tensors(config)
        self._names = [n for n in names]
        self._known = set(self._names)
        self._fetch = fetch
        self._close = close

    @classmethod
    def from_tensors(
        cls, config: ModelConfig, tensors: Mapping[str, StoredTensor], layout: str = "synthetic"
    ) -> Checkpoint:
        """An in-memory checkpoint over ``tensors`` (canonical name -> StoredTensor); names and stored shapes are
        checked against :func:`expected_tensors` (one CheckpointError listing every problem)."""
        specs = expected_tensors(config)
        problems = [f"missing tensor {n!r}" for n in specs if n not in tensors]
        problems += [f"unexpected tensor {n!r}" for n in tensors if n not in specs]
        problems += [p for n, t in tensors.items() if n in specs and (p := _memory_problem(specs[n], t))]
        if problems:
            raise CheckpointError(problems, f"in-memory {layout} checkpoint")
        store = dict(tensors)
        return cls(config, store.__getitem__, list(specs), layout=layout)

    def names(self) -> list[str]:
        """Canonical tensor names, in :func:`expected_tensors` order."""
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def spec(self, name: str) -> TensorSpec:
        """Shape and release format of canonical tensor ``name``."""
        self._check(name)
        return self._specs[name]

    def stored(self, name: str) -> StoredTensor:
        """Tensor ``name`` as stored (codes + scale for quantized weights), read now."""
        self._check(name)
        return self._fetch(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        """Canonical tensor: dequantized float32 for FP8/FP4 weights, bf16/fp32 as stored, tid2eid int64."""
        return as_canonical(self.spec(name), self.stored(name))

    def close(self) -> None:
        """Release open file handles (reading again reopens them)."""
        if self._close is not None:
            self._close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path else ""
        return f"Checkpoint(layout={self.layout!r}, tensors={len(self._names)}, n_layers={self.config.n_layers}{where})"

    def _check(self, name: str) -> None:
        if name not in self._known:
            raise KeyError(f"{name!r}: not a tensor of this checkpoint (see Checkpoint.names())")


# ---- reading -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _KeyInfo:
    """Header facts of one stored key."""

    file: str
    dtype: str
    shape: tuple[int, ...]  # F4: packed-byte shape (last dim halved), like the torch tensor


@dataclass(frozen=True)
class _Located:
    """Where canonical tensor's data (and scale) live, and the stored format."""

    fmt: str
    weight: Source
    weight_file: str
    scale: str | None = None
    scale_file: str | None = None


@dataclass(frozen=True)
class _Want:
    """What one stored tensor must look like."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


class _Files:
    """Lazily opened safetensors handles of a checkpoint directory."""

    def __init__(self, root: Path):
        self.root = root
        self._handles: dict[str, object] = {}

    def handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.root / file), framework="pt", device="cpu")
        return self._handles[file]

    def read(self, src: Source, file: str) -> torch.Tensor:
        if src.index is None:
            return self.handle(file).get_tensor(src.key)
        j, start, stop = src.index
        return self.handle(file).get_slice(src.key)[j : j + 1, start:stop][0].contiguous()

    def close(self) -> None:
        self._handles.clear()


def _fetcher(files: _Files, plan: dict[str, _Located]) -> Callable[[str], StoredTensor]:
    def fetch(name: str) -> StoredTensor:
        loc = plan[name]
        data = files.read(loc.weight, loc.weight_file)
        if loc.fmt in QUANTIZED:
            scale = files.read(Source(loc.scale), loc.scale_file)
            return StoredTensor(data, loc.fmt, scale)
        return StoredTensor.plain(data)

    return fetch


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open the checkpoint directory ``path`` (config.json + safetensors), validating everything up front.

    Layout (deepseek / official / transformers) is detected from the key names, file names and the stored
    dtype of ``wo_a``.  Raises one CheckpointError listing every problem: config errors, unreadable or
    truncated files, index naming missing shards, missing / unexpected / misshapen / wrong-dtype tensors,
    missing scales, config that disagrees with the weights.  Tensor data is read only on access.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError([f"not a directory: {root}"], str(root))
    problems: list[str] = []
    config = _read_config(root, problems)
    files, index = _list_files(root, problems)
    infos, unreadable = _read_headers(root, files, problems)
    _check_index(index, infos, [f for f in files if f not in unreadable], problems)
    wo_a = next((i.dtype for k, i in infos.items() if k.endswith("attn.wo_a.weight")), None)
    layout = detect_layout(infos, [p.name for p in root.glob("*.safetensors")], wo_a)
    plan: dict[str, _Located] = {}
    if config is not None:
        absent = set(index.values()) - set(files) if index else set()  # shards the index names, not on disk
        plan = _match(config, layout, infos, index, problems, unreadable | absent)
        _check_config_vs_weights(config, layout, infos, problems)
        _check_values(config, root, plan, problems)
    if problems:
        raise CheckpointError(problems, f"checkpoint {root} (layout {layout})")
    store = _Files(root)
    ignored = sorted(k for k in infos if is_ignored_key(k))
    return Checkpoint(
        config, _fetcher(store, plan), list(plan), layout=layout, path=root, ignored=ignored, close=store.close
    )


def _read_config(root: Path, problems: list[str]) -> ModelConfig | None:
    try:
        return ModelConfig.from_file(root / "config.json")
    except ConfigError as err:
        problems.extend(f"config.json: {p}" for p in err.problems)
        return None


def _list_files(root: Path, problems: list[str]) -> tuple[list[str], dict[str, str] | None]:
    """Safetensors files to read (names relative to root) and the index weight_map, if any."""
    index = _read_index(root, problems)
    if index is not None:
        names = sorted(set(index.values()))
        missing = [f for f in names if not (root / f).is_file()]
        for f in missing:
            keys = sorted(k for k, v in index.items() if v == f)
            problems.append(
                f"{INDEX_FILE}: names shard {f!r} (holding {len(keys)} tensor(s), e.g. {keys[0]!r}), "
                "which does not exist"
            )
        files = [f for f in names if f not in missing]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files and index is None:
        problems.append(f"no *.safetensors files in {root}")
    return _drop_tp_shards(files, problems), index


def _drop_tp_shards(files: list[str], problems: list[str]) -> list[str]:
    """``model{r}-mp{n}.safetensors`` with n > 1 are tensor-parallel slices of the official layout: refused."""
    kept = []
    for f in files:
        tp = tp_shard_info(f)
        if tp is not None and tp[1] > 1:
            problems.append(
                f"{f}: tensor-parallel shard (rank {tp[0]} of mp={tp[1]}); TP shards are not supported, "
                "convert with --model-parallel 1 (one model0-mp1.safetensors)"
            )
        else:
            kept.append(f)
    return kept


def _read_index(root: Path, problems: list[str]) -> dict[str, str] | None:
    path = root / INDEX_FILE
    if not path.exists():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
        return weight_map
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        problems.append(f"{INDEX_FILE}: expected JSON with a 'weight_map' object, found an unusable file ({err})")
        return None


def _read_headers(root: Path, files: list[str], problems: list[str]) -> tuple[dict[str, _KeyInfo], set[str]]:
    """Header facts of every key (data is not read), and the files that could not be read."""
    infos: dict[str, _KeyInfo] = {}
    unreadable: set[str] = set()
    for f in files:
        try:
            with safe_open(str(root / f), framework="pt", device="cpu") as h:
                found = {key: _key_info(f, h.get_slice(key)) for key in h.keys()}
        except (SafetensorError, OSError) as err:
            problems.append(f"{f}: unreadable safetensors file (truncated or corrupt): {err}")
            unreadable.add(f)
            continue
        for key in sorted(found.keys() & infos.keys()):
            problems.append(f"{key!r}: stored twice, in {infos[key].file} and {f}")
        infos.update(found)
    return infos, unreadable


def _key_info(file: str, sl: Any) -> _KeyInfo:
    return _KeyInfo(file, sl.get_dtype(), _header_shape(sl.get_dtype(), sl.get_shape()))


def _header_shape(dtype: str, shape: list[int]) -> tuple[int, ...]:
    """F4 headers count 4-bit elements; report the packed-byte shape torch uses (last dim / 2)."""
    if dtype == "F4" and shape:
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def _check_index(
    index: dict[str, str] | None, infos: dict[str, _KeyInfo], files: list[str], problems: list[str]
) -> None:
    if index is None:
        return
    for key, f in index.items():
        if f in files and (key not in infos or infos[key].file != f):
            found = f"it is in {infos[key].file}" if key in infos else "the shard does not contain it"
            problems.append(f"{INDEX_FILE}: maps {key!r} to {f}, but {found}")


# ---- matching stored keys to canonical tensors -------------------------------------------------------------


def _wants(spec: TensorSpec, layout: str) -> tuple[_Want, _Want | None]:
    """What the stored weight (and its scale, if any) must look like in ``layout`` (spec §2, convert.py)."""
    if layout == "transformers":
        dtypes = ("I64", "I32") if spec.fmt == "int64" else _FLOAT_DT
        return _Want(spec.shape, dtypes), None
    if spec.fmt == "fp8" and layout == "official" and spec.name.endswith("attn.wo_a.weight"):
        return _Want(spec.shape, ("BF16",)), None
    if spec.fmt == "fp8":
        return _Want(spec.shape, ("F8_E4M3",)), _Want(fp8_scale_shape(spec.shape), ("F8_E8M0",))
    if spec.fmt == "fp4":
        packed, scales = fp4_shapes(spec.shape)
        return _Want(packed, _PACKED_FP4_DT), _Want(scales, ("F8_E8M0",))
    plain = {"bf16": ("BF16",), "fp32": ("F32",), "int64": ("I64", "I32")}
    return _Want(spec.shape, plain[spec.fmt]), None


def _candidates(config: ModelConfig, layout: str, name: str) -> list[Source]:
    if layout == "transformers":
        return transformers_sources(name, config.n_routed_experts, config.moe_inter_dim, config.dim)
    return [Source(k) for k in release_aliases(name)]


def _describe(want: _Want) -> str:
    return f"{list(want.shape)} {'/'.join(want.dtypes)}"


def _match(
    config: ModelConfig, layout: str, infos: dict[str, _KeyInfo], index: dict[str, str] | None, problems: list[str],
    unreadable: set[str] = frozenset(),
) -> dict[str, _Located]:
    """Assign stored keys to canonical tensors; report missing / duplicate / misshapen / unexpected keys. Tensors
    missing because they may sit in an unreadable file are reported in one line, not one line each."""
    m = _Matcher(config, layout, infos, index, problems, unreadable)
    plan = {name: loc for name, spec in expected_tensors(config).items() if (loc := m.locate(spec)) is not None}
    m.report_unexpected()
    m.report_unreadable()
    return plan


class _Matcher:
    """Matching state: which stored keys are claimed, which fused HF tensors were already checked."""

    def __init__(
        self,
        config: ModelConfig,
        layout: str,
        infos: dict[str, _KeyInfo],
        index: dict[str, str] | None,
        problems: list[str],
        unreadable: set[str] = frozenset(),
    ):
        self.config, self.layout, self.infos, self.index, self.problems = config, layout, infos, index, problems
        self.unreadable = unreadable
        self.in_unreadable: list[str] = []  # missing tensors that an unreadable file may hold
        self.claimed: set[str] = set()
        self.fused_checked: set[str] = set()

    def locate(self, spec: TensorSpec) -> _Located | None:
        """Where ``spec`` is stored (None after reporting what is wrong with it)."""
        want, want_scale = _wants(spec, self.layout)
        cands = _candidates(self.config, self.layout, spec.name)
        found = [s for s in cands if s.key in self.infos]
        self.claimed.update(s.key for s in found)
        if not found:
            self._missing(spec.name, cands[0].key, want, want_scale is not None)
            return None
        if len(found) > 1:
            self.problems.append(f"{spec.name!r}: stored more than once, as {[s.key for s in found]}")
        src, info = found[0], self.infos[found[0].key]
        ok = self._check_weight(spec.name, src, want, info)
        if want_scale is None:
            return _Located(_plain_fmt(info.dtype), src, info.file) if ok else None
        scale = self._scale(spec.name, src.key, want_scale)
        return _Located(spec.fmt, src, info.file, scale, self.infos[scale].file) if ok and scale else None

    def _missing(self, name: str, key: str, want: _Want, has_scale: bool) -> None:
        if has_scale:  # an orphaned scale is part of this problem, not an unexpected tensor
            self.claimed.update(k for k in release_scale_aliases(name) if k in self.infos)
        if self.unreadable and (self.index is None or self.index.get(key) in self.unreadable):
            self.in_unreadable.append(name)
            return
        hint = ""
        if self.index is not None and key in self.index:
            hint = f" (the index maps it to {self.index[key]}, which is missing or unreadable)"
        self.problems.append(f"missing tensor {name!r}: expected {_describe(want)} as {key!r}{hint}")

    def report_unreadable(self) -> None:
        """One line for the tensors that an unreadable file may hold."""
        if self.in_unreadable:
            shown = ", ".join(repr(n) for n in self.in_unreadable[:3])
            more = f" and {len(self.in_unreadable) - 3} more" if len(self.in_unreadable) > 3 else ""
            self.problems.append(f"{len(self.in_unreadable)} tensors not found ({shown}{more}): they would be in the "
                                 f"missing or unreadable file(s) {', '.join(sorted(self.unreadable))}; repair or "
                                 "replace those first")

    def _check_weight(self, name: str, src: Source, want: _Want, info: _KeyInfo) -> bool:
        """Dtype and shape of one stored weight; a fused HF expert tensor is checked (and reported) once."""
        if src.fused_shape is None:
            return self._check(f"{name!r} ({src.key!r} in {info.file})", want, info)
        want = _Want(src.fused_shape, want.dtypes)
        if src.key in self.fused_checked:
            return info.dtype in want.dtypes and info.shape == want.shape
        self.fused_checked.add(src.key)
        return self._check(f"fused {src.key!r} in {info.file}", want, info)

    def _check(self, what: str, want: _Want, info: _KeyInfo) -> bool:
        ok = True
        if info.dtype not in want.dtypes:
            self.problems.append(f"wrong dtype for {what}: expected {'/'.join(want.dtypes)}, found {info.dtype}")
            ok = False
        if info.shape != want.shape:
            self.problems.append(f"wrong shape for {what}: expected {list(want.shape)}, found {list(info.shape)}")
            ok = False
        return ok

    def _scale(self, name: str, weight_key: str, want: _Want) -> str | None:
        """Key of the ue8m0 scale stored next to quantized weight ``name`` (None after reporting a problem)."""
        cands = release_scale_aliases(name)
        found = [k for k in cands if k in self.infos]
        self.claimed.update(found)
        if not found:
            self.problems.append(
                f"missing scale for {name!r}: expected {cands[0]!r} {_describe(want)} next to the quantized "
                f"weight ({weight_key!r} in {self.infos[weight_key].file})"
            )
            return None
        if len(found) > 1:
            self.problems.append(f"scale of {name!r}: stored more than once, as {found}")
        info = self.infos[found[0]]
        return found[0] if self._check(f"scale {found[0]!r} in {info.file}", want, info) else None

    def report_unexpected(self) -> None:
        for key, info in self.infos.items():
            if key not in self.claimed and not is_ignored_key(key):
                self.problems.append(
                    f"unexpected tensor {key!r} in {info.file}: {list(info.shape)} {info.dtype} "
                    f"(not a {self.layout}-layout tensor of this config)"
                )


def _plain_fmt(st_dtype: str) -> str:
    return {"BF16": "bf16", "F32": "fp32", "F16": "fp16", "I64": "int64", "I32": "int32"}.get(st_dtype, "?")


# ---- config vs weights -------------------------------------------------------------------------------------

_LAYER_IN_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _stored_info(
    config: ModelConfig, layout: str, name: str, infos: dict[str, _KeyInfo]
) -> tuple[str, _KeyInfo] | None:
    for src in _candidates(config, layout, name):
        if src.key in infos and src.index is None:
            return src.key, infos[src.key]
    return None


def _check_config_vs_weights(config: ModelConfig, layout: str, infos: dict[str, _KeyInfo], problems: list[str]) -> None:
    """Name the config fields the weights contradict (dim, vocab, heads, experts, hc_mult, n_layers)."""
    probes = [  # (config field, canonical tensor, axis)
        ("vocab_size", "embed.weight", 0),
        ("dim", "embed.weight", 1),
        ("hc_mult", "hc_head_base", 0),
        ("n_heads", "layers.0.attn.attn_sink", 0),
        ("n_routed_experts", "layers.0.ffn.gate.weight", 0),
    ]
    for field, name, axis in probes:
        hit = _stored_info(config, layout, name, infos)
        if hit is None or len(hit[1].shape) <= axis:
            continue
        key, info = hit
        value = getattr(config, field)
        if info.shape[axis] != value:
            problems.append(
                f"config.json disagrees with the weights: {field} = {value}, but {key!r} in "
                f"{info.file} has shape {list(info.shape)} (implies {field} = {info.shape[axis]})"
            )
    layers = {int(m.group(1)) for k in infos if not is_ignored_key(k) for m in [_LAYER_IN_KEY.search(k)] if m}
    if layers and max(layers) + 1 != config.n_layers:
        problems.append(
            f"config.json disagrees with the weights: n_layers = {config.n_layers}, but the weights "
            f"hold layers 0..{max(layers)} ({max(layers) + 1} layers)"
        )


def _check_values(config: ModelConfig, root: Path, plan: dict[str, _Located], problems: list[str]) -> None:
    """tid2eid entries must be expert ids in [0, n_routed_experts) (hash layers, spec §2)."""
    files = _Files(root)
    for i in range(config.n_hash_layers):
        name = f"layers.{i}.ffn.gate.tid2eid"
        if name not in plan:
            continue
        t = files.read(plan[name].weight, plan[name].weight_file)
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= config.n_routed_experts:
            problems.append(
                f"bad values in {name!r} ({plan[name].weight_file}): expected expert ids in "
                f"[0, {config.n_routed_experts}), found range [{lo}, {hi}]"
            )
    files.close()


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
    quantized with :mod:`fidelity.formats` (exact iff their values are representable).
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


_ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}


def _stored_nbytes(spec: TensorSpec, layout: str) -> int:
    """Bytes the tensor (and its scale) take on disk in ``layout`` (for shard planning; no data read)."""
    if layout == "transformers":
        return _numel(spec.shape) * (8 if spec.fmt == "int64" else 4)
    return sum(_numel(w.shape) * _ITEMSIZE[w.dtypes[0]] for w in _wants(spec, layout) if w is not None)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shards(ckpt: Checkpoint, layout: str, max_shard_bytes: int | None) -> list[list[str]]:
    """Group canonical names into shards of at most ``max_shard_bytes`` (a tensor and its scale together)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in ckpt.names():
        n = _stored_nbytes(ckpt.spec(name), layout)
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
    want, want_scale = _wants(spec, layout)
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
