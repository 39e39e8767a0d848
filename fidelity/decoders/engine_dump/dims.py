"""How an engine's per-rank tensors join into one: SGLang's ``dims`` annotation, parsed.

The dumper's ``dims`` string names each dim of the dumped tensor, space-separated, with the parallel axis it is
sharded over in brackets: ``t h[tp] d`` (dim 1 split over the tensor-parallel ranks: concatenate), ``t h[tp:partial]``
(every rank holds a partial sum: add), a trailing ``# tp:replicated`` (every rank holds the whole tensor), fused
groups ``(h*d)[tp]`` counting as one dim, and the older spelling ``h(tp,partial)``. Only the tensor-parallel axis
(``tp``, ``attn_tp``) is joined here; a tensor sharded over another axis (context, data or pipeline parallel) is
refused with its reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TP_AXES = frozenset({"tp", "attn_tp"})
_TOKEN = re.compile(r"(?P<name>\([\w*]+\)|\w+)"
                    r"(?:\[(?P<ax>\w+)(?::(?P<mod>\w+))?\]|\((?P<old_ax>\w+)(?:,(?P<old_mod>\w+))?\))?")


class DimsError(ValueError):
    """A ``dims`` string that does not parse, or that shards over an axis this reader cannot join."""


@dataclass(frozen=True)
class Join:
    """How rank tensors become one: ``concat`` along ``dim``, ``sum`` (partial sums) or ``replicated`` (equal
    copies: rank 0's is taken, the others checked against it)."""

    kind: str
    dim: int | None = None

    def __str__(self) -> str:
        return f"concat dim {self.dim}" if self.kind == "concat" else self.kind


REPLICATED = Join("replicated")


def parse_dims(text: str) -> Join:
    """``dims`` -> its Join over the tensor-parallel ranks (``replicated`` where no dim is split over them)."""
    body, _, declared = text.partition("#")
    join = REPLICATED
    for k, token in enumerate(body.split()):
        m = _TOKEN.fullmatch(token)
        if m is None:
            raise DimsError(f"dims {text!r}: token {token!r} is not a dim name, name[axis], name[axis:partial] or "
                            "name(axis,partial)")
        axis, mod = m["ax"] or m["old_ax"], m["mod"] or m["old_mod"]
        if axis is None:
            continue
        if axis not in TP_AXES:
            axes = ", ".join(sorted(TP_AXES))
            raise DimsError(f"dims {text!r}: dim {k} is split over {axis!r}; only tensor-parallel shards ({axes}) are "
                            "joined (dump with that axis gathered)")
        if mod not in (None, "partial"):
            raise DimsError(f"dims {text!r}: dim {k}: modifier {mod!r} (expected none or 'partial')")
        if join != REPLICATED:
            raise DimsError(f"dims {text!r}: more than one dim split over the tensor-parallel ranks")
        join = Join("sum") if mod == "partial" else Join("concat", k)
    for decl in declared.split():
        axis, _, what = decl.partition(":")
        if axis in TP_AXES and what not in ("replicated", "") and not what.startswith("="):
            raise DimsError(f"dims {text!r}: declaration {decl!r} (expected {axis}:replicated)")
        if axis in TP_AXES and what == "replicated" and join != REPLICATED:
            raise DimsError(f"dims {text!r}: declared replicated over {axis} and split over it")
    return join
