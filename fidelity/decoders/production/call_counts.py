"""Per-op call counters for the run manifest: ``{op: {key: calls}}``. Python calls are counted; a captured CUDA
graph's replays are not. Used for the kernel fallbacks (key: the reason the emulation ran), the routes of
multi-route ops (key: the route) and the implementations ops resolved to (key: the implementation).

Each counter keeps a process-wide tally since its last ``reset()`` and adds every call to the scopes open at the
time (:func:`counting`): a production session opens its own around each model call, so a run reads its decoder's
counts and no other run's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Counts = dict[str, dict[str, dict[str, int]]]  # counter name -> op -> key -> calls

_open: ContextVar[tuple[Counts, ...]] = ContextVar("open_call_count_scopes", default=())


@contextmanager
def counting(into: Counts) -> Iterator[Counts]:
    """Add every call noted inside the block to ``into`` (nested scopes all count it)."""
    token = _open.set((*_open.get(), into))
    try:
        yield into
    finally:
        _open.reset(token)


class CallCounts:
    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: dict[str, dict[str, int]] = {}

    def note(self, op: str, key: str) -> None:
        """One call of ``op`` under ``key``."""
        for calls in (self._calls, *(scope.setdefault(self.name, {}) for scope in _open.get())):
            by_key = calls.setdefault(op, {})
            by_key[key] = by_key.get(key, 0) + 1

    def counts(self, op: str | None = None) -> dict:
        """{key: calls} of ``op``; without ``op``, {op: {key: calls}} of every op (copies), since ``reset``."""
        if op is not None:
            return dict(self._calls.get(op, {}))
        return {name: dict(by_key) for name, by_key in self._calls.items()}

    def reset(self) -> None:
        self._calls.clear()
