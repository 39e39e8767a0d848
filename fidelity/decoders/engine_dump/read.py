"""Reading an engine's dump as the engine writes it: SGLang's dumper (one file per tensor) and forward-hook dumps
(one file per forward pass and rank). Files are ``torch.save`` pickles: they are read with
``torch.load(weights_only=True)`` only (tensors, numbers, strings, lists, dicts); a file that needs more is refused.

SGLang's dumper (``sglang/srt/debug_utils/dumper.py``): ``<dir>/<exp_name>/<k=v>___<k=v>....pt`` with tags ``step``
(older dumps: ``forward_pass_id`` or ``curr_step``), ``rank``, ``dump_index``, ``name``, ``recompute_status`` and the
caller's tags (``layer_id``); each file ``{"value": tensor, "meta": {..., "world_rank", "world_size", "dims"}}``.
Forward-hook dumps (SGLang's ``tensor_dump_forward_hook.py``, vLLM's ``vllm/debug/tensor_dump.py``):
``<dir>/TP<t>_PP<p>_Rank<r>_pid<pid>/Pass<NNNNN>.pt``, each a dict ``{module path: tensor or [tensors]}``.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fidelity.decoders.trace_file import TraceError

STEP_TAGS = ("step", "forward_pass_id", "curr_step")
_HOOK_DIR = re.compile(r"TP(?P<tp>\d+)_PP(?P<pp>\d+)_Rank(?P<rank>\d+)_pid(?P<pid>\d+)")
_PASS = re.compile(r"Pass(?P<n>\d+)\.pt")


class DumpError(TraceError):
    """A dump that cannot be judged; the message names the file and what is wrong."""


@dataclass
class Entry:
    """One dumped tensor of one rank at one step (forward pass)."""

    step: int
    rank: int
    name: str
    layer: int | None
    index: int  # the dumper's dump_index (order within a rank)
    path: Path
    value: object
    dims: str | None = None
    tp_rank: int | None = None
    tp_size: int | None = None


@dataclass
class Dump:
    """Every entry of a dump, its world size and format (``sglang`` or ``hook``)."""

    directory: Path
    kind: str
    world: int
    entries: list[Entry]

    @property
    def steps(self) -> list[int]:
        return sorted({e.step for e in self.entries})


def load_pt(path: Path) -> object:
    """``torch.load(path, weights_only=True)`` (memory-mapped where the file allows); DumpError naming the file when
    it needs a full unpickle or cannot be read."""
    try:
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DumpError(f"{path}: refused: the file needs a full unpickle to load ({first[:160]}); dumps are read with "
                        "torch.load(weights_only=True) only: tensors, numbers, strings, lists, dicts") from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise DumpError(f"{path}: unreadable torch.save file: {str(err).splitlines()[0][:200]}") from None


def parse_tags(stem: str, path: Path) -> dict[str, str]:
    """``step=3___rank=0___dump_index=12___name=x___layer_id=2`` -> {step: 3, ...} (values as written)."""
    tags = {}
    for part in stem.split("___"):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise DumpError(f"{path}: file name part {part!r} is not key=value (SGLang dumper names are "
                            "key=value pairs joined by ___)")
        tags[key] = value
    return tags


def read_sglang(directory: str | Path) -> Dump:
    """An SGLang dumper experiment: ``directory`` itself, or its one experiment folder."""
    directory = _experiment(Path(directory))
    entries, worlds = [], {}
    for path in sorted(directory.glob("*.pt")):
        tags = parse_tags(path.stem, path)
        step_tag = next((t for t in STEP_TAGS if t in tags), None)
        missing = [k for k in ("rank", "name") if k not in tags] + ([] if step_tag else ["step"])
        if missing:
            raise DumpError(f"{path}: file name lacks {missing[0]!r} (expected step=, rank=, dump_index=, name= ...)")
        if tags.get("recompute_status") == "recompute":
            continue  # activation checkpointing's second forward: the original holds the same values
        data = load_pt(path)
        if not isinstance(data, dict) or "value" not in data:
            raise DumpError(f"{path}: expected {{'value': tensor, 'meta': {{...}}}} (SGLang's dumper), found "
                            f"{type(data).__name__}")
        meta = data.get("meta") or {}
        try:
            rank, step = int(tags["rank"]), int(tags[step_tag])
            layer = int(tags["layer_id"]) if tags.get("layer_id") not in (None, "None") else None
        except ValueError:
            raise DumpError(f"{path}: step, rank and layer_id must be integers") from None
        worlds[path] = int(meta.get("world_size", 1))
        info = meta.get("sglang_parallel_info") or {}
        entries.append(Entry(step, rank, tags["name"], layer, int(tags.get("dump_index", 0)), path, data["value"],
                             meta.get("dims"), info.get("tp_rank"), info.get("tp_size")))
    if not entries:
        raise DumpError(f"{directory}: no SGLang dumper files (<step=..___rank=..___name=..>.pt); DUMPER_DIR/"
                        "DUMPER_EXP_NAME point at the experiment folder")
    return Dump(directory, "sglang", _world(worlds), entries)


def read_hook(directory: str | Path) -> Dump:
    """A forward-hook dump: one ``TP*_PP*_Rank*_pid*`` folder per rank, ``Pass<N>.pt`` per forward pass."""
    directory = Path(directory)
    folders = sorted(p for p in directory.iterdir() if p.is_dir() and _HOOK_DIR.fullmatch(p.name)) \
        if directory.is_dir() else []
    if not folders:
        raise DumpError(f"{directory}: no TP<t>_PP<p>_Rank<r>_pid<pid> folders (a forward-hook dump: "
                        "--debug-tensor-dump-output-folder)")
    entries, ranks = [], {}
    for folder in folders:
        m = _HOOK_DIR.fullmatch(folder.name)
        rank = int(m["rank"])
        if rank in ranks:
            raise DumpError(f"{directory}: two folders for rank {rank} ({ranks[rank].name}, {folder.name}): one "
                            "dump per folder")
        ranks[rank] = folder
        for path in sorted(folder.glob("Pass*.pt")):
            n = _PASS.fullmatch(path.name)
            if n is None:
                continue
            data = load_pt(path)
            if not isinstance(data, dict):
                raise DumpError(f"{path}: expected a dict of module outputs, found {type(data).__name__}")
            for k, (name, value) in enumerate(_items(data)):
                entries.append(Entry(int(n["n"]), rank, name, None, k, path, value, None, int(m["tp"]), None))
    world = len(ranks)
    if sorted(ranks) != list(range(world)):
        raise DumpError(f"{directory}: rank folders {sorted(ranks)}: expected ranks 0..{world - 1} (missing "
                        f"{sorted(set(range(max(ranks) + 1)) - set(ranks))})")
    if not entries:
        raise DumpError(f"{directory}: no Pass<N>.pt files in the rank folders")
    return Dump(directory, "hook", world, entries)


def _items(data: dict) -> list[tuple[str, object]]:
    """A pass file's tensors by name; a module's list of outputs as ``<path>.<k>`` (what the non-intrusive dumper
    names ``.output.<k>``)."""
    out = []
    for name, value in data.items():
        if isinstance(value, list | tuple) and len(value) > 1:
            out += [(f"{name}.{k}", v) for k, v in enumerate(value)]
        else:
            out.append((str(name), value))
    return out


def _experiment(directory: Path) -> Path:
    if not directory.is_dir():
        raise DumpError(f"{directory}: no such directory (an SGLang dumper experiment: DUMPER_DIR/<exp_name>)")
    if any(directory.glob("*.pt")):
        return directory
    experiments = sorted(p for p in directory.iterdir() if p.is_dir() and any(p.glob("*.pt")))
    if len(experiments) == 1:
        return experiments[0]
    if experiments:
        listed = ", ".join(p.name for p in experiments[:4])
        raise DumpError(f"{directory}: holds {len(experiments)} experiments ({listed}); give one "
                        "(sglang-dump:DIR/<exp_name>)")
    raise DumpError(f"{directory}: no SGLang dumper files here or in an experiment folder below it")


def _world(worlds: dict[Path, int]) -> int:
    sizes = sorted(set(worlds.values()))
    if len(sizes) > 1:
        by = {s: next(p for p, w in worlds.items() if w == s) for s in sizes}
        raise DumpError(f"{by[sizes[1]]}: world_size {sizes[1]}, but {by[sizes[0]].name} has world_size {sizes[0]}: "
                        "files of runs with different world sizes are mixed in one experiment")
    return sizes[0]
