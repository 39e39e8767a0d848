"""Which route each multi-route production op took: ``{op: {route: calls}}`` since the last :func:`reset`.

Python calls are counted (a captured CUDA graph's replays are not). The runner resets the counts per run and
writes them to the manifest (``topk_routes``, ``attention_routes``), so a report shows which kernel ran.
"""

from __future__ import annotations

_CALLS: dict[str, dict[str, int]] = {}


def note(op: str, route: str) -> None:
    """One call of ``op`` took ``route``."""
    by_route = _CALLS.setdefault(op, {})
    by_route[route] = by_route.get(route, 0) + 1


def counts(op: str) -> dict[str, int]:
    """{route: calls} of ``op`` since the last :func:`reset`."""
    return dict(_CALLS.get(op, {}))


def reset() -> None:
    _CALLS.clear()
