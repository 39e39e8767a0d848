"""DSv4 checkpoints: canonical tensors over lazy safetensors access (spec §2; docs/design.md "Scale from the start").

A :class:`Checkpoint` maps canonical names (official inference names, e.g. ``layers.3.attn.wq_a.weight``) to
tensors.  Weights stay in their stored format (FP8/FP4 codes + ue8m0 scales, bf16, fp32) and are read from
disk and dequantized only when asked for; nothing materialises the whole model in fp32. Reading a directory:
:mod:`fidelity.model.load`; writing one: :mod:`fidelity.model.save`; what a config implies:
:mod:`fidelity.model.weights`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fidelity.model import formats
from fidelity.model.config import ModelConfig, problems_line
from fidelity.model.weights import FP4_BLOCK, FP8_BLOCK, QUANTIZED, TensorSpec, expected_tensors, fp4_shapes

MAX_LISTED = 200  # problems shown in the message; all of them stay in CheckpointError.problems

_PLAIN_FMT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64"}
_PLAIN_FMT.update({torch.int64: "int64", torch.int32: "int32"})



class CheckpointError(ValueError):
    """A checkpoint that cannot be used; ``problems`` lists every problem found (tensor, expected, found, file).
    The message is one line."""

    def __init__(self, problems: list[str], source: str = "checkpoint"):
        self.problems = list(problems)
        super().__init__(problems_line(source, self.problems, MAX_LISTED, " (see CheckpointError.problems)"))



# ---- stored tensors ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as stored: ``data`` (+ ue8m0 ``scale`` for fp8/fp4) and its format tag ``fmt``.

    fp8: data float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/128), ceil(in/128)].
    fp4: data int8/uint8/float4_e2m1fn_x2 [out, in/2] (low nibble = element 2i), scale float8_e8m0fnu [out, in/32].
    Otherwise ``fmt`` names data's dtype (bf16, fp32, fp16, fp64, int64, int32) and scale is None.
    """

    data: torch.Tensor
    fmt: str
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt in QUANTIZED and self.scale is None:
            raise ValueError(f"StoredTensor: fmt {self.fmt!r} needs a scale")
        if self.fmt not in QUANTIZED and self.fmt != _PLAIN_FMT.get(self.data.dtype):
            raise ValueError(f"StoredTensor: fmt {self.fmt!r} does not describe dtype {self.data.dtype}")

    @classmethod
    def plain(cls, data: torch.Tensor) -> StoredTensor:
        """An unquantized tensor (fmt from its dtype)."""
        return cls(data, _PLAIN_FMT[data.dtype])

    def dequantize(self) -> torch.Tensor:
        """Exact values (spec §2): fp8 codes*scale per 128x128 block, fp4 nibble*scale per 1x32 -> float32;
        unquantized data is returned unchanged."""
        if self.fmt == "fp8":
            return formats.dequantize_fp8(self.data, self.scale, FP8_BLOCK)
        if self.fmt == "fp4":
            return formats.dequantize_fp4(self.data, self.scale, FP4_BLOCK)
        return self.data


def _memory_problem(spec: TensorSpec, st: StoredTensor) -> str:
    """What is wrong with an in-memory StoredTensor for ``spec`` ("" if nothing)."""
    if spec.quantized and st.fmt == spec.fmt:
        want = fp4_shapes(spec.shape)[0] if spec.fmt == "fp4" else spec.shape
    else:
        want = spec.shape
    if tuple(st.data.shape) != tuple(want):
        return f"wrong shape for {spec.name!r} ({st.fmt}): expected {list(want)}, found {list(st.data.shape)}"
    return ""


def as_canonical(spec: TensorSpec, stored: StoredTensor) -> torch.Tensor:
    """Canonical value of a stored tensor: float32 for fp8/fp4 weights (however stored), int64 for ``tid2eid``,
    the stored dtype otherwise (bf16 stays bf16, fp32 stays fp32)."""
    x = stored.dequantize()
    if spec.quantized:
        return x.float()
    if spec.fmt == "int64":
        return x.long()
    return x


# ---- the checkpoint ----------------------------------------------------------------------------------------


class Checkpoint:
    """Canonical DSv4 tensors of one model: ``ckpt[name]`` (dequantized at use), ``ckpt.stored(name)``.

    ``config``: the ModelConfig; ``layout``: "deepseek" / "official" / "transformers" (from disk) or
    "synthetic"; ``path``: the directory (None in memory); ``ignored``: stored keys accepted but unused (MTP);
    ``origin``: how an in-memory checkpoint was made (``synthesize`` records its seed, the CLI its preset).
    """

    def __init__(
        self,
        config: ModelConfig,
        fetch: Callable[[str], StoredTensor],
        names: Iterable[str],
        *,
        layout: str,
        path: Path | None = None,
        ignored: Iterable[str] = (),
        close: Callable[[], None] | None = None,
    ):
        self.config = config
        self.layout = layout
        self.path = path
        self.ignored = list(ignored)
        self.origin: dict = {}
        self._specs = expected_tensors(config)
        self._names = [n for n in names]
        self._known = set(self._names)
        self._fetch = fetch
        self._close = close

    @classmethod
    def from_tensors(
        cls, config: ModelConfig, tensors: Mapping[str, StoredTensor], layout: str = "synthetic"
    ) -> Checkpoint:
        """An in-memory checkpoint over ``tensors`` (canonical name -> StoredTensor); names and stored shapes are
        checked against :func:`expected_tensors` (one CheckpointError listing every problem)."""
        specs = expected_tensors(config)
        problems = [f"missing tensor {n!r}" for n in specs if n not in tensors]
        problems += [f"unexpected tensor {n!r}" for n in tensors if n not in specs]
        problems += [p for n, t in tensors.items() if n in specs and (p := _memory_problem(specs[n], t))]
        if problems:
            raise CheckpointError(problems, f"in-memory {layout} checkpoint")
        store = dict(tensors)
        return cls(config, store.__getitem__, list(specs), layout=layout)

    def names(self) -> list[str]:
        """Canonical tensor names, in :func:`expected_tensors` order."""
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def spec(self, name: str) -> TensorSpec:
        """Shape and release format of canonical tensor ``name``."""
        self._check(name)
        return self._specs[name]

    def stored(self, name: str) -> StoredTensor:
        """Tensor ``name`` as stored (codes + scale for quantized weights), read now."""
        self._check(name)
        return self._fetch(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        """Canonical tensor: dequantized float32 for FP8/FP4 weights, bf16/fp32 as stored, tid2eid int64."""
        return as_canonical(self.spec(name), self.stored(name))

    def close(self) -> None:
        """Release open file handles (reading again reopens them)."""
        if self._close is not None:
            self._close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path else ""
        return f"Checkpoint(layout={self.layout!r}, tensors={len(self._names)}, n_layers={self.config.n_layers}{where})"

    def _check(self, name: str) -> None:
        if name not in self._known:
            raise KeyError(f"{name!r}: not a tensor of this checkpoint (see Checkpoint.names())")
