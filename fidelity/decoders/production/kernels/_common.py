"""Helpers shared by the Triton kernels: device handling for registered ops, small torch utilities, and the
Triton device functions several kernels call (bf16 rounding, the e4m3 block quantizer, the e8m0 scale decode, the
RoPE rotation) and programmatic dependent launch (PDL, below). Kernel modules import torch, triton, this module and
the op specs they share with the CPU emulation (``fidelity.decoders.production.op_spec``). The device functions exist
where triton imports.

PDL (sm_90): a kernel launched with :data:`PDL_LAUNCH` may be scheduled while the kernel before it in the stream
is still finishing, so a decode step's chain of small launches (a CUDA graph replays them back to back) pays less
launch latency per kernel. Such a kernel must begin with :func:`wait_for_previous_kernel` (``griddepcontrol.wait``:
returns once the previous kernel has completed and its writes are visible) before it touches memory;
``tests/test_pdl_launches.py`` checks that every launch site that passes the option launches a kernel that does.
Off under the interpreter, on devices before sm_90, and with ``FIDELITY_PDL=0`` in the environment (plain stream
order, e.g. to rule it out when chasing a race)."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

try:  # triton is optional: CPU-only installs have none (the device functions below are then not defined)
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# TRITON_INTERPRET=1 runs the kernels on CPU tensors through triton's interpreter (debugging without a GPU)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
UNSUPPORTED = "input dtype, shape or format not supported"  # a kernel's ``takes`` reason for inputs it does not take
# ``takes`` reason of the KV FP8 round's kernels (kv_round, kv_norm_rope_fp8) under FlashMLA's scale rule
SCALE_FLOOR_FALLBACK = "kv_scale_floor 'scale' (FlashMLA's FP8 scale rule): the kernels round with the official one"
# How the RoPE complex product rounds (``rotated``): 0 every product rounded; 1 fma(a, c, -(b s)) / fma(a, s, b c);
# 2 fma(-b, s, a c) / fma(b, c, a s). On the H200 (torch 2.11) 1 gives torch's complex64 bits: 0 of 303K elements
# differ at Flash's shapes and frequencies, where 0 and 2 each differ in one
# (benchmarks/results/2026-12-04-layer-step-fusion/).
ROTATION = 1
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


if triton is not None:
    ENABLED = os.environ.get("FIDELITY_PDL", "1") != "0" and not INTERPRET and torch.cuda.is_available() and \
        torch.cuda.get_device_capability()[0] >= 9
    PDL_LAUNCH: dict[str, bool] = {"launch_pdl": True} if ENABLED else {}
    _WAIT = tl.constexpr(ENABLED)

    @triton.jit
    def wait_for_previous_kernel():
        """``griddepcontrol.wait`` where launches are programmatic (a no-op otherwise, and when the kernel was
        launched without the option)."""
        if _WAIT:
            gdc_wait()

    @triton.jit
    def e8m0_scale(b):
        """fp32 value of e8m0 scale bytes b (uint8, any shape) from the bits, bit for bit
        ``formats.decode_e8m0``: byte b in 1..254 is 2^(b - 127), the float with bits b << 23; byte 0 is 2^-127,
        a subnormal (bits 0x00400000); byte 255 is NaN (bits 0x7FC00000)."""
        e = b.to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def bf16_rne(x):
        """fp32 x rounded to bf16 (ties to even) and back, from the bits (the hardware cvt.rn does the same;
        Triton's CPU interpreter truncates, so the bits keep the kernels checkable there), NaN kept."""
        bits = x.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def e4m3_blocks(yf):
        """``act_quant`` (spec §3, ue8m0) of the rows of yf [NB, B] fp32, one block per row: per block
        ``amax = max(|y|, 1e-4)``, ``s = 2^(exp(v) - 127 + (mantissa(v) != 0))`` from the bits of
        ``v = amax * fp32(1/448)``, codes ``e4m3(y / s)`` (RNE; ``|y / s| <= 448`` by construction, so no clamp).
        A block holding a NaN (the NaN-propagating amax) gets NaN codes and scale byte 255, as
        ``fidelity.model.formats``.
        Returns (codes float8e4nv [NB, B], scale exponent bytes int32 [NB], s fp32 [NB])."""
        amax = tl.reduce(tl.abs(yf), 1, max_nan)
        has_nan = amax != amax
        v = tl.maximum(amax, 1e-4) * 0.002232142857142857  # fp32(1e-4), fp32(1/448) as in kernel.py
        bits = v.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        inv_s = tl.where(has_nan, float("nan"), ((127 - e) << 23).to(tl.float32, bitcast=True))  # 2^-e, exact
        codes = (yf * inv_s[:, None]).to(tl.float8e4nv)
        return codes, tl.where(has_nan, 255, e + 127), ((e + 127) << 23).to(tl.float32, bitcast=True)


    @triton.jit
    def rotated(a, b, c, s, ROTATION: tl.constexpr):
        """(a + ib)(c + is) in fp32 with the product rounding ``ROTATION`` -> (real, imag)."""
        if ROTATION == 1:
            # * -1.0: Triton's unary minus is 0 - x (+0)
            return tl.fma(a, c, (b * s) * -1.0), tl.fma(a, s, b * c)
        elif ROTATION == 2:
            return tl.fma(b * -1.0, s, a * c), tl.fma(b, c, a * s)
        else:
            return a * c - b * s, a * s + b * c
