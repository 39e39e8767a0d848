"""Where a registered kernel ran the torch emulation instead: its wrapper falls back on inputs the kernel does
not take (other dtypes or formats, unsupported shapes, injected faults). The run manifest records the counts
next to ``implementations`` (which names the implementation an op resolved to, ``triton`` even when its
wrapper fell back), so a report shows exactly where the kernels did not run.

``note(op, reason)``: one call of ``op`` ran the emulation; ``counts()``: {op: {reason: calls}} since the last
``reset()``."""

from __future__ import annotations

from fidelity.decoders.production.call_counts import CallCounts

UNSUPPORTED = "input dtype, shape or format not supported"  # the reason for inputs a kernel does not take
_COUNTS = CallCounts("kernel_fallbacks")
note, counts, reset = _COUNTS.note, _COUNTS.counts, _COUNTS.reset
