"""DSv4 model hyperparameters (spec §1), parsed from either config.json spelling.

Field names follow the official inference ``ModelArgs`` (``dim``, ``n_layers``, ``compress_ratios``...).
``ModelConfig.from_dict`` also reads transformers' ``DeepseekV4Config`` spelling (``hidden_size``,
``layer_types``, ``compress_rates``, ``mlp_layer_types``, nested ``rope_parameters``). Every problem found
is reported at once, naming the field, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VALID_RATIOS = (0, 4, 128)
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
HF_LAYER_TYPES = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}


def problems_line(source: str, problems: list[str], limit: int | None = None, more: str = "") -> str:
    """One line: ``source: problem``, or ``source: N problems: a; b; c`` (the first ``limit`` of them, then how
    many more, ``more`` saying where they are listed)."""
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    shown = problems if limit is None else problems[:limit]
    rest = f"; ... and {len(problems) - len(shown)} more{more}" if len(shown) < len(problems) else ""
    return f"{source}: {len(problems)} problems: " + "; ".join(shown) + rest


class ConfigError(ValueError):
    """A config that cannot describe a DSv4 model; ``problems`` lists every field at fault. The message is one
    line."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(problems_line(source, problems))


@dataclass(frozen=True)
class ModelConfig:
    """Every DSv4 hyperparameter; defaults are the official ``ModelArgs`` defaults (spec §1)."""

    vocab_size: int = 129280
    dim: int = 4096
    moe_inter_dim: int = 4096
    n_layers: int = 7
    n_hash_layers: int = 0
    n_mtp_layers: int = 1
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0, 4, 128, 4, 128, 4, 0)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    dtype: str = "fp8"
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str | None = None
    scale_dtype: str = "fp8"
    max_seq_len: int = 4096
    max_batch_size: int = 4
    bos_token_id: int = 0
    eos_token_id: int = 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end-of-turn etc., stops besides EOS

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    # ---- derived quantities -------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        """Compress ratio of main layer ``layer`` (0 = sliding window only, 4 = CSA, 128 = HCA)."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'swa' / 'csa' / 'hca' per main layer."""
        names = {0: "swa", 4: "csa", 128: "hca"}
        return tuple(names[self.ratio(i)] for i in range(self.n_layers))

    # ---- validation ---------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every inconsistency, each naming its field: expected vs found."""
        p: list[str] = []
        positive = (
            "vocab_size dim moe_inter_dim n_layers n_heads head_dim rope_head_dim q_lora_rank o_groups "
            "o_lora_rank n_routed_experts n_activated_experts window_size index_n_heads index_head_dim "
            "index_topk hc_mult hc_sinkhorn_iters max_seq_len max_batch_size"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                p.append(f"{name}: expected a positive integer, found {value!r}")
        if p:
            return p
        for name in ("n_hash_layers", "n_mtp_layers", "n_shared_experts"):
            if getattr(self, name) < 0:
                p.append(f"{name}: expected >= 0, found {getattr(self, name)}")
        if self.n_shared_experts != 1:
            p.append(f"n_shared_experts: the reference supports exactly 1, found {self.n_shared_experts}")
        if self.rope_head_dim % 2:
            p.append(f"rope_head_dim: expected an even number (RoPE rotates pairs), found {self.rope_head_dim}")
        if self.rope_head_dim > self.head_dim:
            p.append(f"rope_head_dim: expected <= head_dim ({self.head_dim}), found {self.rope_head_dim}")
        if self.rope_head_dim > self.index_head_dim:
            p.append(
                f"rope_head_dim: expected <= index_head_dim ({self.index_head_dim}), found {self.rope_head_dim}"
            )
        if self.index_head_dim & (self.index_head_dim - 1):
            p.append(
                f"index_head_dim: expected a power of two (Hadamard transform), found {self.index_head_dim}"
            )
        if self.index_head_dim % 32:
            p.append(f"index_head_dim: expected a multiple of 32 (FP4 1x32 blocks), found {self.index_head_dim}")
        if (self.head_dim - self.rope_head_dim) % 64:
            p.append(
                "head_dim - rope_head_dim: expected a multiple of 64 (FP8 1x64 KV blocks), "
                f"found {self.head_dim - self.rope_head_dim}"
            )
        for name in ("dim", "q_lora_rank", "moe_inter_dim", "o_lora_rank"):
            if getattr(self, name) % 128:
                p.append(f"{name}: expected a multiple of 128 (quantization blocks), found {getattr(self, name)}")
        if self.n_heads % self.o_groups:
            p.append(f"o_groups: expected a divisor of n_heads ({self.n_heads}), found {self.o_groups}")
        elif (self.n_heads * self.head_dim // self.o_groups) % 128:
            p.append(
                "n_heads * head_dim / o_groups: expected a multiple of 128, "
                f"found {self.n_heads * self.head_dim // self.o_groups}"
            )
        if self.n_activated_experts > self.n_routed_experts:
            p.append(
                f"n_activated_experts: expected <= n_routed_experts ({self.n_routed_experts}), "
                f"found {self.n_activated_experts}"
            )
        if self.score_func not in SCORE_FUNCS:
            p.append(f"score_func: expected one of {SCORE_FUNCS}, found {self.score_func!r}")
        if self.n_hash_layers > self.n_layers:
            p.append(f"n_hash_layers: expected <= n_layers ({self.n_layers}), found {self.n_hash_layers}")
        allowed = (self.n_layers, self.n_layers + self.n_mtp_layers)
        if len(self.compress_ratios) not in allowed:
            p.append(
                f"compress_ratios: expected one entry per layer ({self.n_layers}, or {allowed[1]} with the "
                f"MTP layers), found {len(self.compress_ratios)}"
            )
        bad = sorted({r for r in self.compress_ratios if r not in VALID_RATIOS})
        if bad:
            p.append(f"compress_ratios: expected entries in {VALID_RATIOS}, found {bad}")
        if self.hc_eps < 0 or self.norm_eps < 0:
            p.append(f"hc_eps/norm_eps: expected >= 0, found {self.hc_eps}/{self.norm_eps}")
        if self.original_seq_len < 0:
            p.append(f"original_seq_len: expected >= 0, found {self.original_seq_len}")
        if self.original_seq_len > 0 and self.rope_factor <= 0:
            p.append(f"rope_factor: expected > 0 with YaRN on, found {self.rope_factor}")
        if not math.isfinite(self.swiglu_limit) or self.swiglu_limit < 0:
            p.append(f"swiglu_limit: expected a finite value >= 0, found {self.swiglu_limit}")
        return p

    # ---- presets ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """``flash`` / ``pro`` (spec §1) or ``tiny`` (the embedded, width-reduced default)."""
        if name not in PRESETS:
            raise ConfigError([f"preset: expected one of {sorted(PRESETS)}, found {name!r}"])
        return cls(**PRESETS[name])

    def first_layers(self, n: int) -> ModelConfig:
        """The model cut to its first ``n`` layers, widths kept (a slice of a release-sized model): the first n
        compress ratios, at most n hash layers, no MTP layer."""
        if not 1 <= n <= self.n_layers:
            raise ConfigError([f"layers: expected 1..{self.n_layers}, found {n}"])
        return self.replace(n_layers=n, compress_ratios=tuple(self.compress_ratios[:n]), n_mtp_layers=0,
                            n_hash_layers=min(self.n_hash_layers, n))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- (de)serialisation --------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        """Parse either spelling; transformers' is recognised by ``hidden_size`` / ``model_type``."""
        if not isinstance(raw, dict):
            raise ConfigError([f"expected a JSON object, found {type(raw).__name__}"], source)
        hf = "hidden_size" in raw or "num_hidden_layers" in raw or raw.get("model_type") == "deepseek_v4"
        problems: list[str] = []
        kwargs = _from_hf(raw, problems) if hf else _from_official(raw, problems)
        if problems:
            raise ConfigError(problems, source)
        try:
            return cls(**kwargs)
        except ConfigError as err:
            raise ConfigError(err.problems, source) from None
        except TypeError as err:
            raise ConfigError([str(err)], source) from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError([f"file not found: {path}"], str(path)) from None
        except json.JSONDecodeError as err:
            raise ConfigError([f"not valid JSON: {err}"], str(path)) from None
        return cls.from_dict(raw, source=str(path))

    def to_official_dict(self) -> dict[str, Any]:
        """The official inference ``config.json`` (ModelArgs names)."""
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers' ``DeepseekV4Config`` spelling, loadable by ``DeepseekV4Config(**d)``."""
        n = self.n_layers
        compress: dict[str, Any] = {"rope_theta": self.compress_rope_theta, "rope_type": "default"}
        if self.original_seq_len > 0:
            compress = {
                "rope_type": "yarn",
                "rope_theta": self.compress_rope_theta,
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "attention_factor": 1.0,
            }
        prf = self.rope_head_dim / self.head_dim
        compress["partial_rotary_factor"] = prf
        d: dict[str, Any] = {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": n,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "partial_rotary_factor": prf,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "scoring_func": self.score_func,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale,
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.window_size,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": prf},
                "compress": compress,
            },
            "layer_types": [HF_LAYER_TYPES[self.ratio(i)] for i in range(n)],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            "mlp_layer_types": ["hash_moe" if self.is_hash_layer(i) else "moe" for i in range(n)],
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "max_position_embeddings": int(max(self.max_seq_len, self.original_seq_len * max(self.rope_factor, 1))),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": [self.eos_token_id, *self.stop_token_ids] if self.stop_token_ids else self.eos_token_id,
            "tie_word_embeddings": False,
        }
        if self.dtype == "fp8":
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "scale_fmt": self.scale_fmt,
                "weight_block_size": [128, 128],
                "activation_scheme": "dynamic",
            }
            if self.expert_dtype:
                d["quantization_config"]["expert_dtype"] = self.expert_dtype
        return d


