"""Traces: what a decoder computed, recorded by any engine's serving loop and judged offline against the oracle.

The format (version 2; docs/traces.md describes it for writers that do not import this package) is a directory:

- ``trace.json``: ``{"format": "dsv4-fidelity-trace", "version": 2, "decoder": label, "config": {...} (the
  official ``config.json`` fields), "profile": {...} (a profile's fields, or ``name`` and ``precision``: exact /
  bf16 / quantized), "checkpoint": {...} (optional: path, a relative one read from the trace's folder, or preset and
  seed, and hash), "shards": {"ranks": R, "dims": {site or template: dim}} (optional), "events": [...]}``. Events,
  in the order the engine did them:
  ``{"call": file, "rows": [[seq, start, n], ...], "sites": [stored tensor names]}`` (one model call: each
  sequence's n tokens at positions start.., in the file's row order), ``{"fork": [seq, parent, pos]}`` (a new
  sequence starts from the parent's state after its first pos tokens: a reused prefix) and ``{"rollback": [seq,
  pos]}`` (a sequence returns to position pos: rejected speculative tokens; what it computed at pos.. is void).
  A sequence's first call starts at 0 (or where it was forked), each later one where it stands.
- one safetensors file per call: ``ids`` int [N], ``positions`` int [N], ``seq`` int [N] (the sequence of each row;
  may be left out when the call holds one sequence), ``logits`` float [N, vocab], and sites of
  ``fidelity/model/sites.py`` by name: ``L3.attn.q`` holds every row of the call in row order, ``L3.attn.q@2`` only
  sequence 2's rows. The compressed entries (``attn.compressed_kv``, ``indexer.keys``: rows per entry a call
  completes, not per token) are stored per sequence (``@seq``) when a call holds several. Integer sites:
  ``indexer.topk``, ``attn.visible``, ``moe.experts``; the rest float. A tensor-parallel engine may store any
  tensor as shards ``<name>#<rank>`` (ranks 0..R-1), joined along the dim ``shards.dims`` gives for its site
  (or ``logits``).

Version 1 (one sequence: ``prompt``, ``generated`` and ``steps`` instead of ``events``, files ``step-*.safetensors``
without ``seq``) still loads. ``TraceWriter`` writes version 2 from a plain PyTorch loop (README "Test your own
decoder"); :func:`read_trace` checks the structure before any file is read; ``TraceDecoder``
(``fidelity.decoders.trace``) replays one sequence. A trace is written under a temporary name and renamed by
``finish``, so it is never half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from fidelity.atomic_write import OutputError, check_new_dir
from fidelity.model.config import ModelConfig
from fidelity.model.sites import SITE, Recorder, is_site, site_template

FORMAT, VERSION, MANIFEST = "dsv4-fidelity-trace", 2, "trace.json"
REPLICATED = "replicated"  # shards.dims: every rank holds the whole tensor (rank 0's is judged, each rank's too)
ENTRY_SITES = frozenset({SITE.attn_compressed_kv, SITE.indexer_keys})  # rows per compressed entry
_STORED = re.compile(r"(?P<name>[^@#]+)(@(?P<seq>\d+))?(#(?P<rank>\d+))?")


class TraceError(ValueError):
    """A trace that cannot be written or used; the message names the file, field or site, expected vs found."""


# ---- the structure: events and each sequence's timeline ----------------------------------------------------------

@dataclass(frozen=True)
class Rows:
    """Sequence ``seq``'s ``n`` rows of a call, at positions ``start``.., rows ``offset``.. of its file."""

    seq: int
    start: int
    n: int
    offset: int


@dataclass(frozen=True)
class CallEvent:
    file: str
    rows: tuple[Rows, ...]
    sites: tuple[str, ...]  # the stored tensor names besides ids, positions, seq and logits


@dataclass(frozen=True)
class ForkEvent:
    seq: int
    parent: int
    pos: int


@dataclass(frozen=True)
class RollbackEvent:
    seq: int
    pos: int


@dataclass(frozen=True)
class Segment:
    """A sequence's rows of one call that still count: the first ``keep`` of ``rows`` (fewer than ``rows.n`` when
    a rollback or a fork cut the call)."""

    call: CallEvent
    rows: Rows
    keep: int

    @property
    def start(self) -> int:
        return self.rows.start

    @property
    def stop(self) -> int:
        return self.rows.start + self.keep


