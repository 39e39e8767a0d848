"""Files written whole or not at all: a temporary file in the same folder, then a rename. Output places are checked
before any work by creating them and writing a probe file there: permission bits do not tell (root passes them on
``/proc`` and on a read-only mount). An OSError while writing becomes an OutputError naming the place."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class OutputError(ValueError):
    """An output place that cannot be written; the message names the option, the path and what is wrong."""


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``path`` through a temporary file next to it and ``os.replace``: never half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{secrets.token_hex(3)}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write: {err.strerror}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure_folder(folder: str | Path, what: str) -> Path:
    """Create ``folder`` (and its parents) and write and remove a probe file in it; ``what`` begins the
    messages (``--out runs``). Raises OutputError when an ancestor is a file or nothing can be written there."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise OutputError(f"{what}: is a file, expected a folder" if existing == folder else
                          f"{what}: {existing} is a file, expected a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: {existing} is not writable")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"{what}: cannot create {folder}: {err.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".fidelity-probe-", dir=folder)
    except OSError as err:
        raise OutputError(f"{what}: cannot write in {folder}: {err.strerror}") from None
    try:
        os.close(fd)
    finally:
        os.unlink(probe)
    return folder


def check_new_dir(target: str | Path, overwrite: bool, option: str, allow_empty: bool = False) -> Path:
    """Check, before any work, that the folder ``target`` can be created (or replaced with ``overwrite``): its
    parent is created and written to (``ensure_folder``), and ``target`` does not exist (an empty folder is fine
    with ``allow_empty``). ``option`` names the flag in messages (``--out``)."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{option} {target}: is a file, expected a folder")
    if target.is_dir() and not overwrite and not (allow_empty and not any(target.iterdir())):
        raise OutputError(f"{option} {target}: exists; pass --overwrite to replace it")
    ensure_folder(target.parent, f"{option} {target}")
    return target


def write_dir_atomic(target: str | Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Call ``fill(folder)`` on a temporary folder next to ``target`` and rename it to ``target`` when ``fill``
    returns; any failure removes it (an OSError becomes an OutputError naming ``target``). An existing ``target``
    is replaced only with ``overwrite`` (moved aside first, removed once the new folder is in place)."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as err:
        raise OutputError(f"{target}: cannot write in {target.parent}: {err.strerror}") from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        fill(tmp)
        _swap_in(tmp, target, overwrite)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        where = f" {Path(str(err.filename)).name}" if err.filename else ""
        raise OutputError(f"{target}: cannot write{where}: {err.strerror or err}") from None
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


def write_into_atomic(folder: str | Path, fill: Callable[[Path], None]) -> Path:
    """Call ``fill(tmp)`` on a temporary folder inside the existing ``folder``, then move each file and folder it
    wrote into ``folder`` (replacing what is there), each by a rename: none half-written. Any failure removes the
    temporary folder (an OSError becomes an OutputError naming ``folder``)."""
    folder = Path(folder)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".report.partial-", dir=folder))
    except OSError as err:
        raise OutputError(f"{folder}: cannot write: {err.strerror}") from None
    try:
        fill(tmp)
        for entry in sorted(tmp.iterdir()):
            dest = folder / entry.name
            if dest.is_dir() and entry.is_dir():
                shutil.rmtree(dest)
            os.replace(entry, dest)
    except OSError as err:
        where = f" {Path(str(err.filename)).name}" if err.filename else ""
        raise OutputError(f"{folder}: cannot write{where}: {err.strerror or err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
