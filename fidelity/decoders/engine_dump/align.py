"""Token alignment: each forward pass's rows assigned to sequences and positions from the batch metadata the
engine dumps (``input_ids``, ``positions``, and where dumped ``seq_lens``, ``rids``, ``req_pool_indices``).

A pass holds its requests' rows one after another; request b's rows end at position ``seq_lens[b] - 1``, so it has
``seq_lens[b] - positions[first row]`` of them. Rows after the last request are padding (a CUDA graph's bucket) and
are dropped. A request is followed across passes by its id (``rids``), else its request slot
(``req_pool_indices``), else by where it stands (the first sequence standing at the pass's start position, in
order). Without ``seq_lens`` a pass is split where positions stop counting up by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fidelity.decoders.engine_dump.read import DumpError


@dataclass
class PassRows:
    """One pass: its rows per sequence ``[(seq, start, n, offset)]`` and the padded rows dropped."""

    step: int
    rows: list[tuple[int, int, int, int]]
    ids: torch.Tensor  # [N] every row, padding included
    padded: int


@dataclass
class Aligner:
    """Follows requests across passes; ``where``: the dump's folder (for messages)."""

    where: str
    stands: dict[int, int] = field(default_factory=dict)  # sequence -> position it stands at
    keys: dict[object, int] = field(default_factory=dict)  # request id or slot -> sequence
    order: list[int] = field(default_factory=list)

    def align(self, step: int, ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None,
              rids: list | None, slots: torch.Tensor | None) -> PassRows:
        ids, positions = ids.flatten().long(), positions.flatten().long()
        if len(ids) != len(positions):
            raise DumpError(f"{self.where}: step {step}: input_ids has {len(ids)} rows, positions {len(positions)}")
        spans = self._spans(step, positions, seq_lens)
        rows, used = [], set()
        for b, (offset, n) in enumerate(spans):
            start = int(positions[offset])
            key = rids[b] if rids is not None else int(slots[b]) if slots is not None else None
            seq = self._sequence(step, key, start, used)
            rows.append((seq, start, n, offset))
            used.add(seq)
            self.stands[seq] = start + n
        padded = len(ids) - sum(n for _, n in spans)
        return PassRows(step, rows, ids, padded)

    def _spans(self, step: int, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> list[tuple[int, int]]:
        if seq_lens is None:
            breaks = [0, *((positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1).tolist(), len(positions)]
            return [(a, b - a) for a, b in zip(breaks, breaks[1:], strict=False) if b > a]
        spans, offset = [], 0
        for b, length in enumerate(seq_lens.flatten().long().tolist()):
            if offset >= len(positions):
                raise DumpError(f"{self.where}: step {step}: seq_lens lists {len(seq_lens)} requests, the pass's rows "
                                f"end after request {b}")
            n = length - int(positions[offset])
            want = torch.arange(int(positions[offset]), length)
            if n < 1 or not torch.equal(positions[offset : offset + n], want):
                raise DumpError(f"{self.where}: step {step}: request {b} (seq_lens {length}) does not match its rows' "
                                f"positions {positions[offset:offset + 4].tolist()}...: cannot align the pass's rows")
            spans.append((offset, n))
            offset += n
        return spans

    def _sequence(self, step: int, key, start: int, used: set[int]) -> int:
        seq = self.keys.get(key) if key is not None else None
        if seq is not None and start == 0 and self.stands.get(seq, 0) > 0 and not isinstance(key, str):
            seq = None  # a request slot taken by a new request
        if seq is None and key is None and start > 0:
            seq = next((s for s in self.order if self.stands.get(s) == start and s not in used), None)
        if seq is None:
            if start != 0:
                raise DumpError(f"{self.where}: step {step}: a request starts at position {start} with no earlier rows "
                                "in the dump (a prefix-cache hit, or passes left out of the dump): dump from its first "
                                "token, e.g. with the engine's prefix cache off (SGLang: --disable-radix-cache)")
            seq = len(self.order)
            self.order.append(seq)
            if key is not None:
                self.keys[key] = seq
            return seq
        if self.stands.get(seq) != start:
            raise DumpError(f"{self.where}: step {step}: sequence {seq} continues at position {start}, it stands at "
                            f"{self.stands.get(seq)} (passes missing from the dump, or a speculative rollback, which "
                            "is not read yet)")
        return seq
