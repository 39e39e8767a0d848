"""Probes: small functions from site tensors to metrics (docs/design.md "Probes").

Every probe takes torch tensors (reference = oracle, test = production), computes on their device without
reading values back, and returns ``dict[str, torch.Tensor]`` of 0-d (or [n] per position) metrics.
``probes.rows`` turns them into tidy rows with one device-to-host transfer per step.
"""

from collections.abc import Callable

import torch

from probes.indexer import indexer_recall
from probes.memory import PeakMemory, memory_stats
from probes.mhc import sinkhorn
from probes.residual import residual_norms, rms_growth
from probes.routing import routing_agreement
from probes.rows import collect, to_rows
from probes.similarity import similarity, similarity_per_position, unravel
from probes.tokens import token_agreement
from probes.visible import expected_visible, visible_range

PROBES: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "similarity": similarity,
    "similarity_per_position": similarity_per_position,
    "sinkhorn": sinkhorn,
    "residual_norms": residual_norms,
    "indexer_recall": indexer_recall,
    "visible_range": visible_range,
    "memory_stats": memory_stats,
    "token_agreement": token_agreement,
}

__all__ = [
    "PROBES",
    "PeakMemory",
    "collect",
    "expected_visible",
    "indexer_recall",
    "memory_stats",
    "residual_norms",
    "rms_growth",
    "routing_agreement",
    "similarity",
    "similarity_per_position",
    "sinkhorn",
    "to_rows",
    "token_agreement",
    "unravel",
    "visible_range",
]
