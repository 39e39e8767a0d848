"""A run's host memory, estimated before any work: caches, the oracle's caches, one prefill call's tensors and the
prompt, against the memory this machine has available (``fidelity run`` refuses a run that cannot fit)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fidelity.model.config import ModelConfig

FP32 = 4
SITES_PER_LAYER = 12  # tensors of a call's width that the recorder keeps per layer and model (streams, q, kv, ...)
PROMPT_BYTES_PER_TOKEN = 64  # the prompt's ids and, for the default text, its repeated text and tokenizer output
ORACLE_CACHE_MODES = ("free", "layer")  # op mode reads the decoder's cache contents; these keep their own


@dataclass(frozen=True)
class Estimate:
    """Bytes of a run by part (``parts``) and in total."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        return ", ".join(f"{k} {human(v)}" for k, v in self.parts.items() if v)


def human(n: float) -> str:
    """Bytes in the largest unit that keeps the number >= 1 (KiB ... TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def estimate(cfg: ModelConfig, prompt_len: int, decode_steps: int, modes: tuple[str, ...] = ("free", "layer", "op"),
             prefill_chunk: int | None = None, kv_fmt: str = "bf16", index_fmt: str = "bf16",
             oracle_bytes: int = FP32) -> Estimate:
    """A lower-bound estimate of a run's host memory: the decoder's caches for the whole context (``kv_fmt`` /
    ``index_fmt`` storage), the oracle's caches in its dtype for each mode that keeps its own, the largest prefill
    call's logits and recorded site tensors for both models, the weights (stored and in the oracle's dtype) and the
    prompt."""
    from fidelity.decoders.production.cache_sizes import cache_bytes
    from fidelity.harness.runner import AUTO_CHUNK, AUTO_WHOLE
    from fidelity.model.weights import fp32_nbytes

    context = prompt_len + decode_steps
    chunk = min(prompt_len, prefill_chunk or (prompt_len if prompt_len <= AUTO_WHOLE else AUTO_CHUNK))
    decoder_cache = cache_bytes(cfg, context, kv_fmt, index_fmt).total(None, True)
    oracle_cache = cache_bytes(cfg, context).total(None, True) * oracle_bytes // 2  # bf16 rows -> the oracle's dtype
    n_oracles = sum(m in modes for m in ORACLE_CACHE_MODES)
    width = cfg.dim * cfg.hc_mult
    call = 2 * chunk * (cfg.vocab_size + cfg.n_layers * SITES_PER_LAYER * width) * FP32
    weights = fp32_nbytes(cfg) * (1 + oracle_bytes // FP32)
    return Estimate({"decoder caches": decoder_cache, "oracle caches": n_oracles * oracle_cache,
                     f"a {chunk}-token prefill call": call, "weights": weights,
                     "prompt": prompt_len * PROMPT_BYTES_PER_TOKEN})


def available_bytes() -> int | None:
    """The memory this machine can give a new process now (Linux's MemAvailable), else its physical memory; None
    where neither is known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def shortfall(need: Estimate, have: int | None) -> str | None:
    """Why a run of ``need`` does not fit in ``have`` bytes, in words, or None when it fits (or ``have`` is
    unknown)."""
    if have is None or need.total <= have:
        return None
    return (f"needs at least {human(need.total)} of memory ({need.line()}), this machine has {human(have)} "
            "available")
