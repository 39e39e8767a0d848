"""The one op table (:data:`OPS`: op name -> :class:`Op`) and the one dispatcher.

Each op has its CPU emulation (``ops``), its GPU kernel (``kernels/``; None for an op without one of its own) and
its contract and input strategy (``fidelity.testing``). :data:`REGISTRY` holds the implementations a run
may resolve an op to: ``cpu`` (the emulation) and, where triton imports and CUDA is available, ``triton`` (the
kernel behind :func:`dispatch`). The production model looks every op up by name, so a run records which
implementation ran."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType

import torch

from fidelity.decoders.production import fallbacks, kernels, ops, routes
from fidelity.decoders.production.call_counts import CallCounts
from fidelity.decoders.production.faults import in_emulation


@dataclass(frozen=True)
class Kernel:
    """An op's GPU kernel: functions of ``kernels/<module>.py``. ``run`` has the emulation's signature; ``takes``
    the same, returning why the kernel cannot take those inputs (None: it can); ``route`` (optional) the same,
    naming the kernel route ``run`` takes (counted in ``routes``)."""

    module: str
    run: str
    takes: str
    route: str | None = None


@dataclass(frozen=True)
class Op:
    """One production op: emulation, kernel (None: the op has no kernel of its own), contract and strategy
    (attribute names in ``fidelity.testing.contracts`` and ``fidelity.testing.strategies``, which need hypothesis:
    production does not import them; ``fidelity.testing`` resolves them through this table)."""

    emulation: Callable
    kernel: Kernel | None
    contract: str
    strategy: str


def _op(name: str, module: str | None, run: str | None = None, *, route: bool = False,
        strategy: str | None = None) -> Op:
    """The record of op ``name``: emulation ``ops.<name>``, kernel ``kernels/<module>.py`` (``run``,
    ``takes_<name>``, ``route_<name>`` when ``route``; none when ``module`` is None), contract ``<name>``, strategy
    ``<name>_inputs``."""
    kernel = Kernel(module, run, f"takes_{name}", f"route_{name}" if route else None) if module else None
    return Op(getattr(ops, name), kernel, name, strategy or f"{name}_inputs")


OPS: dict[str, Op] = {
    "act_linear": _op("act_linear", "act_quant", "act_linear_cuda"),
    "fp8_weight_linear": _op("fp8_weight_linear", "weight_gemv", "fp8_weight_linear_cuda"),
    "fp4_picked_linear": _op("fp4_picked_linear", "weight_gemv", "fp4_picked_linear_cuda"),
    "fp32_linear": _op("fp32_linear", "weight_gemv", "fp32_linear_cuda"),
    "rms_norm": _op("rms_norm", "rms_norm", "rms_norm_cuda"),
    "rms_norm_fp8": _op("rms_norm_fp8", "rms_norm", "rms_norm_fp8_cuda"),
    "rms_norm_act_quant": _op("rms_norm_act_quant", "rms_norm", "rms_norm_act_quant_cuda",
                              strategy="rms_norm_fp8_inputs"),
    "kv_norm_rope_fp8": _op("kv_norm_rope_fp8", "kv_path", "kv_norm_rope_fp8"),
    "rms_norm_weightless": _op("rms_norm_weightless", "rms_norm", "rms_norm_weightless_cuda"),
    "apply_rope": _op("apply_rope", "rope", "apply_rope_cuda"),
    "kv_round": _op("kv_round", "act_quant", "kv_round_cuda"),
    "compressor_decode": _op("compressor_decode", "compressor", "compressor_decode_cuda"),
    "indexer_round": _op("indexer_round", "indexer_round", "indexer_round_cuda"),
    "index_scores": _op("index_scores", "indexer", "index_scores_cuda"),
    "index_scores_fp4": _op("index_scores_fp4", "indexer", "index_scores_packed_cuda", route=True),
    "sparse_attention": _op("sparse_attention", "sparse_attention", "sparse_attention_cuda", route=True),
    "sparse_attention_fp8kv": _op("sparse_attention_fp8kv", "sparse_attention", "sparse_attention_fp8kv_cuda",
                                  route=True),
    "hc_pre": _op("hc_pre", "mhc", "hc_pre_cuda"),
    "hc_post": _op("hc_post", "mhc", "hc_post_cuda"),
    "hc_head": _op("hc_head", "mhc", "hc_head_cuda"),
    "gate": _op("gate", "gate", "gate_cuda"),
    "expert": _op("expert", "expert", "expert_cuda"),
    "grouped_expert": _op("grouped_expert", "grouped_expert", "grouped_expert_cuda"),
    "sinkhorn_split": _op("sinkhorn_split", None),  # an emulation and a contract, no kernel of its own
    # graph decode's plumbing: copies, slots and selections addressed by device-side indices
    "take": _op("take", "take", "take"),
    "put_at_block_end": _op("put_at_block_end", "take", "put_at_block_end"),
    "decode_slots": _op("decode_slots", "decode_slots", "decode_slots_cuda"),
    "decode_idx": _op("decode_idx", "decode_slots", "decode_idx_cuda"),
    "mask_past": _op("mask_past", "decode_slots", "mask_past_cuda"),
    "radix_topk": _op("radix_topk", "radix_topk", "radix_topk"),
    "moe_sum": _op("moe_sum", "moe_sum", "moe_sum"),
}

REGISTRY: dict[str, dict[str, Callable]] = {}
_SELECTED: ContextVar[Mapping[str, str]] = ContextVar("forced_implementations", default=MappingProxyType({}))
_USED = CallCounts("implementations")  # op -> implementation -> calls (process-wide since reset_used; per session)


def kernel_functions(name: str) -> tuple[Callable, Callable, Callable | None]:
    """(run, takes, route or None) of op ``name``'s kernel (imports its module; needs triton)."""
    k = OPS[name].kernel
    if k is None:
        raise KeyError(f"op {name!r} has no kernel of its own")
    module = importlib.import_module(f"{kernels.__name__}.{k.module}")
    return getattr(module, k.run), getattr(module, k.takes), getattr(module, k.route) if k.route else None


