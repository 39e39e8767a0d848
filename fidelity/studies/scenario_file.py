"""Scenario files (docs/fuzz.md): a call script as JSON, which ``fidelity run --scenario-file F`` and ``fidelity
scenarios --scenario-file F`` replay as a scenario (its pairs derived by ``fidelity.studies.derive``) and ``fidelity
fuzz`` writes for the smallest failing script it found.

```json
{"format": "dsv4-fidelity scenario", "version": 1, "name": "fuzz-seed-0",
 "description": "what it reproduces",
 "sequences": [{"seq": 0, "stream": [[0, 300]]}, {"seq": 1, "stream": [[0, 130], [400, 8]]}],
 "ops": [{"feed": [[0, 256]]}, {"fork": {"seq": 1, "parent": 0, "pos": 130}},
         {"feed": [[0, 1], [1, 8]]}, {"propose": {"seq": 0, "n": 3, "accept": 1}}],
 "found": {"check": "...", "detail": "..."}}
```

``stream``: a sequence's tokens as (offset, length) segments of the default prompt's ids; ``feed``: one model call,
(sequence, tokens) per sequence in it; ``fork`` and ``propose`` as the catalogue's ``Fork`` and ``Propose``;
``found`` (optional) says what failed when the file was written.
"""

from __future__ import annotations

import json
from pathlib import Path

from fidelity.api import InputError
from fidelity.atomic_write import write_text_atomic
from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Decoder
from fidelity.studies.catalogue import Feed, Fork, Propose, Scenario, Script
from fidelity.studies.derive import derive

FORMAT, VERSION = "dsv4-fidelity scenario", 1


class ScenarioFileError(InputError):
    """A scenario file that does not parse, or asks for what the decoder or model cannot do: names the field."""


def to_json(script: Script, name: str, description: str = "", found: dict | None = None) -> dict:
    """``script`` as a scenario file's JSON object."""
    ops = []
    for op in script.ops:
        if isinstance(op, Feed):
            ops.append({"feed": [list(c) for c in op.calls]})
        elif isinstance(op, Fork):
            ops.append({"fork": {"seq": op.seq, "parent": op.parent, "pos": op.pos}})
        else:
            ops.append({"propose": {"seq": op.seq, "n": op.n, "accept": op.accept}})
    doc = {"format": FORMAT, "version": VERSION, "name": name, "description": description,
           "sequences": [{"seq": s, "stream": [list(g) for g in segs]} for s, segs in script.streams], "ops": ops}
    if found:
        doc["found"] = found
    return doc


def write(path: str | Path, script: Script, name: str, description: str = "", found: dict | None = None) -> Path:
    """Write ``script`` as a scenario file at ``path`` (atomically)."""
    write_text_atomic(Path(path), json.dumps(to_json(script, name, description, found), indent=1) + "\n")
    return Path(path)


def _int(value, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field}: expected an integer >= {low}, found {value!r}")
    return value


def _pairs(value, field: str, low: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field}: expected a non-empty list of [int, int], found {value!r}")
    out = []
    for k, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"{field}[{k}]: expected [int, int], found {item!r}")
        out.append((_int(item[0], f"{field}[{k}][0]"), _int(item[1], f"{field}[{k}][1]", low)))
    return tuple(out)


