"""Files written whole or not at all: a temporary file in the same folder, then a rename."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``path`` through a temporary file next to it and ``os.replace``: never half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{secrets.token_hex(3)}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class OutputError(ValueError):
    """An output place that cannot be written; the message names the option, the path and what is wrong."""


def check_new_dir(target: str | Path, overwrite: bool, option: str, allow_empty: bool = False) -> Path:
    """Check, before any work, that the folder ``target`` can be created (or replaced with ``overwrite``): an
    existing ancestor is a writable folder, and ``target`` does not exist (an empty folder is fine with
    ``allow_empty``). ``option`` names the flag in messages (``--out``)."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{option} {target}: is a file, expected a folder")
    if target.is_dir() and not overwrite and not (allow_empty and not any(target.iterdir())):
        raise OutputError(f"{option} {target}: exists; pass --overwrite to replace it")
    parent = next((p for p in target.parents if p.exists()), Path("."))
    if not parent.is_dir():
        raise OutputError(f"{option} {target}: {parent} is a file, expected a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {target}: {parent} is not writable")
    return target


def write_dir_atomic(target: str | Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Call ``fill(folder)`` on a temporary folder next to ``target`` and rename it to ``target`` when ``fill``
    returns; any failure removes it. An existing ``target`` is replaced only with ``overwrite`` (moved aside
    first, removed once the new folder is in place)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        fill(tmp)
        _swap_in(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _swap_in(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        tmp.rename(target)
        return
    if not overwrite:
        raise OutputError(f"{target}: appeared while writing; not replaced")
    old = target.with_name(f".{target.name}.old-{secrets.token_hex(3)}")
    target.rename(old)
    try:
        tmp.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)