def dispatch(name: str) -> Callable:
    """Op ``name``'s kernel behind its ``takes``: inputs it takes run the kernel (its route counted in ``routes``),
    others the emulation (the reason counted in ``fallbacks``). Accepts tensors on any device (CPU inputs run on the
    current CUDA device, the results copied back)."""
    from fidelity.decoders.production.kernels._common import device_transparent

    run, takes, route = kernel_functions(name)
    emulation = OPS[name].emulation

    def kernel(*args, **kwargs):
        reason = takes(*args, **kwargs)
        if reason:
            fallbacks.note(name, reason)
            return emulation(*args, **kwargs)
        if route is not None:
            routes.note(name, route(*args, **kwargs))
        return run(*args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = f"triton_{name}"
    return device_transparent(kernel)


def register(name: str, impl: str, fn: Callable) -> None:
    REGISTRY.setdefault(name, {})[impl] = fn


@contextmanager
def forcing(choices: Mapping[str, str]) -> Iterator[None]:
    """Force implementation ``impl`` for each op ``name`` of ``choices`` (e.g. ``{"sparse_attention": "cpu"}``: back
    to the emulation for one op) for the duration of the block, in this context only (a ``ContextVar``: another
    thread's decoder keeps its own); a block inside adds to and overrides these. KeyError naming an unknown op or
    implementation."""
    for name, impl in choices.items():
        if name not in REGISTRY:
            raise KeyError(f"op {name!r}: expected one of {sorted(REGISTRY)}")
        if impl not in REGISTRY[name]:
            raise KeyError(f"op {name!r}: implementation {impl!r} not registered; have {sorted(REGISTRY[name])}")
    token = _SELECTED.set(MappingProxyType({**_SELECTED.get(), **choices}))
    try:
        yield
    finally:
        _SELECTED.reset(token)


def selections() -> dict[str, str]:
    """The implementations forced (``forcing``) in this context, by op."""
    return dict(_SELECTED.get())


def implementation(name: str, device: torch.device | str | None = None) -> Callable:
    """The implementation of ``name`` for tensors on ``device``: one forced (``forcing``) wins; on a GPU the
    registered kernel (``cpu`` emulation if none); on the CPU (or ``device=None``) the ``cpu`` emulation. While a
    fault planted in the op's emulation is injected (``faults.IN_EMULATION``), the emulation, logged in
    ``kernel_fallbacks`` as "injected fault <name>"."""
    impls = REGISTRY[name]
    on_gpu = device is not None and torch.device(device).type != "cpu"
    impl = _SELECTED.get().get(name) or (next((k for k in impls if k != "cpu"), "cpu") if on_gpu else "cpu")
    fault = in_emulation(name) if impl != "cpu" else None
    if fault:
        fallbacks.note(name, f"injected fault {fault}")
        impl = "cpu"
    _USED.note(name, impl)
    return impls[impl]


def implementations_used(counts: dict[str, dict[str, int]] | None = None) -> dict[str, str]:
    """Which implementation each op resolved to: in ``counts`` (a session's ``counts["implementations"]``, what a
    run's manifest records), or process-wide since ``reset_used``; several, comma-separated, when ``forcing``
    changed it in between."""
    used = _USED.counts() if counts is None else counts
    return {op: ", ".join(sorted(impls)) for op, impls in used.items()}


def reset_used() -> None:
    """Forget which implementations ran process-wide (``implementations_used()`` then counts from here)."""
    _USED.reset()


for _name, _op_record in OPS.items():
    register(_name, "cpu", _op_record.emulation)
if kernels.available():
    for _name, _op_record in OPS.items():
        if _op_record.kernel is not None:
            register(_name, "triton", dispatch(_name))
