"""The data model of a contract: one kernel call (:class:`Case`), how an output is judged (:class:`Tolerance`,
:class:`Output`), and what a port of an op must satisfy (:class:`OpContract`); the rounding units the limits use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fidelity.model.config import ModelConfig

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
U_BF16 = 2.0**-8  # bf16 unit roundoff (8-bit significand, round to nearest even)
U_FP8 = 2.0**-4  # e4m3 unit roundoff (4-bit significand)
SLACK = 1.25  # fp32 arithmetic around the bf16 roundings (accumulation, exp, rsqrt), relative to u
FP32_REL = 2.0**-14  # fp32-output ops: fp32 roundoff 2^-24 grown by <= 2^10-term sums and 20 Sinkhorn rounds
EPS = 1e-6  # norm_eps and hc_eps of every DSv4 config
HC = 4  # hc_mult
SINKHORN_ITERS = 20
_FLASH = ModelConfig.preset("flash")



# --------------------------------------------------------------------------------------------------------------
# data model
# --------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Case:
    """One kernel call: ``fn(*args.values(), **kwargs)``; ``note`` says which edge cases the draw hit."""

    args: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def __getitem__(self, name: str) -> Any:
        return self.kwargs[name] if name in self.kwargs else self.args[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.kwargs.get(name, self.args.get(name, default))

    def describe(self) -> str:
        """``q: bf16[3, 4, 512], kv: bf16[150, 512], ..., scale=0.0442`` (+ note)."""
        parts = [f"{k}{_short(v)}" for k, v in {**self.args, **self.kwargs}.items()]
        return ", ".join(parts) + (f"  [{self.note}]" if self.note else "")

    def __repr__(self) -> str:
        return f"Case({self.describe()})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' falsifying-example printer
        p.text(repr(self))


@dataclass(frozen=True)
class Tolerance:
    """Limits for one floating output vs the expected tensor.

    cos_min / calc_diff_max: per row (last dim), fp64, over coordinates finite in both; ``None`` = unchecked.
    bound: elementwise ``|found - expected| <= bound(case)`` (fp64, the output's shape).
    why: the rounding argument the limits come from.
    """

    cos_min: float | None = None
    calc_diff_max: float | None = None
    bound: Callable[[Case], torch.Tensor] | None = None
    why: str = ""


@dataclass(frozen=True)
class Output:
    """One output of an op: its name, required dtype (``None``: any integer dtype) and how it is judged
    (``tolerance``; ``None`` = bit-exact: equal values, NaN where the reference has NaN)."""

    name: str
    dtype: torch.dtype | None
    tolerance: Tolerance | None = None


@dataclass(frozen=True)
class OpContract:
    """What a port of an op must satisfy (see the module docstring); the op's record in
    ``fidelity.decoders.production.registry.OPS`` names its contract and its default input strategy.

    expected: Case -> tuple of expected outputs (fp64 oracle for ``kind == "tolerance"``, the bit-exact
    reference's outputs for ``kind == "bitexact"``), computed on CPU.
    canonical: optional map applied to both found and expected outputs before comparing (e.g. sort top-k).
    """

    kind: str
    expected: Callable[[Case], tuple[torch.Tensor, ...]]
    outputs: tuple[Output, ...]
    why: str
    canonical: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        name = str(v.dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")
        return f": {name}{list(v.shape)}"
    if isinstance(v, ModelConfig):
        return (f"=ModelConfig(n_routed_experts={v.n_routed_experts}, n_activated_experts={v.n_activated_experts}, "
                f"route_scale={v.route_scale}, score_func={v.score_func!r})")
    if isinstance(v, float):
        return f"={v:.6g}"
    return f"={v!r}"


def _rel(r: float, why: str, cos_r: float | None = None) -> Tolerance:
    """Per-element relative error <= r  =>  calc_diff <= r^2/2 and 1 - cos <= r^2/2 for every row."""
    c = r if cos_r is None else cos_r
    return Tolerance(cos_min=1 - c * c / 2, calc_diff_max=r * r / 2, why=why)


def _at(shape: Sequence[int], flat: int) -> list[int]:
    """Coordinates of flat index ``flat`` in ``shape``."""
    coord = []
    for size in reversed(tuple(shape)):
        coord.append(flat % size)
        flat //= size
    return coord[::-1]
