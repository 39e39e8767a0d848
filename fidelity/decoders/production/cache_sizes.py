"""Analytic decode-cache sizes: what ``ProductionSession`` allocates for ``max_context`` tokens (spec §5).

Per main layer (the MTP layer is not run): the window ring (``window_size`` KV rows), the compressed KV
(``ceil(ctx / ratio)`` rows, CSA and HCA), the indexer keys (``ceil(ctx / 4)`` rows, CSA only), the
compressors' fp32 carry state (``kv_state`` + ``score_state`` of ``[coff * ratio, coff * d]``, main and
indexer), and the decode's int64 cache slots of the window + selected rows, with their bf16 gather buffer where
decode gathers (bf16 KV rows, or an FMHA that rounds its inputs; packed FP8 rows are attended in place). Row
sizes come from :func:`fidelity.decoders.production.cache.kv_row_bytes` / :func:`key_row_bytes` (one source of
truth).

*Bytes per token* is the cache's context-proportional part (compressed KV + indexer keys) divided by the
context. The *padded* figures round every KV / key row up to a multiple of ``PAD_BYTES``: the FP8 KV row is
already the 584 B production layout (448 codes + 128 rope + 7 scales + 1 pad, as FlashMLA reads it); the packed
FP8 key is 129 B here, 132 B in DeepGEMM (fp32 scale). The gather buffer is a decode workspace: listed in the
totals, not per token (for HCA it still grows as ``ceil(ctx / 128)`` rows).

A paged cache (profile ``kv_cache`` paged:<block>, ``block`` here) allocates each layer's KV rows (window +
compressed) and its indexer keys in whole blocks: the rows that round them up are ``block_pad`` (bytes; at padded
row sizes ``block_pad_padded``), counted in the totals, not per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fidelity.decoders.production.cache import key_row_bytes, kv_row_bytes
from fidelity.decoders.profiles import Profile
from fidelity.model.config import ModelConfig

KV_FORMATS = ("bf16", "fp8")
INDEX_FORMATS = ("bf16", "fp4", "fp8")
KINDS = ("swa", "csa", "hca")
PAD_BYTES = 4
FP32, BF16 = 4, 2


def _pad(n: int) -> int:
    return -(-n // PAD_BYTES) * PAD_BYTES


@dataclass(frozen=True)
class LayerMemory:
    """Bytes of ONE layer of a kind (``layers`` of them in the model); ``*_padded`` with padded rows."""

    kind: str
    layers: int
    ratio: int
    window: int
    compressed_kv: int
    indexer_keys: int
    compressor_state: int
    gather: int
    window_padded: int
    compressed_kv_padded: int
    indexer_keys_padded: int
    block_pad: int = 0  # a paged cache's rows past the KV / key capacity up to whole blocks
    block_pad_padded: int = 0

    @property
    def total(self) -> int:
        return (self.window + self.compressed_kv + self.indexer_keys + self.compressor_state + self.gather
                + self.block_pad)

    @property
    def total_padded(self) -> int:
        return (self.window_padded + self.compressed_kv_padded + self.indexer_keys_padded + self.compressor_state
                + self.gather + self.block_pad_padded)


@dataclass(frozen=True)
class MemoryReport:
    """Cache sizes of one config at one context and storage format; per kind and overall."""

    config: ModelConfig
    max_context: int
    kv_fmt: str
    index_fmt: str
    kv_row: int
    key_row: int
    layers: dict[str, LayerMemory]  # kind -> one layer of that kind (kinds absent from the model omitted)
    block: int = 0  # rows per block of a paged cache; 0: flat

    def total(self, kind: str | None = None, padded: bool = False) -> int:
        """All layers of ``kind`` (all kinds when None)."""
        kinds = [kind] if kind else list(self.layers)
        return sum(m.layers * (m.total_padded if padded else m.total) for k, m in self.layers.items() if k in kinds)

    def per_token(self, kind: str | None = None, padded: bool = False) -> float:
        """Context-proportional cache bytes (compressed KV + indexer keys, all layers of ``kind``) / context."""
        kinds = [kind] if kind else list(self.layers)
        prop = sum(m.layers * ((m.compressed_kv_padded + m.indexer_keys_padded) if padded
                               else (m.compressed_kv + m.indexer_keys))
                   for k, m in self.layers.items() if k in kinds)
        return prop / self.max_context

    def as_dict(self) -> dict[str, dict[str, float]]:
        """kind and ``"all"`` -> per_token, per_token_padded, total, total_padded (all layers of the kind)."""
        kinds: dict[str, str | None] = {k: k for k in self.layers} | {"all": None}
        return {name: {"per_token": self.per_token(k), "per_token_padded": self.per_token(k, True),
                       "total": self.total(k), "total_padded": self.total(k, True)} for name, k in kinds.items()}


def _block_pad(rows: int, block: int) -> int:
    """Rows that round ``rows`` up to whole blocks of ``block`` (0: flat, none)."""
    return -rows % block if block else 0


def profile_formats(profile: Profile) -> tuple[str, str]:
    """(kv_fmt, index_fmt) of a precision profile's cache storage."""
    index_fmt = profile.indexer_qk if profile.indexer_storage == "packed" else "bf16"
    return profile.kv_storage, index_fmt


