"""Caches that grow with the context, kept so that a call costs what its own tokens cost, not the context so far.

``Rows`` holds rows appended call after call (compressed entries, indexer keys) in one preallocated tensor written
in place, so reading them all is a view, not a concatenation of every earlier call's rows. ``gather_rows`` reads
rows of several tables as if they were one (``torch.cat(tables)[rows]``) without building that concatenation.
Both move values only: what they return equals, bit for bit, what the concatenation gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Rows:
    """Append-only rows [n, width]: ``append(rows)`` copies them in place (the storage grows by half when full:
    each row is copied O(1) times on average, and at most a third of the storage is unused); ``all()`` is the n rows
    so far, a view of the storage (contiguous)."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None  # [capacity, width]
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        """Rows [m, width] after those held."""
        if self.data is None or self.n + len(rows) > len(self.data):
            grown = rows.new_empty((self.n + max(self.n // 2, len(rows)), *rows.shape[1:]))
            if self.data is not None:
                grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : self.n + len(rows)] = rows
        self.n += len(rows)

    def all(self, width: int, like: torch.Tensor) -> torch.Tensor:
        """[n, width] every row so far (a [0, width] tensor of ``like``'s dtype and device before any)."""
        return like.new_zeros((0, width)) if self.data is None else self.data[: self.n]


def gather_rows(tables: Sequence[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """``torch.cat(tables)[rows]``: tables [p_k, d] stacked in order, rows int [...] (each in 0 .. sum p_k - 1)
    -> [..., d]; each table reads only the rows that fall in it."""
    out, start = None, 0
    for table in tables:
        end = start + len(table)
        if len(table):
            inside = (rows >= start) & (rows < end)
            got = table[torch.where(inside, rows - start, 0)]  # [..., d]
            out = got if out is None else torch.where(inside[..., None], got, out)
        start = end
    if out is None:
        raise IndexError(f"gather_rows: rows of {start} table rows in all")
    return out