def from_json(doc) -> tuple[Script, str, str]:
    """(script, name, description) of a scenario file's JSON object; ValueError naming the field otherwise."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, found {type(doc).__name__}")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"format/version: expected {FORMAT!r} version {VERSION}, found {doc.get('format')!r} "
                         f"version {doc.get('version')!r}")
    name = doc.get("name", "scenario-file")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name: expected a non-empty string, found {name!r}")
    seqs = doc.get("sequences")
    if not isinstance(seqs, list) or not seqs:
        raise ValueError(f"sequences: expected a non-empty list, found {seqs!r}")
    streams = []
    for k, s in enumerate(seqs):
        if not isinstance(s, dict):
            raise ValueError(f"sequences[{k}]: expected an object with seq and stream, found {s!r}")
        streams.append((_int(s.get("seq"), f"sequences[{k}].seq"), _pairs(s.get("stream"), f"sequences[{k}].stream",
                                                                           1)))
    if len({s for s, _ in streams}) != len(streams):
        raise ValueError("sequences: a seq appears twice")
    ops_in = doc.get("ops")
    if not isinstance(ops_in, list) or not ops_in:
        raise ValueError(f"ops: expected a non-empty list, found {ops_in!r}")
    ops: list[Feed | Fork | Propose] = []
    for k, op in enumerate(ops_in):
        if not isinstance(op, dict) or len(op) != 1 or next(iter(op)) not in ("feed", "fork", "propose"):
            raise ValueError(f"ops[{k}]: expected one of {{\"feed\": ...}}, {{\"fork\": ...}}, {{\"propose\": ...}}, "
                             f"found {op!r}")
        kind, body = next(iter(op.items()))
        field = f"ops[{k}].{kind}"
        if kind == "feed":
            ops.append(Feed(_pairs(body, field, 1)))
            continue
        keys = ("seq", "parent", "pos") if kind == "fork" else ("seq", "n", "accept")
        if not isinstance(body, dict) or set(body) != set(keys):
            raise ValueError(f"{field}: expected an object with {', '.join(keys)}, found {body!r}")
        vals = [_int(body[key], f"{field}.{key}", 1 if key in ("pos", "n") else 0) for key in keys]
        ops.append(Fork(*vals) if kind == "fork" else Propose(*vals))
    script = Script(name, tuple(streams), tuple(ops))
    _check_positions(script)
    return script, name, str(doc.get("description", ""))


def _check_positions(script: Script) -> None:
    """Every op continues its sequence where it stands and reads inside its stream."""
    length = {s: sum(n for _, n in segs) for s, segs in script.streams}
    pos: dict[int, int] = {}
    for k, op in enumerate(script.ops):
        if isinstance(op, Fork):
            kind = "fork"
            if op.parent not in pos or op.seq in pos or op.pos > pos[op.parent]:
                raise ValueError(f"ops[{k}].fork: sequence {op.parent} must stand at or past {op.pos} and sequence "
                                 f"{op.seq} must be new, found {op.parent} at {pos.get(op.parent)}")
            pos[op.seq] = op.pos
            reads = [(op.seq, op.pos)]
        elif isinstance(op, Propose):
            kind = "propose"
            if op.seq not in pos or op.accept > op.n:
                raise ValueError(f"ops[{k}].propose: expected a sequence already fed and accept <= n, found seq "
                                 f"{op.seq}, n {op.n}, accept {op.accept}")
            reads = [(op.seq, pos[op.seq] + op.n)]
            pos[op.seq] += op.accept
        else:
            kind = "feed"
            if len({s for s, _ in op.calls}) != len(op.calls):
                raise ValueError(f"ops[{k}].feed: a sequence appears twice in one call")
            for s, n in op.calls:
                pos[s] = pos.get(s, 0) + n
            reads = [(s, pos[s]) for s, _ in op.calls]
        for s, end in reads:
            if s not in length:
                raise ValueError(f"ops[{k}].{kind}: sequence {s} is not in sequences")
            if end > length[s]:
                raise ValueError(f"ops[{k}].{kind}: sequence {s} reads to position {end}, past its stream's "
                                 f"{length[s]} tokens")


def read(path: str | Path, option: str = "--scenario-file") -> tuple[Scenario, Script]:
    """The scenario a file describes (its script played as ``played``, the derived pairs) and its script."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as err:
        raise ScenarioFileError(f"{option} {p}: cannot read it: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ScenarioFileError(f"{option} {p}: not JSON: {err}") from None
    try:
        script, name, description = from_json(doc)
    except ValueError as err:
        raise ScenarioFileError(f"{option} {p}: {err}") from None
    return derive(script, name, description or f"the call script of {p.name}"), script


def check_decoder(script: Script, decoder: Decoder, max_context: int, path: str | Path,
                  option: str = "--scenario-file") -> None:
    """One line naming the first op ``decoder`` cannot make (a capability it lacks) or a sequence past
    ``max_context``."""
    have = decoder.capabilities()
    for k, op in enumerate(script.ops):
        need, kind = ((FORK, "fork") if isinstance(op, Fork) else (ROLLBACK, "propose") if isinstance(op, Propose)
                      else (BATCH, "feed") if len(op.calls) > 1 or op.calls[0][0] != 0 else (None, "feed"))
        if need and have.get(need) is not None:
            raise ScenarioFileError(f"{option} {path}: ops[{k}].{kind}: needs {need}, which {decoder.label} lacks: "
                                    f"{have[need]}")
    for s, segs in script.streams:
        if (n := sum(length for _, length in segs)) > max_context:
            raise ScenarioFileError(f"{option} {path}: sequences[seq {s}].stream: {n} tokens, past the model's "
                                    f"context {max_context}")