@dataclass
class Trace:
    """A checked ``trace.json``: the manifest, its events and shard layout."""

    directory: Path
    manifest: dict
    events: list[CallEvent | ForkEvent | RollbackEvent]
    ranks: int = 1
    dims: dict[str, int | str] | None = None

    @property
    def calls(self) -> list[CallEvent]:
        return [e for e in self.events if isinstance(e, CallEvent)]

    @property
    def sequences(self) -> list[int]:
        return sorted({r.seq for c in self.calls for r in c.rows})

    def timeline(self, seq: int) -> list[Segment]:
        """Sequence ``seq``'s segments in position order, 0 to where it ends: a fork's parent's up to the fork,
        then its own; a rollback voids what lies past its position."""
        lines: dict[int, list[Segment]] = {}
        for e in self.events:
            if isinstance(e, CallEvent):
                for r in e.rows:
                    lines.setdefault(r.seq, []).append(Segment(e, r, r.n))
            elif isinstance(e, ForkEvent):
                lines[e.seq] = _cut(lines.get(e.parent, []), e.pos)
            else:
                lines[e.seq] = _cut(lines.get(e.seq, []), e.pos)
        if seq not in lines:
            raise TraceError(f"{self.directory / MANIFEST}: no sequence {seq}; the trace holds sequences "
                             f"{self.sequences}")
        return lines[seq]

    def split_dim(self, name: str) -> int | str | None:
        """The dim shards of stored tensor ``name`` (a site, ``site@seq`` or ``logits``) join along (``replicated``:
        each shard is the whole tensor), None when the trace has no shards."""
        if self.ranks == 1 or self.dims is None:
            return None
        base = _STORED.fullmatch(name)["name"]
        for key in (base, site_template(base)):
            if key in self.dims:
                return self.dims[key]
        raise TraceError(f"{self.directory / MANIFEST}: shards.dims: no split dim for {base!r} (expected an entry "
                         f"for it or {site_template(base)!r})")


def _cut(segments: list[Segment], pos: int) -> list[Segment]:
    """The segments up to position ``pos`` (the one that straddles it kept in part)."""
    out = []
    for s in segments:
        if s.stop <= pos:
            out.append(s)
        elif s.start < pos:
            out.append(Segment(s.call, s.rows, pos - s.start))
    return out


def read_trace(directory: str | Path) -> Trace:
    """``directory``'s trace.json, checked (format, version, fields, every event, each sequence's positions:
    calls where the sequence stands, forks and rollbacks within what it has) before any step file is read;
    version 1 read as one sequence."""
    directory = Path(directory)
    m = read_manifest(directory)
    where = directory / MANIFEST
    events = _v1_events(m, where) if m["version"] == 1 else _v2_events(m, where)
    trace = Trace(directory, m, events)
    if shards := m.get("shards"):
        trace.ranks, trace.dims = _check_shards(shards, where)
    _check_positions(trace, where)
    return trace


