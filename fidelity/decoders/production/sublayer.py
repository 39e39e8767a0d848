"""What every sub-layer object of the production decoder shares: its model, its layer, the op table and the GEMMs
(FP8/FP4 weights read as stored for a few rows on a GPU, dequantized to fp32 otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.registry import implementation

if TYPE_CHECKING:
    from fidelity.decoders.production.cache import LayerCache
    from fidelity.decoders.production.profiles import Profile
    from fidelity.model.config import ModelConfig

BF16 = torch.bfloat16


class Model(Protocol):
    """What a sub-layer reads of its model (``model.ProductionModel``): config, profile, device, RoPE frequencies
    and the weights in the forms its paths read."""

    cfg: ModelConfig
    profile: Profile
    device: torch.device
    freqs: dict[int, torch.Tensor]

    def w(self, name: str) -> torch.Tensor: ...
    def w_as(self, name: str, dtype: torch.dtype) -> torch.Tensor: ...
    def gemv_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def stacked_gemv_weight(self, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def rows(self, names: tuple[str, ...]) -> list[int]: ...
    def input_stack(self, i: int) -> tuple[torch.Tensor, tuple[str, ...], list[int]] | None: ...
    def stored_experts(self, i: int) -> tuple | None: ...
    def expert_stack(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class Session(Protocol):
    """What a sub-layer reads and writes of the sequence's session (``model.ProductionSession``): its caches,
    position, this call's state, its policies and its recorder."""

    model: Model
    cfg: ModelConfig
    profile: Profile
    rec: Any
    layers: list[LayerCache | None]
    pos: int
    in_prefill: bool
    made: dict[str, torch.Tensor]
    kept: list[torch.Tensor]
    key_range_end: int | None
    decode: Any
    rows: Any

    def emit(self, template: str, layer: int | None, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> None: ...


class SubLayer:
    """Layer ``i`` of ``model`` (a ``ProductionModel``): its config, profile, op lookup and GEMM helpers."""

    def __init__(self, model: Model, i: int):
        self.model, self.cfg, self.profile, self.i = model, model.cfg, model.profile, i
        self.fused = self.profile.norm_fusion == "fused"

    def op(self, name: str):
        """The registered implementation of op ``name`` for the model's device (registry.implementation), looked
        up at each call: an injected fault or a selection made since may change it."""
        return implementation(name, self.model.device)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | Fp8Input:
        """RMSNorm of a GEMM input [n, d]: bf16 y (op ``rms_norm``), or under ``norm_fusion = "fused"`` with FP8
        GEMM inputs an :class:`Fp8Input` (op ``rms_norm_act_quant``: y and its FP8 GEMM input from one kernel)."""
        if not (self.fused and self.profile.gemm_act == "fp8"):
            return self.op("rms_norm")(x, weight, self.cfg.norm_eps)
        return Fp8Input(*self.op("rms_norm_act_quant")(x, weight, self.cfg.norm_eps))

    def linear(self, x: torch.Tensor | Fp8Input, weight: str | torch.Tensor, act: str | None = None) -> torch.Tensor:
        """An FP8/FP4 GEMM (``act_linear``'s signature; ``act`` defaults to the profile's) on a weight tensor or a
        weight's name. A named FP8 weight multiplying at most ``ops.GEMV_ROWS`` rows with FP8 activations is read
        as stored (op ``fp8_weight_linear``: codes and block scales, where the model holds them; on a GPU). An
        :class:`Fp8Input` is otherwise multiplied as already quantized (``ops.quantized_linear``), a tensor through
        op ``act_linear``."""
        act = act or self.profile.gemm_act
        if isinstance(weight, str):
            stored = self.model.gemv_weight(weight) if x.shape[0] <= ops.GEMV_ROWS and act == "fp8" else None
            if stored is not None:
                return self.op("fp8_weight_linear")(x.xq if isinstance(x, Fp8Input) else x, *stored, act)
            weight = self.model.w_as(weight, torch.float32)  # FP8 / FP4 read as fp32 already; bf16 converted once
        if isinstance(x, Fp8Input):
            return ops.quantized_linear(x.xq, weight)
        return self.op("act_linear")(x, weight, act)

    def stacked_linears(self, x: torch.Tensor | Fp8Input, names: tuple[str, ...], lazy: int | None = None
                        ) -> tuple[torch.Tensor | None, ...]:
        """x @ w^T for FP8-stored weights ``names`` that read the same x [n, in] -> one [n, out_w] tensor per name. A
        few rows with FP8 activations read them as stored in one ``fp8_weight_linear`` over their stacked rows (one
        launch instead of one each; within the op's contract, the k slices may differ from a GEMV of one weight),
        the output split at each weight's row count; else one :meth:`linear` each, except that names from index
        ``lazy`` on are then left to their reader (None)."""
        act = self.profile.gemm_act
        stacked = self.model.stacked_gemv_weight(names) if x.shape[0] <= ops.GEMV_ROWS and act == "fp8" else None
        if stacked is None:
            return tuple(self.linear(x, n) if lazy is None or k < lazy else None for k, n in enumerate(names))
        y = self.op("fp8_weight_linear")(x.xq if isinstance(x, Fp8Input) else x, *stacked, act)
        return tuple(y.split(self.model.rows(names), dim=-1))

    def input_projection(self, s: Session, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor,
                         ...] | None:
        """x [n, dim], the layer's attention input, times the bf16 weights ``names`` (of ``input_weights``) -> fp32
        [n, out] each. For a few rows on the GEMV path every such weight of the layer goes through one
        ``fp32_linear`` over their stacked rows (one launch on a GPU) at the first ask of the call, the others'
        kept in the sequence's ``made`` for their readers; None where that path does not run (more rows, no GPU
        kernels, a weight not stored in bf16). ``s``: the sequence's session."""
        if x.shape[0] > ops.GEMV_ROWS:
            return None
        if names[0] not in s.made:
            stack = self.model.input_stack(self.i)
            if stack is None:
                return None
            stacked, order, rows = stack
            s.made.update(zip(order, self.op("fp32_linear")(x, stacked).split(rows, dim=-1), strict=True))
        return tuple(s.made.pop(n) for n in names)


def input_weights(i: int, ratio: int) -> tuple[str, ...]:
    """The bf16 weights of layer i that read the attention input (``SubLayer.input_projection``): the compressor's
    wkv and wgate (compressed layers), the indexer compressor's and weights_proj (CSA layers)."""
    pre = f"layers.{i}.attn."
    names = (pre + "compressor.wkv.weight", pre + "compressor.wgate.weight") if ratio else ()
    if ratio == 4:
        names += (pre + "indexer.compressor.wkv.weight", pre + "indexer.compressor.wgate.weight",
                  pre + "indexer.weights_proj.weight")
    return names