def _from_official(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    ignored = {"n_routed_experts_score"}  # REAP addition seen in a public copy; not official
    kwargs = {k: v for k, v in raw.items() if k in names}
    unknown = sorted(set(raw) - names - ignored)
    if unknown:
        problems.append(f"unknown field(s) for the official ModelArgs spelling: {unknown}")
    return kwargs


def _hf_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The compressed-layer rope parameters: nested ``rope_parameters.compress`` or a flat yarn dict."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rp.get("compress"), dict):
        return rp["compress"]
    return rp


def _from_hf(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    k: dict[str, Any] = {}
    simple = {
        "vocab_size": "vocab_size",
        "hidden_size": "dim",
        "moe_intermediate_size": "moe_inter_dim",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "head_dim": "head_dim",
        "q_lora_rank": "q_lora_rank",
        "o_groups": "o_groups",
        "o_lora_rank": "o_lora_rank",
        "n_routed_experts": "n_routed_experts",
        "n_shared_experts": "n_shared_experts",
        "num_experts_per_tok": "n_activated_experts",
        "scoring_func": "score_func",
        "routed_scaling_factor": "route_scale",
        "swiglu_limit": "swiglu_limit",
        "sliding_window": "window_size",
        "rope_theta": "rope_theta",
        "compress_rope_theta": "compress_rope_theta",
        "index_n_heads": "index_n_heads",
        "index_head_dim": "index_head_dim",
        "index_topk": "index_topk",
        "hc_mult": "hc_mult",
        "hc_sinkhorn_iters": "hc_sinkhorn_iters",
        "hc_eps": "hc_eps",
        "rms_norm_eps": "norm_eps",
        "num_nextn_predict_layers": "n_mtp_layers",
        "bos_token_id": "bos_token_id",
        "max_position_embeddings": None,
    }
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for src, dst in simple.items():
        if src in raw and dst is not None and raw[src] is not None:
            if bad := _type_problem(src, raw[src], types.get(dst)):
                problems.append(bad)  # named as written in the file; the fields derived from it are not checked
                continue
            k[dst] = raw[src]
    # transformers' own defaults where the file is silent (they differ from ModelArgs' defaults)
    k.setdefault("compress_rope_theta", 160000.0)
    k.setdefault("route_scale", 1.5)
    k.setdefault("swiglu_limit", 10.0)
    k.setdefault("n_mtp_layers", 1)
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        k["eos_token_id"], k["stop_token_ids"] = (eos[0] if eos else 1), tuple(eos[1:])
    elif eos is not None:
        k["eos_token_id"] = eos
    head_dim = raw.get("head_dim", 512)
    if raw.get("qk_rope_head_dim") is not None:
        k["rope_head_dim"] = raw["qk_rope_head_dim"]
    elif raw.get("partial_rotary_factor") is not None:
        k["rope_head_dim"] = int(round(head_dim * raw["partial_rotary_factor"]))
    n = k.get("n_layers", 43 if "num_hidden_layers" not in raw else None)  # None: num_hidden_layers is malformed
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, "sliding_attention": 0}
    rates.update(raw.get("compress_rates") or {})
    if raw.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = raw["compress_rate_hca"]
    if raw.get("layer_types") is not None:
        unknown = sorted({t for t in raw["layer_types"] if t not in rates})
        if unknown:
            problems.append(f"layer_types: expected entries in {sorted(rates)}, found {unknown}")
        else:
            # transformers has no entry for the MTP layers; both releases give them ratio 0 (sliding window)
            n_mtp = raw.get("num_nextn_predict_layers", 1) or 0
            k["compress_ratios"] = tuple(rates[t] for t in raw["layer_types"]) + (0,) * n_mtp
    elif raw.get("compress_ratios") is not None:
        k["compress_ratios"] = tuple(raw["compress_ratios"])
    elif n is not None:  # transformers' default schedule: 2x HCA then CSA/HCA interleaved
        k["compress_ratios"] = tuple([128] * min(n, 2) + [4 if i % 2 else 128 for i in range(max(n - 2, 0))])
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is not None:
        n_hash = sum(1 for t in mlp_types if t == "hash_moe")
        if list(mlp_types[:n_hash]) != ["hash_moe"] * n_hash or any(t not in ("hash_moe", "moe") for t in mlp_types):
            problems.append(
                "mlp_layer_types: expected 'hash_moe' for a prefix of layers then 'moe', found "
                f"{list(mlp_types)}"
            )
        if n is not None and len(mlp_types) != n:
            problems.append(f"mlp_layer_types: expected {n} entries (num_hidden_layers), found {len(mlp_types)}")
        k["n_hash_layers"] = n_hash
    elif n is not None:
        k["n_hash_layers"] = min(n, raw.get("num_hash_layers", 3))
    rope = _hf_rope(raw)
    if rope.get("rope_theta") is not None and isinstance(raw.get("rope_parameters", {}).get("compress"), dict):
        k["compress_rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        k["rope_factor"] = rope.get("factor", 16.0)
        k["original_seq_len"] = rope.get("original_max_position_embeddings", 65536)
        k["beta_fast"] = rope.get("beta_fast", 32)
        k["beta_slow"] = rope.get("beta_slow", 1)
        if rope.get("attention_factor", 1.0) != 1.0 or rope.get("mscale") not in (None, 1, 1.0):
            problems.append(
                "rope_parameters.compress.attention_factor: the reference applies no YaRN mscale "
                f"(expected 1.0), found {rope.get('attention_factor', rope.get('mscale'))}"
            )
    elif rope_type != "default":
        problems.append(f"rope_parameters.compress.rope_type: expected 'yarn' or 'default', found {rope_type!r}")
    else:
        k["original_seq_len"] = 0
    q = raw.get("quantization_config") or {}
    if q:
        k["dtype"] = "fp8"
        k["scale_fmt"] = q.get("scale_fmt", "ue8m0")
        k["expert_dtype"] = q.get("expert_dtype", raw.get("expert_dtype"))
    else:
        k["dtype"] = "bf16"
        k["scale_fmt"] = None
        k["expert_dtype"] = raw.get("expert_dtype")
    return k


def _type_problem(key: str, value: Any, kind: str | None) -> str | None:
    """A problem naming ``key`` when ``value`` is not of the field type ``kind`` ('int', 'float', 'str'), else None."""
    if kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        return f"{key}: expected an integer, found {value!r}"
    if kind == "float" and (not isinstance(value, int | float) or isinstance(value, bool)):
        return f"{key}: expected a number, found {value!r}"
    if kind == "str" and not isinstance(value, str):
        return f"{key}: expected a string, found {value!r}"
    return None


def _flash() -> dict[str, Any]:
    return dict(
        vocab_size=129280, dim=4096, moe_inter_dim=2048, n_layers=43, n_mtp_layers=1, n_hash_layers=3,
        n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, score_func="sqrtsoftplus",
        route_scale=1.5, swiglu_limit=10.0, window_size=128,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
        rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16.0,
        beta_fast=32, beta_slow=1, index_n_heads=64, index_head_dim=128, index_topk=512,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
        dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4", scale_dtype="fp8",
        max_seq_len=4096, max_batch_size=4,
        stop_token_ids=(128803,),  # <｜User｜>: a new user turn means the assistant's turn ended (V4 tokenizer ids)
    )  # fmt: skip


def _pro() -> dict[str, Any]:
    return {
        **_flash(),
        "dim": 7168, "moe_inter_dim": 3072, "n_layers": 61, "n_heads": 128, "q_lora_rank": 1536,
        "o_groups": 16, "n_routed_experts": 384, "route_scale": 2.5, "index_topk": 1024,
        "compress_ratios": (128, 128) + (4, 128) * 29 + (4, 0),
    }  # fmt: skip


def _tiny() -> dict[str, Any]:
    """Structure-faithful, width-reduced: real window, ratios, hc, Sinkhorn, rope dims, hash layers."""
    return {
        **_flash(),
        "vocab_size": 4096, "dim": 256, "moe_inter_dim": 256, "n_layers": 6, "n_mtp_layers": 0,
        "n_hash_layers": 3, "n_heads": 4, "head_dim": 128, "q_lora_rank": 128, "o_groups": 2,
        "o_lora_rank": 128, "n_routed_experts": 8, "n_activated_experts": 2,
        "compress_ratios": (0, 0, 4, 128, 4, 128),
        "index_n_heads": 4, "index_head_dim": 64, "index_topk": 32, "max_seq_len": 4096,
        "stop_token_ids": (2,),  # the tiny vocabulary's end-of-turn id (EOS is 1)
    }  # fmt: skip


PRESETS: dict[str, dict[str, Any]] = {"flash": _flash(), "pro": _pro(), "tiny": _tiny()}