def read_manifest(directory: str | Path) -> dict:
    """A trace's ``trace.json``, checked for its format, version and fields; TraceError names what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise TraceError(f"trace {directory}: no {MANIFEST} (is it a trace directory?)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise TraceError(f"{path}: format: expected {FORMAT!r}, found {found!r}")
    if manifest.get("version") not in (1, 2):
        raise TraceError(f"{path}: version: expected 1 or 2, found {manifest.get('version')!r}")
    for key in ("config", *(("prompt", "generated", "steps") if manifest["version"] == 1 else ("events",))):
        if key not in manifest:
            raise TraceError(f"{path}: missing field {key!r}")
    return manifest


def _v1_events(m: dict, where: Path) -> list[CallEvent]:
    out = []
    for k, step in enumerate(m["steps"]):
        try:
            first, stop = (int(p) for p in step["positions"])
            out.append(CallEvent(str(step["file"]), (Rows(0, first, stop - first, 0),),
                                 tuple(s for s in step.get("sites", []) if s != "logits")))
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{where}: steps[{k}]: expected {{'file', 'positions': [first, last + 1], 'sites'}}, "
                             f"found {step!r}") from None
    return out


def _v2_events(m: dict, where: Path) -> list[CallEvent | ForkEvent | RollbackEvent]:
    if not isinstance(m["events"], list):
        raise TraceError(f"{where}: events: expected a list, found {type(m['events']).__name__}")
    out: list[CallEvent | ForkEvent | RollbackEvent] = []
    for k, e in enumerate(m["events"]):
        try:
            if isinstance(e, dict) and set(e) <= {"call", "rows", "sites"} and "call" in e:
                rows, offset = [], 0
                for seq, start, n in e["rows"]:
                    if int(n) < 1 or int(start) < 0 or int(seq) < 0:
                        raise ValueError
                    rows.append(Rows(int(seq), int(start), int(n), offset))
                    offset += int(n)
                if not rows:
                    raise ValueError
                if twice := sorted({r.seq for r in rows if [x.seq for x in rows].count(r.seq) > 1}):
                    raise TraceError(f"{where}: events[{k}] ({e['call']}): sequence {twice[0]} is listed twice in "
                                     "one call's rows; a call feeds each sequence once ([seq, start, n] with all its "
                                     "tokens)")
                out.append(CallEvent(str(e["call"]), tuple(rows), tuple(str(s) for s in e.get("sites", []))))
            elif isinstance(e, dict) and set(e) == {"fork"}:
                seq, parent, pos = (int(v) for v in e["fork"])
                out.append(ForkEvent(seq, parent, pos))
            elif isinstance(e, dict) and set(e) == {"rollback"}:
                seq, pos = (int(v) for v in e["rollback"])
                out.append(RollbackEvent(seq, pos))
            else:
                raise ValueError
        except TraceError:
            raise
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{where}: events[{k}]: expected {{'call': file, 'rows': [[seq, start, n], ...] (n >= "
                             "1, each sequence once), 'sites': [...]}, {'fork': [seq, parent, pos]} or "
                             f"{{'rollback': [seq, pos]}}, found {json.dumps(e)[:200]}") from None
    return out


def _check_shards(shards, where: Path) -> tuple[int, dict[str, int | str]]:
    try:
        ranks = int(shards["ranks"])
        dims = {str(k): v if v == REPLICATED else int(v) for k, v in shards["dims"].items()}
        if ranks < 1 or any(d != REPLICATED and d < 0 for d in dims.values()):
            raise ValueError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise TraceError(f"{where}: shards: expected {{'ranks': R >= 1, 'dims': {{site or template: dim >= 0 or "
                         f"'replicated'}}}}, found {json.dumps(shards)[:200]}") from None
    return ranks, dims


def _check_positions(trace: Trace, where: Path) -> None:
    """Every call continues its sequences where they stand; forks and rollbacks stay within what they have."""
    pos: dict[int, int] = {}
    for k, e in enumerate(trace.events):
        if isinstance(e, CallEvent):
            for r in e.rows:
                if r.start != pos.get(r.seq, 0):
                    stands = f"stands at {pos[r.seq]}" if r.seq in pos else "is new: starts at 0"
                    raise TraceError(f"{where}: events[{k}] ({e.file}): sequence {r.seq} starts at {r.start}; it "
                                     f"{stands}")
                pos[r.seq] = r.start + r.n
        elif isinstance(e, ForkEvent):
            if e.parent not in pos or e.seq in pos or not 0 <= e.pos <= pos[e.parent]:
                why = (f"no sequence {e.parent} to fork" if e.parent not in pos else f"sequence {e.seq} exists"
                       if e.seq in pos else f"position {e.pos} is not in 0..{pos[e.parent]}")
                raise TraceError(f"{where}: events[{k}]: fork {e.seq} from {e.parent} at {e.pos}: {why}")
            pos[e.seq] = e.pos
        else:
            if e.seq not in pos or not 0 <= e.pos <= pos[e.seq]:
                why = f"no sequence {e.seq}" if e.seq not in pos else f"position {e.pos} is not in 0..{pos[e.seq]}"
                raise TraceError(f"{where}: events[{k}]: rollback of {e.seq} to {e.pos}: {why}")
            pos[e.seq] = e.pos
    if not trace.calls:
        raise TraceError(f"{where}: no call recorded")


# ---- writing -----------------------------------------------------------------------------------------------------

class TraceWriter:
    """Records a decoder's calls into a trace directory (version 2).

    While a model call runs, hand it sites like a ``Recorder`` (``writer(site, tensor)``: every row of the call;
    ``seq=k``: sequence k's rows; ``rank=r``: a tensor-parallel shard, with ``shards`` given); after the call,
    ``end_step(ids, logits)`` (one sequence, 0, continuing where it stands) or ``end_call([(seq, ids), ...],
    logits)`` (several sequences, rows in that order); ``fork`` / ``rollback`` between calls; ``finish()`` after
    the last. ``config`` is a ``ModelConfig`` or a ``config.json`` path; ``prompt`` is not stored (the calls hold
    every token) and is accepted for the one-sequence loop's convenience.
    """

    def __init__(self, directory: str | Path, config: ModelConfig | str | Path, prompt=None,
                 decoder: str = "unnamed", profile: dict | None = None, checkpoint: dict | None = None,
                 overwrite: bool = False, shards: dict | None = None):
        """``profile``: the decoder's numerics, as a run manifest's profile (``{"name": ..., "precision": "bf16"}``
        picks the default thresholds of a bf16 decoder; ``exact`` / ``quantized`` the others). ``shards``:
        ``{"ranks": R, "dims": {site or template: dim}}`` for sites handed as shards."""
        self.target = check_new_dir(directory, overwrite, "trace")
        self.config = config if isinstance(config, ModelConfig) else ModelConfig.from_file(config)
        self.decoder, self.checkpoint, self.overwrite = decoder, dict(checkpoint or {}), overwrite
        self.profile = dict(profile or {"name": decoder, "precision": "bf16"})
        self.shards = shards
        if shards is not None:
            _check_shards(shards, Path("TraceWriter(shards=...)"))
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.partial-", dir=self.target.parent))
        except OSError as err:
            raise OutputError(f"trace {self.target}: cannot write in {self.target.parent}: {err.strerror}") from None
        self.events: list[dict] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pos: dict[int, int] = {}

    def wants(self, site: str) -> bool:  # Recorder-compatible
        return True

    def __call__(self, site: str, tensor: torch.Tensor, seq: int | None = None, rank: int | None = None) -> None:
        """Record ``tensor`` at ``site`` for the call in progress (rows concatenate if called twice)."""
        if not is_site(site):
            raise TraceError(f"trace: unknown site {site!r}; sites are listed in fidelity.model.sites.SITES")
        if rank is not None and (self.shards is None or not 0 <= rank < int(self.shards["ranks"])):
            raise TraceError(f"trace: {site}: rank {rank} needs shards={{'ranks': R, 'dims': ...}} with R > {rank}")
        name = site + (f"@{seq}" if seq is not None else "") + (f"#{rank}" if rank is not None else "")
        t = tensor.detach().to("cpu").contiguous()
        self.pending[name] = torch.cat((self.pending[name], t)) if name in self.pending else t

    def end_step(self, ids, logits: torch.Tensor) -> None:
        """Close a call of sequence 0 that fed ``ids`` [n]: its logits [n, vocab] (or [vocab] for one token) and
        the sites recorded since the previous call."""
        self.end_call([(0, ids)], logits)

    def end_call(self, calls, logits: torch.Tensor | list[torch.Tensor]) -> None:
        """Close a call of several sequences: ``calls`` [(seq, ids [n_k])] (each continues where it stands, a new
        one at 0), ``logits`` [sum n_k, vocab] in that row order (or a list, one [n_k, vocab] per sequence)."""
        ids = [torch.as_tensor(t).long().flatten().cpu() for _, t in calls]
        if isinstance(logits, list | tuple):
            logits = torch.cat([torch.as_tensor(x).reshape(len(i), -1) for x, i in zip(logits, ids, strict=True)])
        seqs = [int(s) for s, _ in calls]
        positions = torch.cat([torch.arange(self.pos.get(s, 0), self.pos.get(s, 0) + len(i))
                               for s, i in zip(seqs, ids, strict=True)])
        rows = torch.cat([torch.full((len(i),), s) for s, i in zip(seqs, ids, strict=True)])
        all_ids = torch.cat(ids)
        self._write(all_ids, positions, rows, logits.detach().float().cpu().reshape(len(all_ids), -1), self.pending)
        self.pending = {}

    def add_step(self, ids: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor, rec: Recorder) -> None:
        """The runner's path: one call of sequence 0: its ids, positions, logits and the decoder's recorder."""
        sites = {site: rec.get(site) for site in rec.records}
        ids = torch.as_tensor(ids).long().cpu()
        self._write(ids, positions.long().cpu(), torch.zeros(len(ids), dtype=torch.long),
                    logits.detach().float().cpu(), sites)

    def fork(self, seq: int, parent: int, pos: int) -> None:
        """Sequence ``seq`` (new) starts from ``parent``'s state after its first ``pos`` tokens."""
        if parent not in self.pos or seq in self.pos or not 0 <= pos <= self.pos[parent]:
            raise TraceError(f"trace: fork {seq} from {parent} at {pos}: the parent must exist, the child not, and "
                             f"pos lie in 0..{self.pos.get(parent, 0)}")
        self.events.append({"fork": [seq, parent, pos]})
        self.pos[seq] = pos

    def rollback(self, seq: int, pos: int) -> None:
        """Sequence ``seq`` returns to position ``pos`` (what it computed past it is void)."""
        if seq not in self.pos or not 0 <= pos <= self.pos[seq]:
            raise TraceError(f"trace: rollback of {seq} to {pos}: expected a sequence and a position in 0.."
                             f"{self.pos.get(seq, 0)}")
        self.events.append({"rollback": [seq, pos]})
        self.pos[seq] = pos

    def _write(self, ids: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor, logits: torch.Tensor,
               sites: dict[str, torch.Tensor]) -> None:
        rows, offset = [], 0
        for seq in dict.fromkeys(seqs.tolist()):
            mine = (seqs == seq).nonzero().flatten()
            start, n = int(positions[mine[0]]), len(mine)
            if start != self.pos.get(seq, 0):
                raise TraceError(f"trace: call {len(self.events)}: sequence {seq} starts at position {start}, "
                                 f"expected {self.pos.get(seq, 0)}")
            if not torch.equal(mine, torch.arange(offset, offset + n)):
                raise TraceError(f"trace: call {len(self.events)}: sequence {seq}'s rows are not contiguous")
            rows.append([seq, start, n])
            offset += n
        name = f"call-{sum('call' in e for e in self.events):05d}.safetensors"
        tensors = {"ids": ids, "positions": positions, "seq": seqs, "logits": logits,
                   **{k: v.contiguous() for k, v in sites.items() if k != "logits"}}
        try:
            save_file(tensors, str(self.tmp / name), metadata={"format": "pt"})
        except OSError as err:
            raise OutputError(f"trace {self.target}: cannot write {name}: {err.strerror}") from None
        self.events.append({"call": name, "rows": rows, "sites": sorted(k for k in sites if k != "logits")})
        for seq, start, n in rows:
            self.pos[seq] = start + n

    def abort(self) -> None:
        """Remove what was written (a run that failed leaves no trace behind)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self, checkpoint: dict | None = None) -> Path:
        """Write trace.json and move the trace into place (``checkpoint``: fields added to the recorded one)."""
        if not any("call" in e for e in self.events):
            raise TraceError("trace: no call was recorded")
        recorded = {**self.checkpoint, **(checkpoint or {})}
        if recorded.get("path"):
            recorded["path"] = self._relative(recorded["path"])
        manifest = {"format": FORMAT, "version": VERSION, "decoder": self.decoder, "profile": self.profile,
                    "config": self.config.to_official_dict(), "checkpoint": recorded,
                    **({"shards": self.shards} if self.shards is not None else {}), "events": self.events}
        try:
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            self.tmp.chmod(0o755)
            if self.target.exists():
                if not self.overwrite:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    raise OutputError(f"trace {self.target}: appeared while writing; not replaced")
                shutil.rmtree(self.target)
            self.tmp.rename(self.target)
        except OSError as err:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise OutputError(f"trace {self.target}: cannot write: {err.strerror}") from None
        return self.target

    def _relative(self, path: str | Path) -> str:
        """A checkpoint path as trace.json holds it: an absolute one as it is, a relative one (to the current
        directory) made relative to the trace's folder, where a replay reads it from."""
        if Path(path).is_absolute():
            return str(path)
        return os.path.relpath(Path(path).resolve(), self.target.resolve())


def stored_name(name: str) -> tuple[str, int | None, int | None]:
    """``L3.attn.q@2#1`` -> (``L3.attn.q``, 2, 1): the site (or ``logits``), its sequence, its shard rank."""
    m = _STORED.fullmatch(name)
    if m is None:
        raise TraceError(f"trace: stored tensor name {name!r}: expected <site>[@<seq>][#<rank>]")
    return m["name"], None if m["seq"] is None else int(m["seq"]), None if m["rank"] is None else int(m["rank"])
