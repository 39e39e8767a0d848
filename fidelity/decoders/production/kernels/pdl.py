"""Programmatic dependent launch (sm_90): a kernel launched with :data:`PDL_LAUNCH` may be scheduled while the
kernel before it in the stream is still finishing, so a decode step's chain of small launches (a CUDA graph
replays them back to back) pays less launch latency per kernel. Such a kernel must begin with
:func:`wait_for_previous_kernel` (``griddepcontrol.wait``: returns once the previous kernel has completed and its
writes are visible) before it touches memory; ``tests/test_pdl_launches.py`` checks that every launch site that
passes the option launches a kernel that does. Off under the interpreter, on devices before sm_90, and with
``FIDELITY_PDL=0`` in the environment (plain stream order, e.g. to rule it out when chasing a race)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from fidelity.decoders.production.kernels._common import INTERPRET

ENABLED = os.environ.get("FIDELITY_PDL", "1") != "0" and not INTERPRET and torch.cuda.is_available() and \
    torch.cuda.get_device_capability()[0] >= 9
PDL_LAUNCH: dict[str, bool] = {"launch_pdl": True} if ENABLED else {}
_WAIT = tl.constexpr(ENABLED)


@triton.jit
def wait_for_previous_kernel():
    """``griddepcontrol.wait`` where launches are programmatic (a no-op otherwise, and when the kernel was launched
    without the option)."""
    if _WAIT:
        gdc_wait()
