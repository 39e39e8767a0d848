"""Which route each multi-route production op took: ``note(op, route)`` per call, ``counts(op)`` = {route: calls}
since the last ``reset()``.

Python calls are counted (a captured CUDA graph's replays are not). The runner resets the counts per run and
writes them to the manifest (``topk_routes``, ``attention_routes``), so a report shows which kernel ran.
"""

from __future__ import annotations

from fidelity.decoders.production.call_counts import CallCounts

_COUNTS = CallCounts("routes")
note, counts, reset = _COUNTS.note, _COUNTS.counts, _COUNTS.reset
