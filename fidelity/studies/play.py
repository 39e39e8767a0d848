"""Playing a scenario on a decoder under test: a run's logits from position 0 (prefill in its chunks, then its
decode steps), a script's calls, forks and proposals rolled back (optionally recorded as a trace), and which
capabilities a scenario needs that a decoder lacks."""

from __future__ import annotations

import torch

from fidelity.decoders.base import Call, Decoder
from fidelity.decoders.trace_file import TraceWriter
from fidelity.model.sites import Recorder
from fidelity.studies.catalogue import Fork, Propose, Run, Scenario, Script, tokens
from fidelity.studies.site_checks import SiteRows


def decoder_logits(decoder: Decoder, ids: torch.Tensor, r: Run) -> torch.Tensor:
    """fp32 logits [positions, vocab] of ``r`` on ``decoder`` from position 0: the prefill (in ``r.chunks``), then
    ``r.decode_steps`` steps fed ``ids[prompt_len:]``; nothing recorded."""
    decoder.reset()
    decoder.rec = None
    seq = tokens(ids, r.stream) if r.stream else ids
    prompt = seq[: r.prompt_len]
    rows = [decoder.prefill(c).float() for c in prompt.split(list(r.chunks or (r.prompt_len,)))]
    rows += [decoder.step(int(t)).float()[None] for t in seq[r.prompt_len : r.positions]]
    return torch.cat(rows)


def play(decoder: Decoder, ids: torch.Tensor, script: Script, writer: TraceWriter | None = None,
         keep: dict[int, SiteRows] | None = None) -> dict[int, dict[int, torch.Tensor]]:
    """``script`` on ``decoder`` from a reset: {seq: {position: fp32 logits [vocab]}} of every call but the
    proposals. With ``writer``, every call, fork and rollback is also written to it as a trace (version 2): each
    sequence's sites where the decoder records every sequence of a call (``Decoder.records_sequences``), else the
    logits only. With ``keep`` (and such a decoder), each sequence's rows of the sites ``site_checks`` compares are
    kept there ({seq: SiteRows}), the proposals' left out."""
    decoder.reset()
    decoder.rec = None
    streams = {seq: tokens(ids, segs) for seq, segs in script.streams}
    pos: dict[int, int] = {}
    rows: dict[int, dict[int, torch.Tensor]] = {seq: {} for seq in streams}
    sites = (writer is not None or keep is not None) and decoder.records_sequences
    recorder = Recorder if writer is not None else SiteRows.recorder
    try:
        for op in script.ops:
            if isinstance(op, Fork):
                decoder.fork(op.seq, op.parent, op.pos)
                pos[op.seq] = op.pos
                if writer is not None:
                    writer.fork(op.seq, op.parent, op.pos)
                continue
            if isinstance(op, Propose):
                p = pos.get(op.seq, 0)
                draft = streams[op.seq][p : p + op.n].clone()
                draft[op.accept :] = (draft[op.accept :] + 1) % decoder.config.vocab_size
                calls = [Call(op.seq, draft, p)]
            else:
                calls = [Call(seq, streams[seq][pos.get(seq, 0) : pos.get(seq, 0) + n], pos.get(seq, 0))
                         for seq, n in op.calls]
            if sites:
                decoder.recorders = {c.seq: recorder() for c in calls}
            outs = decoder.forward(calls)
            if writer is not None:
                _write_call(writer, calls, outs, decoder.recorders if sites else None)
            if isinstance(op, Propose):
                decoder.rollback(op.seq, calls[0].start + op.accept)
                pos[op.seq] = calls[0].start + op.accept
                if writer is not None:
                    writer.rollback(op.seq, pos[op.seq])
                continue
            for call, out in zip(calls, outs, strict=True):
                for j, row in enumerate(out.float()):
                    rows[call.seq][call.start + j] = row
                pos[call.seq] = call.start + len(call.ids)
                if sites and keep is not None:
                    keep.setdefault(call.seq, SiteRows()).add(decoder.recorders[call.seq], call.start,
                                                              len(call.ids), decoder.config)
    finally:
        if sites:
            decoder.recorders = None
    return rows


def _write_call(writer: TraceWriter, calls: list[Call], outs: list[torch.Tensor], recorders: dict | None) -> None:
    """One played call into the trace: each sequence's recorded sites (``@seq``), the ids and logits."""
    for call in calls:
        rec = (recorders or {}).get(call.seq)
        for name in rec.records if rec is not None else ():
            writer(name, rec.get(name), seq=call.seq)
    writer.end_call([(c.seq, c.ids) for c in calls], [o.float() for o in outs])


def missing(scenario: Scenario, decoder: Decoder) -> str:
    """Why ``decoder`` cannot run ``scenario`` (the capabilities it lacks and their reasons), '' when it can."""
    have = decoder.capabilities()
    return "; ".join(f"{need}: {have[need]}" for need in scenario.needs if have.get(need) is not None)