def cache_bytes(config: ModelConfig, max_context: int, kv_fmt: str = "bf16", index_fmt: str = "bf16",
                gathers: bool | None = None, block: int = 0) -> MemoryReport:
    """Analytic cache bytes of a ``ProductionSession`` with ``max_context`` (kv_fmt: bf16 | fp8 rows; index_fmt:
    bf16 rows, or packed fp4 | fp8 codes + ue8m0 scales). ``gathers``: whether decode gathers the visible rows into
    a bf16 workspace (``cache.decode_gathers`` of the profile); by default for bf16 rows only, since packed FP8
    rows are attended in place unless the FMHA rounds its inputs. ``block``: rows per block of a paged cache
    (``Profile.kv_block``; 0: flat)."""
    if kv_fmt not in KV_FORMATS:
        raise ValueError(f"kv_fmt: expected one of {KV_FORMATS}, found {kv_fmt!r}")
    if index_fmt not in INDEX_FORMATS:
        raise ValueError(f"index_fmt: expected one of {INDEX_FORMATS}, found {index_fmt!r}")
    if not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"max_context: expected a positive integer, found {max_context!r}")
    if not isinstance(block, int) or block < 0 or block & (block - 1):
        raise ValueError(f"block: expected 0 (flat) or a power of two, found {block!r}")
    cfg, w = config, config.window_size
    kv_row = kv_row_bytes(cfg, kv_fmt)
    key_row = key_row_bytes(cfg, index_fmt, index_fmt != "bf16")
    gathers = kv_fmt != "fp8" if gathers is None else gathers
    gather_row = BF16 * cfg.head_dim * gathers + 8  # an int64 cache slot, and a bf16 row where decode gathers
    layers: dict[str, LayerMemory] = {}
    counts = {k: cfg.layer_kinds.count(k) for k in KINDS}
    for kind, ratio in (("swa", 0), ("csa", 4), ("hca", 128)):
        if not counts[kind]:
            continue
        n_comp = math.ceil(max_context / ratio) if ratio else 0
        n_keys = math.ceil(max_context / 4) if ratio == 4 else 0
        state = 0
        if ratio:
            coff = 2 if ratio == 4 else 1
            state = 2 * FP32 * (coff * ratio) * (coff * cfg.head_dim)
        if ratio == 4:
            state += 2 * FP32 * (2 * 4) * (2 * cfg.index_head_dim)
        visible = w + (min(cfg.index_topk, n_comp) if ratio == 4 else n_comp)
        pad_kv, pad_keys = _block_pad(w + n_comp, block), _block_pad(n_keys, block)
        layers[kind] = LayerMemory(
            kind=kind, layers=counts[kind], ratio=ratio, window=w * kv_row, compressed_kv=n_comp * kv_row,
            indexer_keys=n_keys * key_row, compressor_state=state, gather=visible * gather_row,
            window_padded=w * _pad(kv_row), compressed_kv_padded=n_comp * _pad(kv_row),
            indexer_keys_padded=n_keys * _pad(key_row), block_pad=pad_kv * kv_row + pad_keys * key_row,
            block_pad_padded=pad_kv * _pad(kv_row) + pad_keys * _pad(key_row))
    return MemoryReport(cfg, max_context, kv_fmt, index_fmt, kv_row, key_row, layers, block)


