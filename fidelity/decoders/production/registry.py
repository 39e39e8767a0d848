"""One registry: op name -> implementations (``cpu`` emulation here; GPU kernels register under the same
names). The production model looks every op up by name, so a run can record which implementation ran."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.call_counts import CallCounts
from fidelity.decoders.production.faults import in_emulation
from fidelity.decoders.production.kernels import fallbacks

REGISTRY: dict[str, dict[str, Callable]] = {}
_selected: dict[str, str] = {}
_USED = CallCounts("implementations")  # op -> implementation -> calls (process-wide since reset_used; per session)


def register(name: str, impl: str, fn: Callable) -> None:
    REGISTRY.setdefault(name, {})[impl] = fn


def select(name: str, impl: str) -> None:
    """Force ``impl`` for op ``name`` (e.g. back to ``cpu`` emulation for one op)."""
    if name not in REGISTRY:
        raise KeyError(f"op {name!r}: expected one of {sorted(REGISTRY)}")
    if impl not in REGISTRY[name]:
        raise KeyError(f"op {name!r}: implementation {impl!r} not registered; have {sorted(REGISTRY[name])}")
    _selected[name] = impl


def deselect(name: str) -> None:
    """Undo ``select`` for op ``name``: it resolves by device again."""
    _selected.pop(name, None)


def selections() -> dict[str, str]:
    """The implementations forced with ``select``, by op."""
    return dict(_selected)


def implementation(name: str, device: torch.device | str | None = None) -> Callable:
    """The implementation of ``name`` for tensors on ``device``: an explicit ``select`` wins; on a GPU the
    registered kernel (``cpu`` emulation if none); on the CPU (or ``device=None``) the ``cpu`` emulation. While a
    fault planted in the op's emulation is injected (``faults.IN_EMULATION``), the emulation, logged in
    ``kernel_fallbacks`` as "injected fault <name>"."""
    impls = REGISTRY[name]
    on_gpu = device is not None and torch.device(device).type != "cpu"
    impl = _selected.get(name) or (next((k for k in impls if k != "cpu"), "cpu") if on_gpu else "cpu")
    fault = in_emulation(name) if impl != "cpu" else None
    if fault:
        fallbacks.note(name, f"injected fault {fault}")
        impl = "cpu"
    _USED.note(name, impl)
    return impls[impl]


def implementations_used(counts: dict[str, dict[str, int]] | None = None) -> dict[str, str]:
    """Which implementation each op resolved to: in ``counts`` (a session's ``counts["implementations"]``, what a
    run's manifest records), or process-wide since ``reset_used``; several, comma-separated, when a ``select``
    changed it in between."""
    used = _USED.counts() if counts is None else counts
    return {op: ", ".join(sorted(impls)) for op, impls in used.items()}


def reset_used() -> None:
    """Forget which implementations ran process-wide (``implementations_used()`` then counts from here)."""
    _USED.reset()


for _name, _fn in {
    "act_linear": ops.act_linear,
    "fp8_weight_linear": ops.fp8_weight_linear,
    "fp4_picked_linear": ops.fp4_picked_linear,
    "fp32_linear": ops.fp32_linear,
    "rms_norm": ops.rms_norm,
    "rms_norm_fp8": ops.rms_norm_fp8,
    "rms_norm_act_quant": ops.rms_norm_act_quant,
    "kv_norm_rope_fp8": ops.kv_norm_rope_fp8,
    "rms_norm_weightless": ops.rms_norm_weightless,
    "apply_rope": ops.apply_rope,
    "kv_round": ops.kv_round,
    "compressor_decode": ops.compressor_decode,
    "indexer_round": ops.indexer_round,
    "index_scores": ops.index_scores,
    "index_scores_fp4": ops.index_scores_fp4,
    "sparse_attention": ops.sparse_attention,
    "sparse_attention_fp8kv": ops.sparse_attention_fp8kv,
    "hc_pre": ops.hc_pre,
    "hc_post": ops.hc_post,
    "hc_head": ops.hc_head,
    "sinkhorn_split": ops.sinkhorn_split,
    "gate": ops.gate,
    "expert": ops.expert,
}.items():
    register(_name, "cpu", _fn)

# GPU kernels (Triton): registered as "triton" only when triton imports and CUDA is available. Only ops that
# already have a CPU emulation here (and so a contract in fidelity.testing.CONTRACTS) are registered.
from fidelity.decoders.production import kernels as _kernels  # noqa: E402

_kernels.register_available(register, known=set(REGISTRY))
