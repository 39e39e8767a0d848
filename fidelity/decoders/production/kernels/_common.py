"""Helpers shared by the Triton kernels: device handling for registered ops, small torch utilities."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

# TRITON_INTERPRET=1 runs the kernels on CPU tensors through triton's interpreter (debugging without a GPU)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GLUON_VERSION = "3.6."  # the Gluon API of the warp-specialized kernels (warp_specialize's signature changed after 3.6)


def hopper_gluon_refusal(device: torch.device) -> str | None:
    """Why a warp-specialized Gluon kernel (``*_ws.py``) cannot run on ``device`` (None: it can): it needs
    Triton 3.6's Gluon API and a device of compute capability 9.0 (wgmma)."""
    import triton

    if not triton.__version__.startswith(GLUON_VERSION):
        return f"written for the Gluon API of Triton {GLUON_VERSION}, found Triton {triton.__version__}"
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        return f"needs an sm_90 device (wgmma), found compute capability {cc[0]}.{cc[1]}"
    return None


def on_device(t: torch.Tensor) -> bool:
    """True when the kernels can take ``t`` as is: a CUDA tensor (any tensor under the interpreter)."""
    return t.is_cuda or INTERPRET


def _move(v, device):
    return v.to(device) if isinstance(v, torch.Tensor) else v


def device_transparent(fn: Callable) -> Callable:
    """Wrap a CUDA-only implementation so that it accepts tensors on any device.

    Tensor arguments not on CUDA are copied to the current CUDA device, and tensor results are copied back to
    the device of the first tensor argument. The registry's contract tests (``tests/test_registry.py``) call
    every registered implementation with CPU tensors; the production model may do so too.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or on_device(first):
            return fn(*args, **kwargs)
        dev = torch.device("cuda")
        out = fn(*(_move(a, dev) for a in args), **{k: _move(v, dev) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return tuple(_move(o, first.device) for o in out)
        return _move(out, first.device)

    return wrapper


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def with_overrides(defaults: dict, overrides: dict | None) -> dict:
    """Launch parameters: ``defaults`` updated with the entries of ``overrides`` that are not None."""
    return {**defaults, **{k: v for k, v in (overrides or {}).items() if v is not None}}


def ws_refusal(module: str, *inputs) -> str | None:
    """Why the warp-specialized kernel of ``fidelity/decoders/production/kernels/<module>.py`` cannot take
    ``inputs`` (None: it can): that module's ``takes``, or that it does not import (a Triton without Gluon's
    Hopper API)."""
    try:
        kernel = importlib.import_module(f"fidelity.decoders.production.kernels.{module}")
    except ImportError as exc:
        return f"Gluon unavailable ({exc})"
    return kernel.takes(*inputs)
