"""Where an op resolved to a kernel ran the torch emulation instead: the registry falls back on inputs the
kernel does not take (its ``takes`` reason: other dtypes or formats, unsupported shapes) and on injected faults.
The run manifest records the counts next to ``implementations`` (which names the implementation an op resolved
to, ``triton`` even where it fell back), so a report shows exactly where the kernels did not run.

``note(op, reason)``: one call of ``op`` ran the emulation; ``counts()``: {op: {reason: calls}} since the last
``reset()``."""

from __future__ import annotations

from fidelity.decoders.production.call_counts import CallCounts

_COUNTS = CallCounts("kernel_fallbacks")
note, counts, reset = _COUNTS.note, _COUNTS.counts, _COUNTS.reset
