"""Sparse decode attention on the 584 B/token FP8 KV layout in CUDA C++ (``cuda/sparse_attention_pair.cu``): route
``cuda`` of ``sparse_attention_fp8kv`` on sm_90a.

Clusters of two CTAs per (token, head group): each CTA dequantizes half of every 64-row block (32 rows) and writes
the bf16 rows into its own shared memory and its peer's (distributed shared memory, mbarrier arrivals across the
pair), so a token's rows are dequantized once, not once per CTA. With a multiple of 128 heads the two CTAs take 64
heads each; with 64 heads a group they take the same heads and 256 output dims each. Two math warpgroups per CTA
(wgmma: ``S = Q K^T`` split over the dims and summed through shared memory, ``O += P V`` with P from registers)
and one producer warpgroup (8-byte ``cp.async`` of the raw rows one block ahead, dequantization, local and remote
stores). The rows dequantize exactly to ``kv_layout.unpack``'s; the logits are the sum of two fp32 wgmma chains
over 256 dims each, so outputs meet ``sparse_attention``'s contract but are not bit-equal to the ``ws`` kernel's.

The extension is built with ``torch.utils.cpp_extension.load`` on first use (nvcc, ``sm_90a``) and cached in
torch's extension folder (``TORCH_EXTENSIONS_DIR``); :func:`refusal` says why it cannot run (no CUDA device, not
sm_90, no nvcc, a failed build).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("cuda") / f"sparse_attention_pair.{ext}" for ext in ("cpp", "cu"))
EXTENSION = "fidelity_sparse_attention_pair"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a")
ROW_BYTES = 584
HEAD_DIM = 512
# ``parts`` bits (the kernel's PART_*): the producers' row copies, the math warpgroups' MMAs and softmax, the
# producers' dequantization and stores; fewer than all only for the diagnosis (wrong results by design)
LOADS, MATH, DEQUANT = 1, 2, 4
ALL_PARTS = LOADS | MATH | DEQUANT


def toolchain_refusal() -> str | None:
    """Why the extension cannot be built on this machine (None: it can): torch without CUDA, or no nvcc."""
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    if not (nvcc and nvcc.exists()) and shutil.which("nvcc") is None:
        return "no nvcc (CUDA_HOME unset and none on PATH)"
    return None


def device_refusal(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can): it needs a CUDA device of compute capability 9.0."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA device"
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        return f"needs an sm_90 device (clusters, wgmma), found compute capability {cc[0]}.{cc[1]}"
    return None


@functools.cache
def _extension() -> tuple[object | None, str | None]:
    """(the built module, None) or (None, why the build failed); built once per process, cached on disk."""
    from torch.utils.cpp_extension import load

    try:
        module = load(name=EXTENSION, sources=[str(s) for s in SOURCES], extra_cuda_cflags=list(NVCC_FLAGS),
                      extra_cflags=["-O3"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - a failed build is a refusal, reported as such
        return None, f"build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    return module, None


def refusal(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> str | None:
    """Why :func:`sparse_attention_pair` cannot take these inputs (None: it can): bf16 q [n, H, 512] with H a
    multiple of 64, the uint8 [m, 584] cache, 2-D idx, on an sm_90 device, with the extension built (building it
    here on first use)."""
    if not (q.dim() == 3 and kv.dim() == 2 and idx.dim() == 2 and q.is_cuda):
        return "needs CUDA tensors q [n, H, d], kv [m, 584], idx [n, K]"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.uint8 or kv.shape[1] != ROW_BYTES:
        return f"needs bf16 q and a uint8 [m, {ROW_BYTES}] cache, found {q.dtype} and {kv.dtype} {list(kv.shape)}"
    if q.shape[-1] != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, found {q.shape[-1]}"
    if q.shape[1] % 64:
        return f"needs a head count that is a multiple of 64, found {q.shape[1]}"
    why = device_refusal(q.device) or toolchain_refusal()
    return why or _extension()[1]


def sparse_attention_pair(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                          scale: float, *, parts: int = ALL_PARTS) -> torch.Tensor:
    """q [n, H, 512] bf16, kv uint8 [m, 584] (the FP8 layout), idx [n, K] int (-1 = masked), sink [H] fp32 ->
    o [n, H, 512] bf16 (inputs as :func:`refusal` accepts them). ``parts`` other than :data:`ALL_PARTS` is for
    the diagnosis only (wrong results)."""
    module, error = _extension()
    if module is None:
        raise RuntimeError(f"sparse_attention_pair: {error}")
    aligned = q.stride(-1) == 1 and q.stride(1) % 8 == 0 and q.stride(0) % 8 == 0 and q.data_ptr() % 16 == 0
    q = q if aligned else q.contiguous()
    return module.forward(q, kv.contiguous(), idx.to(torch.int32).contiguous(), sink.to(torch.float32).contiguous(),
                          float(scale), int(parts))
