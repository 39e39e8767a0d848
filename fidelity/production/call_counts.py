"""Per-op call counters for the run manifest: ``{op: {key: calls}}`` since the last reset. Python calls are
counted; a captured CUDA graph's replays are not. Used for the kernel fallbacks (key: the reason the emulation
ran) and the routes of multi-route ops (key: the route)."""

from __future__ import annotations


class CallCounts:
    def __init__(self) -> None:
        self._calls: dict[str, dict[str, int]] = {}

    def note(self, op: str, key: str) -> None:
        """One call of ``op`` under ``key``."""
        by_key = self._calls.setdefault(op, {})
        by_key[key] = by_key.get(key, 0) + 1

    def counts(self, op: str | None = None) -> dict:
        """{key: calls} of ``op``; without ``op``, {op: {key: calls}} of every op (copies)."""
        if op is not None:
            return dict(self._calls.get(op, {}))
        return {name: dict(by_key) for name, by_key in self._calls.items()}

    def reset(self) -> None:
        self._calls.clear()
