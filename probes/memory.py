"""memory probe: allocated / reserved bytes per step (flat across decode = no allocator churn).

CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` (the caching allocator's own counters; host-side,
no device sync). CPU has no tensor allocator counters, so both report the process's current resident set
size from ``/proc/self/statm`` (``memory_is_rss`` = 1); where that file is missing (not Linux) both are 0
and ``memory_supported`` = 0. Values are 0-d int64 CPU tensors.
"""

from __future__ import annotations

import os

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
