"""Judging one call script (``fidelity fuzz``): against the decoder itself first, the pairs ``derive`` gives judged
as the catalogue's are (``scenarios.self_consistency``), and against the oracle, each played sequence through its
trace (``scenarios.judge_trace``).

A script fails by a *check*: the kind of its first failing pair (``batched==alone``, ``rolled back==never
proposed``, ...), ``oracle <site>`` (the first divergence of a played sequence, e.g. ``oracle L2.attn.kv``) or
``the decoder raised <Type>``. A pair judged by the bounds (no equal bits promised) is a screen: when it fails, the
oracle judges the script and decides (the bounds were measured on prompts of 125 tokens and more; on a few
tokens the clean decoder's chunked and whole prefills differ by more, rel_l2 0.049 over 8 positions). A script
the decoder cannot make (a ``DecoderError`` or ``ContextError``: a fork
where it cannot fork) is *refused*, neither passed nor failed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fidelity.api import CheckpointPlan
from fidelity.decoders.base import ContextError, Decoder, DecoderError, raised
from fidelity.decoders.trace_file import TraceWriter
from fidelity.studies.catalogue import Script
from fidelity.studies.derive import PLAYED, derive
from fidelity.studies.play import play
from fidelity.studies.scenarios import judge_trace, self_consistency

Fresh = Callable[[int], Decoder]


@dataclass
class Verdict:
    """``check``: what failed ('' when nothing did); ``detail``: where and by how much; ``pairs``: the pairs table's
    rows; ``oracle``: a matrix row per played sequence judged against the oracle; ``refused``: why the decoder could
    not make the script."""

    check: str = ""
    detail: str = ""
    pairs: list[dict] = field(default_factory=list)
    oracle: list[dict] = field(default_factory=list)
    refused: str = ""
    bound_only: bool = False  # failed only a pair judged by the bounds (no equal bits promised)
    note: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.check)


def judge_self(script: Script, ids: torch.Tensor, fresh: Fresh) -> Verdict:
    """``script`` against the decoder itself: its derived pairs on fresh decoders."""
    try:
        pairs = self_consistency(derive(script), ids, fresh)
    except (DecoderError, ContextError) as err:
        return Verdict(refused=str(err))
    except Exception as err:  # a decoder that raises on a call it claims to serve fails the script
        return Verdict(f"the decoder raised {type(err).__name__}", raised(err))
    bad = [p for p in pairs if not p["passed"]]
    if not bad:
        return Verdict(pairs=pairs)
    p = next((q for q in bad if decisive(q)), bad[0])
    detail = (f"{p['pair']}: {p['b']} vs {p['a']}, positions {p['positions']}, worst position {p['worst_position']}, "
              f"cos_min {p['cos_min']:.5f}, rel_l2 {p['rel_l2']:.4f}, bitwise promised: {p['bitwise promised']}")
    if p["site"]:
        detail += f"; at the sites ({p['site_check']}): {p['site_detail']}"
    check = p["pair"] + (f" at {p['site']}" if p["site"] else "")
    return Verdict(check, detail, pairs, bound_only=not decisive(p))


def decisive(pair: dict) -> bool:
    """Whether a failing pair fails by more than a bound: equal bits promised and broken (logits or a site), or a
    site's structure broken."""
    logits_bits = pair["bitwise promised"] != "no" and not pair["bitwise"]
    return logits_bits or pair["site_check"] in ("structure", "bits")


def judge_oracle(script: Script, ids: torch.Tensor, fresh: Fresh, plan: CheckpointPlan,
                 modes: Sequence[str] = ("free", "layer"), device: str = "cpu") -> list[dict]:
    """Each sequence of ``script`` as played, against the oracle: a row per sequence (``judge_trace``'s matrix
    rows: verdict, first divergence, its site and step)."""
    scenario = derive(script)
    tmp = Path(tempfile.mkdtemp(prefix="fidelity-fuzz-"))
    try:
        decoder = fresh(script.positions)
        writer = TraceWriter(tmp / "trace", decoder.config, decoder=decoder.label, profile=decoder.profile)
        try:
            play(decoder, ids, Script(PLAYED, script.streams, script.ops), writer)
        except BaseException:
            writer.abort()
            raise
        trace = writer.finish()
        return judge_trace(scenario, PLAYED, trace, plan, modes, tmp, device, lambda kind, msg: None,
                           lambda line: None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def oracle_verdict(rows: list[dict]) -> tuple[str, str]:
    """(check, detail) of the first played sequence that fails against the oracle; ('', '') when none does."""
    for r in rows:
        if r["verdict"] != "PASS":
            return f"oracle {r['first_site']}", f"{r['run']}: {r['first_divergence']}"
    return "", ""


def judge(script: Script, ids: torch.Tensor, fresh: Fresh, plan: CheckpointPlan | None, oracle: bool,
          modes: Sequence[str] = ("free", "layer"), device: str = "cpu") -> Verdict:
    """``script`` against itself, then against the oracle when ``oracle`` or when it failed (``plan`` given): the
    self-consistency check decides when it fails, else the oracle's first divergence."""
    v = judge_self(script, ids, fresh)
    if v.refused or plan is None or not (oracle or v.failed):
        return v
    try:
        v.oracle = judge_oracle(script, ids, fresh, plan, modes, device)
    except (DecoderError, ContextError) as err:
        return Verdict(refused=str(err))
    except Exception as err:
        return Verdict(f"the decoder raised {type(err).__name__}", raised(err))
    check, detail = oracle_verdict(v.oracle)
    if v.bound_only:  # the bounds are a screen: the oracle decides
        v.note = f"bound exceeded ({v.detail}); the oracle {'fails' if check else 'passes'}"
        v.check, v.detail = check, detail
    elif not v.failed:
        v.check, v.detail = check, detail
    return v
