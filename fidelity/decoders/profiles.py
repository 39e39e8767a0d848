"""Precision profiles: the number format at each site family, as data (docs/design.md "Precision profiles").

``reference`` reproduces the official QAT numerics (spec §3-§4). Every other built-in profile changes one
field. Users write their own as a TOML/JSON file (``base = "reference"`` plus fields to change) or on the
command line (``reference:kv_storage=fp8,residual=fp32``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

CHOICES: dict[str, tuple[str, ...]] = {
    "gemm_act": ("fp8", "bf16"),  # activations entering the FP8/FP4 GEMMs: e4m3 1x128 ue8m0, or bf16
    "kv_nope": ("fp8", "bf16"),  # 448 nope dims of window and compressed KV: FP8-rounded 1x64, or plain bf16
    "kv_storage": ("bf16", "fp8"),  # KV cache storage: bf16 rows, or e4m3 codes + ue8m0 scales + bf16 rope
    # the KV FP8 round's scale floor (kv_nope fp8, and the packed rows): on the block amax, max(amax, 1e-4) / 448
    # (the official kernel.py rule), or on the scale, max(amax / 448, 1e-4) (FlashMLA's); equal for amax > 0.0274
    "kv_scale_floor": ("amax", "scale"),
    # attention core: bf16 QK/PV (P rounded to bf16); e4m3 Q, K, V and P; or e4m3 with the rope dims of Q, K/V bf16
    "fmha": ("bf16", "fp8", "fp8-nope"),
    "indexer_qk": ("fp4", "fp8", "bf16"),  # indexer q and keys: FP4 1x32 sim, FP8 e4m3, or bf16
    "indexer_storage": ("bf16", "packed"),  # indexer key cache: bf16 rows, or packed codes + ue8m0 scales
    "hadamard": ("on", "off"),  # Walsh-Hadamard rotation of indexer q and keys before quantization
    "index_scores": ("bf16", "fp32"),  # index score einsum / ReLU / weighted sum dtype
    "residual": ("bf16", "fp32"),  # mHC streams stored between sublayers; also fp32@LAYERS (``residual_fp32``)
    # RMSNorm and its consumers' quantization as the reference runs them (separate ops), or fused: rms_norm_fp8 (the
    # codes made once per norm for every FP8 GEMM it feeds) and kv_norm_rope_fp8 (kv_norm + RoPE + the FP8 round)
    "norm_fusion": ("unfused", "fused"),
    # KV cache layout: flat rows, or also paged:<block> (rows in blocks of <block>, a power of two in 1..4096,
    # addressed through a per-session block table: ``Profile.kv_block``); storage only, same bits
    "kv_cache": ("flat",),
}
_LAYER_SET = re.compile(r"fp32@(\d+(-\d+)?)([+,;]\d+(-\d+)?)*")
_PAGED = re.compile(r"paged:([1-9]\d*)")
MAX_KV_BLOCK = 4096


@dataclass(frozen=True)
class Profile:
    """One choice per site family; ``CHOICES`` lists the options, the first of each is the reference."""

    name: str = "reference"
    gemm_act: str = "fp8"
    kv_nope: str = "fp8"
    kv_storage: str = "bf16"
    kv_scale_floor: str = "amax"
    fmha: str = "bf16"
    indexer_qk: str = "fp4"
    indexer_storage: str = "bf16"
    hadamard: str = "on"
    index_scores: str = "bf16"
    residual: str = "bf16"
    norm_fusion: str = "unfused"
    kv_cache: str = "flat"

    def __post_init__(self) -> None:
        bad = [f"{k}: expected one of {v}, found {getattr(self, k)!r}" for k, v in CHOICES.items()
               if k not in ("residual", "kv_cache") and getattr(self, k) not in v]
        if self.kv_cache != "flat" and not self.kv_block:
            bad.append(f"kv_cache: expected 'flat' or 'paged:<block>' with block a power of two in 1..{MAX_KV_BLOCK} "
                       f"(e.g. paged:64), found {self.kv_cache!r}")
        if self.residual not in CHOICES["residual"]:
            if not _LAYER_SET.fullmatch(self.residual):
                bad.append("residual: expected 'bf16', 'fp32' or 'fp32@LAYERS' (e.g. fp32@0-3+7: layers 0 to 3 and 7), "
                           f"found {self.residual!r}")
            elif any(a > b for a, b in _ranges(self.residual)):
                bad.append(f"residual: a layer range runs backwards in {self.residual!r}")
        if self.kv_storage == "fp8" and self.kv_nope != "fp8":
            bad.append("kv_storage: 'fp8' stores FP8 codes, so kv_nope must be 'fp8' too")
        if self.indexer_storage == "packed" and self.indexer_qk == "bf16":
            bad.append("indexer_storage: 'packed' needs indexer_qk 'fp4' or 'fp8', found 'bf16'")
        if bad:
            raise ValueError(f"profile {self.name!r}: " + "; ".join(bad))

    def residual_fp32(self, layer: int) -> bool:
        """Whether layer ``layer``'s sublayers store the mHC streams in fp32 (``residual``: bf16 none, fp32 every
        layer, fp32@0-3+7 the layers listed; the embedding's streams follow layer 0)."""
        if self.residual in CHOICES["residual"]:
            return self.residual == "fp32"
        return any(a <= layer <= b for a, b in _ranges(self.residual))

    @property
    def kv_block(self) -> int:
        """Rows per block of a paged KV cache (``kv_cache`` paged:<block>); 0 for the flat layout or an invalid
        value."""
        m = _PAGED.fullmatch(self.kv_cache)
        block = int(m.group(1)) if m else 0
        return block if block <= MAX_KV_BLOCK and block & (block - 1) == 0 else 0

    def changes(self) -> dict[str, str]:
        """The fields that differ from ``reference``."""
        ref = Profile()
        return {k: getattr(self, k) for k in CHOICES if getattr(self, k) != getattr(ref, k)}


