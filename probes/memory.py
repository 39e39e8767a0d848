"""memory probe: allocated / reserved bytes per step (flat across decode = no allocator churn), and the allocator
probe of one decoder call.

Process level (``memory_stats``): CUDA ``torch.cuda.memory_allocated`` / ``memory_reserved`` (the caching
allocator's own counters; host-side, no device sync). CPU has no tensor allocator counters, so both report the
process's current resident set size from ``/proc/self/statm`` (``memory_is_rss`` = 1); where that file is
missing (not Linux) both are 0 and ``memory_supported`` = 0. Values are 0-d int64 CPU tensors.

Decoder level: ``allocator_counts`` before and after the decoder's call, less the outputs it handed over
(``handed_bytes``), give what the call kept and how many allocator / ``cudaMalloc`` calls it made
(``allocator_delta``); ``held_bytes`` walks the decoder object for the tensor bytes it holds.
"""

from __future__ import annotations

import ctypes
import gc
import os
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch


def _rss_bytes() -> int | None:
    """Current resident set size of this process in bytes, None if /proc is unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_stats(device: torch.device | str) -> dict[str, torch.Tensor]:
    """device -> allocated_bytes, reserved_bytes, memory_supported (0/1), memory_is_rss (0/1)."""
    device = torch.device(device)
    if device.type == "cuda":
        values = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), 1, 0)
    else:
        rss = _rss_bytes()
        values = (rss or 0, rss or 0, int(rss is not None), int(rss is not None))
    names = ("allocated_bytes", "reserved_bytes", "memory_supported", "memory_is_rss")
    return {k: torch.tensor(v, dtype=torch.int64) for k, v in zip(names, values, strict=True)}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use_fn():
    """glibc's ``mallinfo2`` (2.33+) as a function returning the bytes malloc has handed out and not taken back
    (heap chunks in use + mmapped chunks), or None where it is missing."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return lambda: (lambda m: m.uordblks + m.hblkhd)(fn())


_MALLOC_IN_USE = _malloc_in_use_fn()
# Decode calls before the allocator gates apply: a decoder's first decode steps may size its workspaces (and graph
# decode captures its graph), after which a preallocated step makes no new device allocation.
WARMUP_DECODE_CALLS = 2
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block request up to a multiple of this


def allocator_counts(device: torch.device | str) -> dict[str, int]:
    """A snapshot of the memory counters one decoder call is measured by (:func:`allocator_delta`).

    CUDA (the caching allocator's host-side counters, no device sync): ``allocated`` and ``reserved`` bytes,
    cumulative ``alloc_calls`` / ``free_calls`` (block requests and releases) and ``device_mallocs``
    (``cudaMalloc`` or expandable-segment map calls: ``num_device_alloc``, else the segment count). CPU:
    ``host_allocated`` is the bytes glibc's malloc has in use (``mallinfo2``: torch's CPU tensors live there, and
    so do the CPU kernels' own caches), absent where that call is missing; there are no call counters.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {} if _MALLOC_IN_USE is None else {"host_allocated": _MALLOC_IN_USE()}
    stats = torch.cuda.memory_stats(device)
    return {"allocated": stats.get("allocated_bytes.all.current", 0),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "alloc_calls": stats.get("allocation.all.allocated", 0), "free_calls": stats.get("allocation.all.freed", 0),
            "device_mallocs": stats.get("num_device_alloc", stats.get("segment.all.allocated", 0))}


def handed_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (a call's outputs: logits, recorded copies), each rounded as
    the CUDA caching allocator rounds a block on CUDA."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        n = storage.nbytes()
        total += -(-n // CUDA_BLOCK) * CUDA_BLOCK if t.is_cuda else n
    return total


def measured_call(fn: Callable[[], torch.Tensor], device: torch.device | str) -> tuple[torch.Tensor, dict[str, int]]:
    """``fn()`` and its :func:`allocator_delta`, the snapshots taken right around the call (so that what the
    caller frees when it rebinds its variables falls outside)."""
    with collector_paused():
        before = allocator_counts(device)
        out = fn()
        after = allocator_counts(device)
    return out, allocator_delta(before, after, handed_bytes([out]))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: the decoder call's allocator counts then see what the
    call did, not tensors of earlier garbage (another test's, the run's own) collected while it ran."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def allocator_delta(before: dict[str, int], after: dict[str, int], handed: int) -> dict[str, int]:
    """What one call did between two :func:`allocator_counts` snapshots, given the bytes of the outputs it
    handed over (:func:`handed_bytes`): ``retained_delta`` (CUDA bytes it allocated and still holds beyond
    those outputs: zero for a decoder that works in preallocated memory), ``reserved_delta`` and the number of
    ``alloc_calls``, ``free_calls`` and ``device_mallocs`` (CUDA); on the CPU ``host_retained_delta``, the same
    from malloc's bytes in use, which also counts the CPU kernels' caches (oneDNN keeps ~0.5 MiB per new bf16
    matmul shape)."""
    out = {}
    for key, name in (("allocated", "retained_delta"), ("host_allocated", "host_retained_delta")):
        if key in after:
            out[name] = after[key] - before[key] - handed
    if "reserved" in after:
        out["reserved_delta"] = after["reserved"] - before["reserved"]
    out.update({k: after[k] - before[k] for k in ("alloc_calls", "free_calls", "device_mallocs") if k in after})
    return out


_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, type, types.ModuleType,
          types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def held_bytes(root: object, exclude: Iterable[object] = (), limit: int = 1_000_000) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through attributes, ``__slots__``, lists,
    tuples, sets and dict values, not through ``exclude`` (at most ``limit`` objects visited): what a decoder
    keeps between calls, its caches, weights and anything it has stashed, wherever the allocator placed them."""
    seen_obj, seen_storage, total, stack = {id(x) for x in exclude}, set(), 0, [root]
    while stack and len(seen_obj) < limit:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (obj.device, storage.data_ptr())
            if key not in seen_storage:
                seen_storage.add(key)
                total += storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s))
    return total


class PeakMemory:
    """Peak memory per phase of a run: ``read()`` returns the peaks since construction or the previous read.

    Host: the process's peak resident set (``ru_maxrss``; it never decreases, so a phase reads the peak so far).
    CUDA: the caching allocator's peak allocated and reserved bytes on ``device``, reset after each read.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._reset()

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        out = {"host_rss_peak_bytes": _peak_rss_bytes()}
        if self.device.type == "cuda":
            out["gpu_allocated_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved(self.device)
        self._reset()
        return out


def _peak_rss_bytes() -> int:
    """The process's peak resident set in bytes (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
