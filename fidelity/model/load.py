"""Reading a checkpoint directory (:func:`load_checkpoint`): ``config.json`` + ``*.safetensors`` (single file, or
sharded with ``model.safetensors.index.json``) in any layout of :mod:`fidelity.model.layouts`, detected
automatically. Every problem found is collected into one :class:`~fidelity.model.checkpoint.CheckpointError`. No
pickle anywhere."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fidelity.model.checkpoint import Checkpoint, CheckpointError, StoredTensor
from fidelity.model.config import ConfigError, ModelConfig
from fidelity.model.layouts import (
    INDEX_FILE,
    Source,
    detect_layout,
    is_ignored_key,
    release_aliases,
    release_scale_aliases,
    tp_shard_info,
    transformers_sources,
)
from fidelity.model.weights import QUANTIZED, StoredForm, TensorSpec, expected_tensors, stored_forms

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a file's JSON header

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
    if not files and index is None:  # no weights at all: that is the problem, not each of the tensors
        raise CheckpointError(problems, f"checkpoint {root}")
    infos, unreadable = _read_headers(root, files, problems)
    _check_index(index, infos, [f for f in files if f not in unreadable], problems)
    # the layout is told by the key names, an unreadable file's included where its header survives
    names = {k: i.dtype for k, i in infos.items()}
    for f in sorted(unreadable):
        names.update(_header_names(root / f))
    wo_a = next((dtype for k, dtype in names.items() if k.endswith("attn.wo_a.weight")), None)
    layout = detect_layout(names, [p.name for p in root.glob("*.safetensors")], wo_a)
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


def _header_names(path: Path) -> dict[str, str]:
    """{key: dtype} from a safetensors file's JSON header, read without the safetensors reader (a truncated
    file's header usually survives); empty when the header itself is cut or malformed."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size <= MAX_HEADER_BYTES else None
    except (OSError, ValueError):
        return {}
    if not isinstance(header, dict):
        return {}
    return {k: str(v.get("dtype", "")) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


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


def _candidates(config: ModelConfig, layout: str, name: str) -> list[Source]:
    if layout == "transformers":
        return transformers_sources(name, config.n_routed_experts, config.moe_inter_dim, config.dim)
    return [Source(k) for k in release_aliases(name)]


def _describe(want: StoredForm) -> str:
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
        self.in_unreadable: list[str] = []  # stored keys of missing tensors that an unreadable file may hold
        self.claimed: set[str] = set()
        self.fused_checked: set[str] = set()

    def locate(self, spec: TensorSpec) -> _Located | None:
        """Where ``spec`` is stored (None after reporting what is wrong with it)."""
        want, want_scale = stored_forms(spec, self.layout)
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

    def _missing(self, name: str, key: str, want: StoredForm, has_scale: bool) -> None:
        if has_scale:  # an orphaned scale is part of this problem, not an unexpected tensor
            self.claimed.update(k for k in release_scale_aliases(name) if k in self.infos)
        if self.unreadable and (self.index is None or self.index.get(key) in self.unreadable):
            self.in_unreadable.append(key)  # the layout's name (a fused transformers tensor holds several)
            return
        hint = ""
        if self.index is not None and key in self.index:
            hint = f" (the index maps it to {self.index[key]}, which is missing or unreadable)"
        self.problems.append(f"missing tensor {name!r}: expected {_describe(want)} as {key!r}{hint}")

    def report_unreadable(self) -> None:
        """One line for the tensors that an unreadable file may hold."""
        keys = list(dict.fromkeys(self.in_unreadable))
        if keys:
            shown = ", ".join(repr(k) for k in keys[:3])
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            self.problems.append(f"{len(keys)} tensors not found ({shown}{more}): they would be in the missing or "
                                 f"unreadable file(s) {', '.join(sorted(self.unreadable))}; repair or replace those "
                                 "first")

    def _check_weight(self, name: str, src: Source, want: StoredForm, info: _KeyInfo) -> bool:
        """Dtype and shape of one stored weight; a fused HF expert tensor is checked (and reported) once."""
        if src.fused_shape is None:
            return self._check(f"{name!r} ({src.key!r} in {info.file})", want, info)
        want = StoredForm(src.fused_shape, want.dtypes)
        if src.key in self.fused_checked:
            return info.dtype in want.dtypes and info.shape == want.shape
        self.fused_checked.add(src.key)
        return self._check(f"fused {src.key!r} in {info.file}", want, info)

    def _check(self, what: str, want: StoredForm, info: _KeyInfo) -> bool:
        ok = True
        if info.dtype not in want.dtypes:
            self.problems.append(f"wrong dtype for {what}: expected {'/'.join(want.dtypes)}, found {info.dtype}")
            ok = False
        if info.shape != want.shape:
            self.problems.append(f"wrong shape for {what}: expected {list(want.shape)}, found {list(info.shape)}")
            ok = False
        return ok

    def _scale(self, name: str, weight_key: str, want: StoredForm) -> str | None:
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
