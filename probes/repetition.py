"""repetition probe: does a generated stream fall into a loop, and from which step?

Over the decode tokens t_0 .. t_{N-1} of one stream:
- ``ngram_seen[k]`` (k >= n-1): 1 when the n-gram ending at k occurred earlier in the stream (ending before k);
- ``repeat_rate``: the mean of ``ngram_seen`` (0 with fewer than n tokens);
- ``loop_onset`` / ``loop_period``: the first step from which the rest of the stream repeats with one period
  p <= ``max_period`` (t_i == t_{i-p} for every later i), counted only when that periodic tail holds at least
  ``min_loop`` tokens and two periods; -1 / 0 when the stream does not end in a loop;
- ``longest_repeat``: the length of the longest span that occurs at least twice (occurrences may overlap).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def repetition(tokens: Sequence[int], n: int = 4, max_period: int = 64, min_loop: int = 16) -> dict:
    """-> {"ngram_seen": int64 array [N] (0 before step n-1), "repeat_rate": float, "loop_onset": int,
    "loop_period": int, "longest_repeat": int}."""
    t = np.asarray(tokens, dtype=np.int64)
    seen = np.zeros(len(t), dtype=np.int64)
    earlier: set[tuple[int, ...]] = set()
    for k in range(n - 1, len(t)):
        gram = tuple(t[k - n + 1 : k + 1].tolist())
        seen[k] = gram in earlier
        earlier.add(gram)
    scored = len(t) - (n - 1)
    onset, period = _loop(t, max_period, min_loop)
    return {"ngram_seen": seen, "repeat_rate": float(seen[n - 1 :].mean()) if scored > 0 else 0.0,
            "loop_onset": onset, "loop_period": period, "longest_repeat": _longest_repeat(t)}


def _loop(t: np.ndarray, max_period: int, min_loop: int) -> tuple[int, int]:
    """(onset, period) of the earliest-starting periodic tail, (-1, 0) when there is none."""
    best = (-1, 0)
    for p in range(1, min(max_period, len(t) // 2) + 1):
        same = t[p:] == t[:-p]  # same[i - p] <=> t[i] == t[i - p]
        run = len(same) - (np.flatnonzero(~same)[-1] + 1) if (~same).any() else len(same)
        start = len(t) - run - p  # the tail t[start:] has period p
        if len(t) - start >= max(min_loop, 2 * p) and (best[0] < 0 or start < best[0]):
            best = (int(start), p)
    return best


def _longest_repeat(t: np.ndarray) -> int:
    """The longest run of equal tokens between the stream and itself shifted by any lag."""
    best = 0
    for lag in range(1, len(t)):
        same = np.concatenate(([False], t[lag:] == t[:-lag], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if len(edges):
            best = max(best, int((edges[1::2] - edges[0::2]).max()))
    return best