def _ranges(value: str) -> list[tuple[int, int]]:
    """'fp32@0-3+7' -> [(0, 3), (7, 7)]."""
    parts = re.split(r"[+,;]", value.removeprefix("fp32@"))
    return [(int(a), int(b or a)) for a, _, b in (p.partition("-") for p in parts)]


BUILTIN: dict[str, dict[str, str]] = {
    "reference": {},
    "bf16": {"gemm_act": "bf16", "kv_nope": "bf16", "indexer_qk": "bf16"},
    "fp8-fmha": {"fmha": "fp8"},
    "fp8-fmha-nope": {"fmha": "fp8-nope"},
    "fp8-kv-storage": {"kv_storage": "fp8"},
    "fp4-indexer-packed": {"indexer_storage": "packed"},
    "fp8-indexer": {"indexer_qk": "fp8"},
    "no-hadamard": {"hadamard": "off"},
    "fp32-residual": {"residual": "fp32"},
    "fused-norm": {"norm_fusion": "fused"},
    "paged-kv": {"kv_cache": "paged:64"},
}


def _build(name: str, base: str, changes: dict[str, str], where: str) -> Profile:
    if base not in BUILTIN:
        raise ValueError(f"{where}: base profile: expected one of {sorted(BUILTIN)}, found {base!r}")
    unknown = sorted(set(changes) - set(CHOICES))
    if unknown:
        raise ValueError(f"{where}: unknown profile field(s) {unknown}; fields are {sorted(CHOICES)}")
    return Profile(name=name, **{**BUILTIN[base], **changes})


def get_profile(spec: str | Profile) -> Profile:
    """A built-in name, ``base:field=value,...``, or a path to a .toml/.json profile file."""
    if isinstance(spec, Profile):
        return spec
    if spec.endswith((".toml", ".json")):
        return load_profile(spec)
    base, _, rest = spec.partition(":")
    if base not in BUILTIN:
        raise ValueError(f"profile: expected one of {sorted(BUILTIN)} (or a .toml/.json file), found {base!r}")
    changes = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"profile {spec!r}: expected field=value, found {item!r}")
        changes[key.strip()] = value.strip()
    return _build(spec if rest else base, base, changes, f"profile {spec!r}")


def load_profile(path: str | Path) -> Profile:
    """A file ``{name = "...", base = "reference", <field> = "<choice>", ...}`` (TOML or JSON)."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except FileNotFoundError:
        raise ValueError(f"profile file not found: {path}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"profile file {path}: not valid {path.suffix[1:].upper()}: {err}") from None
    name = str(raw.pop("name", path.stem))
    base = str(raw.pop("base", "reference"))
    return _build(name, base, {k: str(v) for k, v in raw.items()}, f"profile file {path}")


def profile_dict(p: Profile) -> dict[str, str]:
    return dataclasses.asdict(p)