def human(n: float) -> str:
    """Bytes in binary units: ``1.50 GiB``, ``12.0 MiB``, ``640 B``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_memory(reports: MemoryReport | Sequence[MemoryReport]) -> str:
    """One table per report: per layer kind and overall, bytes/token and totals (exact and padded rows)."""
    if isinstance(reports, MemoryReport):
        reports = [reports]
    cols = ("kind", "layers", "B/token", "B/token padded", "window", "compressed KV", "indexer keys", "carry state",
            "gather", "total", "total padded")
    out: list[str] = []
    for r in reports:
        out.append(f"KV {r.kv_fmt} ({r.kv_row} B/row, padded {_pad(r.kv_row)}), indexer keys {r.index_fmt} "
                   f"({r.key_row} B/row, padded {_pad(r.key_row)}); context {r.max_context:,} tokens"
                   + (f"; paged in blocks of {r.block} rows (totals include the rows up to whole blocks)"
                      if r.block else ""))
        rows = []
        for k, m in r.layers.items():
            rows.append((k, str(m.layers), f"{r.per_token(k):.2f}", f"{r.per_token(k, True):.2f}",
                         *(human(m.layers * v) for v in (m.window, m.compressed_kv, m.indexer_keys,
                                                         m.compressor_state, m.gather)),
                         human(r.total(k)), human(r.total(k, True))))
        sums = [sum(m.layers * getattr(m, f) for m in r.layers.values())
                for f in ("window", "compressed_kv", "indexer_keys", "compressor_state", "gather")]
        rows.append(("all", str(sum(m.layers for m in r.layers.values())), f"{r.per_token():.2f}",
                     f"{r.per_token(padded=True):.2f}", *(human(v) for v in sums), human(r.total()),
                     human(r.total(padded=True))))
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        line = "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cols))
        out.append(line)
        out.extend("  ".join(v.ljust(widths[0]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(row))
                   for row in rows)
        out.append("")
    out.append("B/token: compressed KV + indexer keys per context token (all layers); padded: rows rounded up to "
               f"{PAD_BYTES} B (packed FP8 keys 129 -> 132 B as in DeepGEMM). gather: the decode's int64 cache slots, "
               "with a bf16 workspace row each for bf16 KV (packed FP8 rows are attended in place).")
    return "\n".join(out)


def memory_main(preset: str | None, config_path: str | None, context: int) -> str:
    """The ``fidelity memory`` report: bf16 storage, then packed FP8 KV with FP4 and with FP8 indexer keys."""
    if preset and config_path:
        raise ValueError("memory: give a preset or a config file, not both")
    cfg = ModelConfig.from_file(config_path) if config_path else ModelConfig.preset(preset or "flash")
    if context < 1:
        raise ValueError(f"--context: expected a positive integer, found {context}")
    name = f"config {config_path}" if config_path else f"preset '{preset or 'flash'}'"
    head = (f"decode cache of {name}: {cfg.n_layers} layers ("
            + ", ".join(f"{cfg.layer_kinds.count(k)} {k}" for k in KINDS if k in cfg.layer_kinds)
            + "), batch 1\n")
    reports = [cache_bytes(cfg, context, "bf16", "bf16"), cache_bytes(cfg, context, "fp8", "fp4"),
               cache_bytes(cfg, context, "fp8", "fp8")]
    return head + format_memory(reports)
