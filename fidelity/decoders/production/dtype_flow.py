"""Dtype flow of the production decoder: every place a value is narrowed to a smaller float format and the very
next use of the narrowed tensor widens it again, listed per probe site.

A ``TorchDispatchMode`` sees every aten op of one prefill and one decode step. A cast (``aten._to_copy``) to a
float dtype with fewer bits than its input's is a *narrowing*; when the first op that reads the narrowed tensor
(through views) is a cast back to a wider float dtype, the pair is a *round trip*: the value was rounded, never
used narrow. That is how the reference rounds on purpose (a bf16 GEMM output read back into fp32 by the next
RMSNorm), and also how a port loses precision by accident (an fp32 intermediate stored bf16 between two fp32
ops). Each round trip is assigned to the site the model emits next (its probe sites mark where each op's output
is complete), so the table reads in data-flow order. FP8/FP4 rounding is emulated on fp32 grids
(``fidelity.model.formats``), without a dtype change, so it does not appear.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fidelity.decoders.production.model import ProductionModel
from fidelity.model.sites import Recorder

_TO_COPY = torch.ops.aten._to_copy.default
AFTER_LAST = "(after the last site)"


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else 0


@dataclass
class RoundTrip:
    phase: str  # prefill or decode
    site: str
    path: tuple[torch.dtype, torch.dtype, torch.dtype]  # source -> narrow -> widened


@dataclass
class DtypeFlow(TorchDispatchMode):
    """Collects round trips; ``mark(site)`` assigns those seen since the previous mark to ``site``."""

    phase: str = "prefill"
    trips: list[RoundTrip] = field(default_factory=list)
    _open: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = field(default_factory=list)
    _narrow: dict[int, tuple[weakref.ref, torch.dtype]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def mark(self, site: str) -> None:
        self.trips += [RoundTrip(self.phase, site, p) for p in self._open]
        self._open = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        for t in inputs:
            seen = self._narrow.pop(id(t), None)
            if seen is None or seen[0]() is not t:
                continue
            if func.is_view and isinstance(out, torch.Tensor):  # a view of the narrowed value: follow it
                self._narrow[id(out)] = (weakref.ref(out), seen[1])
            elif func is _TO_COPY and _bits(out.dtype) > _bits(t.dtype):
                self._open.append((seen[1], t.dtype, out.dtype))
        if func is _TO_COPY and inputs and 0 < _bits(out.dtype) < _bits(inputs[0].dtype):
            self._narrow[id(out)] = (weakref.ref(out), inputs[0].dtype)
        return out


class _SiteMarks(Recorder):
    """A recorder that records nothing: asked whether it wants a site, it marks the site in the flow."""

    def __init__(self, flow: DtypeFlow):
        super().__init__(patterns=())
        self.flow = flow

    def wants(self, site: str) -> bool:
        self.flow.mark(site)
        return False


def dtype_flow(model: ProductionModel, prompt: torch.Tensor) -> list[RoundTrip]:
    """Round trips of ``model``'s production session over a prefill of ``prompt`` [T] and one decode step."""
    flow = DtypeFlow()
    session = model.session(_SiteMarks(flow))
    with flow:
        logits = session.prefill(prompt)
        flow.mark(AFTER_LAST)
        flow.phase = "decode"
        session.step(int(logits[-1].argmax()))
        flow.mark(AFTER_LAST)
    return flow.trips


def flow_table(trips: list[RoundTrip]) -> list[dict]:
    """One row per (site, path): round trips in the prefill and in the decode step, in first-seen order."""
    counts = Counter((t.site, t.path, t.phase) for t in trips)
    keys = list(dict.fromkeys((t.site, t.path) for t in trips))
    name = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return [{"site": site, "round trip": " -> ".join(name.get(d, str(d).removeprefix("torch.")) for d in path),
             "prefill": counts[(site, path, "prefill")], "decode step": counts[(site, path, "decode")]}
            for site, path in keys]
