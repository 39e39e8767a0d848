"""GPU production kernels (Triton, Gluon): tensors in, tensors out, no knowledge of the model.

Each op's kernel (``fidelity.decoders.production.registry.OPS``) is a ``run`` with the signature of the op's CPU
emulation and a ``takes`` with the same signature returning why the kernel cannot take those inputs (None: it
can); the registry dispatches between them and the emulation. Kernel modules import torch, triton, ``_common``,
the op specs they share with the emulation (``op_spec``) and the kernel modules their allow-list in
``tests/test_layout.py`` names. Importing this package never fails: without triton the submodules are not imported
(``HAVE_TRITON`` is False). Every plain Triton kernel here is launched with programmatic dependent launch on
sm_90 (``_common.py``)."""

from __future__ import annotations

import torch

try:  # triton is optional: CPU-only installs have none
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False
else:
    HAVE_TRITON = True


def available() -> bool:
    """True when the Triton kernels can run here (triton imports and a CUDA device is visible)."""
    return HAVE_TRITON and torch.cuda.is_available()
