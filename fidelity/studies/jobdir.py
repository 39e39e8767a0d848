"""A long job's directory (``fidelity scenarios``, ``fidelity mutants``) that keeps what it finished.

The directory holds ``job.json`` (which command made it) and ``kept/``: a JSON record per finished run, written
atomically as the run completes, with the run's inputs (its input key: package version, checkpoint hash, decoder,
profile, modes, the run's own definition and tokens) and what the final report needs of it. ``--resume DIR``
continues a stopped job: a run whose record is there with the same inputs is reused, one whose inputs changed is
redone. A result always comes back as its record reads, so a resumed job reports what an uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fidelity._version import __version__
from fidelity.api import plural
from fidelity.atomic_write import ensure_folder, write_text_atomic
from fidelity.outputs.rundir import RunDirError

JOB_FILE, KEPT = "job.json", "kept"
MISSING = object()


def start_job(target: Path, command: str, overwrite: bool = False) -> Path:
    """Create the job directory ``target`` of ``command`` (an existing one is removed first with ``overwrite``;
    its place was checked before: ``rundir.check_output``)."""
    if overwrite and target.exists():
        shutil.rmtree(target)
    (target / KEPT).mkdir(parents=True)
    record = {"command": command, "version": __version__, "started": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"}
    write_text_atomic(target / JOB_FILE, json.dumps(record, indent=1) + "\n")
    return target


def open_job(path: str | Path, command: str) -> Path:
    """The job directory ``path`` of ``command`` to resume, its half-written leftovers removed; RunDirError in one
    line when it is not one."""
    path = Path(path)
    what = f"--resume {path}: expected a job directory of fidelity {command} (holding its {JOB_FILE})"
    if not path.is_dir():
        raise RunDirError(f"{what}, found {'a file' if path.exists() else 'no such folder'}")
    try:
        made_by = json.loads((path / JOB_FILE).read_text(encoding="utf-8")).get("command")
    except FileNotFoundError:
        raise RunDirError(f"{what}, found no {JOB_FILE}") from None
    except (OSError, ValueError, AttributeError):
        raise RunDirError(f"{what}, found an unreadable {JOB_FILE}") from None
    if made_by != command:
        raise RunDirError(f"{what}, found one of fidelity {made_by}")
    ensure_folder(path, f"--resume {path}")
    (path / KEPT).mkdir(exist_ok=True)
    for leftover in [p for d in (path, path / KEPT, path / "runs") if d.is_dir() for p in d.iterdir()
                     if p.name.startswith(".") and ".partial-" in p.name]:
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    return path


def digest(data: bytes) -> str:
    """A short content hash (the tokens a run is fed, in its input key)."""
    return hashlib.sha256(data).hexdigest()[:16]


def _plain(value: Any) -> Any:
    """``value`` as its JSON record reads back (numpy scalars as Python ones, tuples as lists)."""
    return json.loads(json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


@dataclass
class Job:
    """The kept runs of the job directory ``path``; ``common``: the inputs every run shares (added to each run's
    own); ``resumed``: the job continues a stopped one (its report then says what was reused and redone)."""

    path: Path
    common: dict
    resumed: bool = False
    reused: list[str] = field(default_factory=list)
    redone: list[tuple[str, list[str]]] = field(default_factory=list)
    seen: set[Path] = field(default_factory=set)
    fresh: set[str] = field(default_factory=set)  # runs this job kept in its worker processes (not reused)

    def _file(self, name: str) -> Path:
        slug = re.sub(r"[^A-Za-z0-9._+-]+", "-", name).strip("-")[:80]
        return self.path / KEPT / f"{slug}-{digest(name.encode())[:8]}.json"

    def lookup(self, name: str, inputs: dict) -> Any:
        """The kept result of run ``name`` if it finished with these inputs, else MISSING (a run kept with other
        inputs is noted as redone, with the inputs that changed)."""
        file = self._file(name)
        self.seen.add(file)
        if not file.is_file():
            return MISSING
        key = _plain({**self.common, **inputs})
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
            kept = record["inputs"]
        except (OSError, ValueError, KeyError, TypeError):
            self.redone.append((name, ["unreadable record"]))
            return MISSING
        if kept != key:
            self.redone.append((name, sorted(k for k in key.keys() | kept.keys() if key.get(k) != kept.get(k))))
            return MISSING
        if name not in self.fresh:
            self.reused.append(name)
        return record["result"]

    def kept(self, name: str, inputs: dict) -> bool:
        """Whether run ``name`` is kept with these inputs (nothing noted)."""
        try:
            record = json.loads(self._file(name).read_text(encoding="utf-8"))
            return record["inputs"] == _plain({**self.common, **inputs})
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def keep(self, name: str, inputs: dict, result: Any) -> Any:
        """Write run ``name``'s record (atomically) and return ``result`` as the record reads back."""
        record = _plain({"name": name, "inputs": {**self.common, **inputs}, "result": result})
        file = self._file(name)
        self.seen.add(file)
        write_text_atomic(file, json.dumps(record, indent=1) + "\n")
        return record["result"]

    def once(self, name: str, inputs: dict, compute: Callable[[], Any],
             tell: Callable[[str], None] = lambda line: None) -> Any:
        """Run ``name``'s kept result, or ``compute()`` kept as it finishes."""
        if (found := self.lookup(name, inputs)) is not MISSING:
            if name not in self.fresh:
                tell(f"{name}: kept from the stopped job")
            return found
        return self.keep(name, inputs, compute())

    @property
    def kept_any(self) -> bool:
        return any((self.path / KEPT).glob("*.json"))

    def prune(self) -> int:
        """Remove the records of runs this job did not ask for (another selection); returns how many."""
        stale = [p for p in (self.path / KEPT).glob("*.json") if p not in self.seen]
        for p in stale:
            p.unlink()
        return len(stale)

    def summary(self, dropped: int = 0) -> str:
        """The report's line on a resumed job: runs reused, runs redone because their inputs changed (which, and
        what changed); '' for a job that was not resumed."""
        if not self.resumed:
            return ""
        line = f"Resumed: {plural(len(self.reused), 'kept run')} reused, {len(self.redone)} redone because their " \
               "inputs changed"
        if self.redone:
            line += ": " + "; ".join(f"{name} ({', '.join(what)})" for name, what in self.redone)
        return line + (f"; {plural(dropped, 'kept run')} not in this job dropped." if dropped else ".")


@contextmanager
def kept_job(target: Path, command: str, common: dict, resume: bool = False,
             overwrite: bool = False) -> Iterator[Job]:
    """The job of ``command`` in ``target``: a new directory (``start_job``), or with ``resume`` the stopped job
    there (checked by ``open_job``). A new job that stops before it kept a run leaves no directory behind."""
    job = Job(target if resume else start_job(target, command, overwrite), common, resumed=resume)
    try:
        yield job
    except BaseException:
        if not resume and not job.kept_any:  # nothing finished: nothing to resume
            shutil.rmtree(target, ignore_errors=True)
        raise
