"""Where a registered kernel ran the torch emulation instead: its wrapper falls back on inputs the kernel does
not take (other dtypes or formats, unsupported shapes, injected faults). The run manifest records the counts
next to ``implementations`` (which names the implementation an op resolved to, ``triton`` even when its
wrapper fell back), so a report shows exactly where the kernels did not run."""

from __future__ import annotations

UNSUPPORTED = "input dtype, shape or format not supported"  # the reason for inputs a kernel does not take
_COUNTS: dict[str, dict[str, int]] = {}


def note(op: str, reason: str) -> None:
    """One call of op ``op`` ran the emulation, for ``reason``."""
    by_reason = _COUNTS.setdefault(op, {})
    by_reason[reason] = by_reason.get(reason, 0) + 1


def counts() -> dict[str, dict[str, int]]:
    """{op: {reason: calls}} since the last :func:`reset`."""
    return {op: dict(by_reason) for op, by_reason in _COUNTS.items()}


def reset() -> None:
    _COUNTS.clear()
