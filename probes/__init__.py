"""Probes: small functions from site tensors to metrics (docs/design.md "Probes").

Every probe takes torch tensors (reference = oracle, test = production), computes on their device without
reading values back, and returns ``dict[str, torch.Tensor]`` of 0-d (or [n] per position) metrics.
``probes.rows`` turns them into tidy rows with one device-to-host transfer per step.
"""

from probes.indexer import indexer_recall
from probes.kv_cache import kv_storage
from probes.memory import PeakMemory, memory_stats
from probes.mhc import gate_range, sinkhorn, sinkhorn_batch
from probes.residual import residual_norms
from probes.routing import routing_agreement
from probes.rows import PairRows, collect, collect_columns, to_rows
from probes.similarity import similarity, similarity_batch, similarity_per_position, unravel
from probes.tokens import token_agreement
from probes.visible import expected_visible, visible_range

__all__ = [
    "PairRows",
    "PeakMemory",
    "collect",
    "collect_columns",
    "expected_visible",
    "gate_range",
    "indexer_recall",
    "kv_storage",
    "memory_stats",
    "residual_norms",
    "routing_agreement",
    "similarity",
    "similarity_batch",
    "similarity_per_position",
    "sinkhorn",
    "sinkhorn_batch",
    "to_rows",
    "token_agreement",
    "unravel",
    "visible_range",
]
