"""The training corpus: the Python standard library's ``.py`` sources, present wherever Python is.

Files are ordered by their path relative to the library root; a file is held out for evaluation when the
SHA-256 of that relative path falls in one of ``HELD_OUT_OF`` buckets, a rule that names the same files on every
Python version. Documents are joined as ``BOS text EOS``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIP_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})
HELD_OUT_OF = 32  # one relative path in 32 is held out


def stdlib_root() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: str) -> bool:
    """True for the evaluation files: sha256(relative path) % HELD_OUT_OF == 0."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % HELD_OUT_OF == 0


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the corpus root, '/'-separated
    path: Path
    sha256: str
    size: int


class CorpusError(ValueError):
    """The corpus folder holds no usable ``.py`` file."""


def corpus_files(root: str | Path | None = None) -> list[SourceFile]:
    """Every readable UTF-8 ``.py`` file under ``root`` (default: the standard library), sorted by path."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if SKIP_PARTS.intersection(p.relative_to(root).parts) or not p.is_file():
            continue
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(SourceFile(rel, p, hashlib.sha256(data).hexdigest(), len(data)))
    if not out:
        raise CorpusError(f"corpus {root}: expected Python source files (*.py), found none")
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files)."""
    return [f for f in files if not is_held_out(f.rel)], [f for f in files if is_held_out(f.rel)]


def describe(root: str | Path | None, files: list[SourceFile]) -> dict:
    """The corpus as recorded in a training log: root, counts, bytes, and every file's hash and split."""
    train, held = split(files)
    return {
        "root": str(Path(root) if root is not None else stdlib_root()),
        "train_files": len(train), "train_bytes": sum(f.size for f in train),
        "held_out_files": len(held), "held_out_bytes": sum(f.size for f in held),
        "files": [{"path": f.rel, "sha256": f.sha256, "held_out": is_held_out(f.rel)} for f in files],
    }  # fmt: skip
