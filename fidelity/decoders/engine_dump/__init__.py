"""Engines' own dumps as decoders under test (docs/engines.md): ``sglang-dump:DIR`` (SGLang's dumper) and
``hook-dump:DIR`` (forward-hook dumps, ``TP*_PP*_Rank*_pid*/PassNNNNN.pt``), read as the engines write them, names
mapped to sites, ranks joined, rows aligned to sequences, and replayed one sequence at a time like a trace."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from fidelity.decoders.engine_dump.convert import PRECISIONS, convert
from fidelity.decoders.engine_dump.names import ENGINES, NameMapError, builtin_map, load_map
from fidelity.decoders.engine_dump.read import DumpError, read_hook, read_sglang
from fidelity.decoders.trace import TraceDecoder
from fidelity.model.config import ModelConfig

DUMP_KINDS = {"sglang-dump": ("sglang", read_sglang), "hook-dump": ("vllm", read_hook)}

__all__ = ["DUMP_KINDS", "DumpError", "EngineDumpDecoder", "PRECISIONS", "is_dump", "open_dump"]


def is_dump(decoder: object) -> bool:
    """``decoder`` is a dump spec (``sglang-dump:DIR`` or ``hook-dump:DIR``)."""
    return isinstance(decoder, str) and decoder.split(":", 1)[0] in DUMP_KINDS and ":" in decoder


class EngineDumpDecoder(TraceDecoder):
    """One sequence of an engine's dump (made a trace by ``open_dump``)."""

    def __init__(self, directory: str | Path, seq: int | None, seen: dict):
        super().__init__(directory, seq)
        self.seen = seen
        many = len(self.trace.sequences) > 1
        self.label = f"{seen['format']} {Path(seen['directory']).name}" + (f", sequence {self.seq}" if many else "")

    def info(self) -> dict:
        return {"dump": self.seen}


def open_dump(spec: str, config: ModelConfig, site_map: str | None = None, precision: str = "quantized",
              seq: int | None = None) -> list[EngineDumpDecoder]:
    """The decoders of dump ``spec`` (one per sequence, or sequence ``seq``) judged on ``config``: the dump read,
    checked and made a trace in a temporary folder (removed at exit). ``site_map``: a name map file, or a built-in
    map's name (``sglang``, ``transformers``, ``vllm``), read before the dump format's own."""
    kind, directory = spec.split(":", 1)
    engine, read = DUMP_KINDS[kind]
    if precision not in PRECISIONS:
        raise DumpError(f"dump precision: expected one of {', '.join(PRECISIONS)}, found {precision!r}")
    try:
        if site_map in ENGINES:
            names = load_map(site_map)
        else:
            names = load_map(engine, site_map)
    except NameMapError as err:
        raise DumpError(str(err)) from None
    dump = read(directory)
    out = Path(tempfile.mkdtemp(prefix="fidelity-dump-"))
    atexit.register(shutil.rmtree, out, True)
    try:
        seen = convert(dump, names, config, out, precision)
        decoders = [EngineDumpDecoder(out, s, seen) for s in ([seq] if seq is not None else
                                                              _sequences(out))]
    except Exception:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return decoders


def _sequences(directory: Path) -> list[int]:
    from fidelity.decoders.trace_file import read_trace

    return read_trace(directory).sequences


def map_path(engine: str) -> Path:
    """The built-in name map of ``engine`` (docs/engines.md)."""
    return builtin_map(engine)
