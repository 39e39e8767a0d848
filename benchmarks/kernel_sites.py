"""Which Python line launched each GPU kernel: a ``torch.profiler`` trace (``with_stack=True``) read back, each kernel
joined to its launch call (the ``correlation`` id), each launch to the Python frames open around it.

torch's event tree does not link kernels that Triton launches through ``cuLaunchKernelEx`` to the enclosing
``record_function`` ranges; the trace's launch records and Python frames do, by their host timestamps, so this
attributes every kernel, torch's and Triton's alike.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def load_trace(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a chrome trace written by ``prof.export_chrome_trace``."""
    return json.loads(Path(path).read_text())["traceEvents"]


def _frame(name: str) -> str:
    """``/abs/path/fidelity/x/model.py(245): attention`` -> ``model.py:attention``."""
    where, _, func = name.partition(": ")
    return f"{where.rsplit('/', 1)[-1].split('(')[0]}:{func}"


def _stacks_at(frames: list[dict], times: list[float], within: str) -> list[list[str]]:
    """For each of ``times`` (sorted), the frames of ``frames`` open then whose file path contains ``within``,
    outermost first. One thread's frames nest, so one sweep with a stack finds them all."""
    frames = sorted(frames, key=lambda f: (f["ts"], -f["dur"]))
    stack: list[dict] = []
    out, i = [], 0
    for t in times:
        while i < len(frames) and frames[i]["ts"] <= t:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < frames[i]["ts"]:
                stack.pop()
            stack.append(frames[i])
            i += 1
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
            stack.pop()
        out.append([_frame(f["name"]) for f in stack if within in f["name"]])
    return out


def attributed(events: list[dict], within: str = "fidelity/", cat: str = "kernel") -> list[dict]:
    """Every ``cat`` event (default: GPU kernels) in start order as ``{"name", "us", "ts", "frames"}``, where
    ``frames`` are the Python frames under ``within`` open when it was launched (for host events: when it ran),
    outermost first. A kernel whose launch record is missing gets no frames."""
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            by_tid[e.get("tid")].append(e)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    targets = sorted((e for e in events if e.get("cat") == cat and e.get("ph") == "X"), key=lambda e: e["ts"])
    hosts = [e if cat != "kernel" else launches.get(e.get("args", {}).get("correlation")) for e in targets]
    stacks: dict[int, list[str]] = {}
    host_by_tid: dict[object, list[tuple[float, int]]] = defaultdict(list)
    for n, h in enumerate(hosts):
        if h is not None:
            host_by_tid[h.get("tid")].append((float(h["ts"]), n))
    for tid, items in host_by_tid.items():
        items.sort()
        for (_, n), stack in zip(items, _stacks_at(by_tid.get(tid, []), [t for t, _ in items], within), strict=True):
            stacks[n] = stack
    return [{"name": e["name"], "us": float(e["dur"]), "ts": float(e["ts"]), "frames": stacks.get(n, [])}
            for n, e in enumerate(targets)]


def site(frames: list[str], depth: int = 3) -> str:
    """The innermost ``depth`` frames as ``a > b > c`` (``?`` for none)."""
    return " > ".join(frames[-depth:]) or "?"


def by_site(kernels: list[dict], steps: int, depth: int = 3) -> list[dict]:
    """Kernels grouped by launch site, most device time first: ``{"site", "us_per_step", "calls_per_step",
    "kernels"}`` (the kernel names seen there, by time)."""
    groups: dict[str, dict] = {}
    for k in kernels:
        g = groups.setdefault(site(k["frames"], depth), {"us": 0.0, "calls": 0, "names": defaultdict(float)})
        g["us"] += k["us"]
        g["calls"] += 1
        g["names"][k["name"]] += k["us"]
    rows = [{"site": s, "us_per_step": g["us"] / steps, "calls_per_step": g["calls"] / steps,
             "kernels": [n[:60] for n, _ in sorted(g["names"].items(), key=lambda kv: -kv[1])]}
            for s, g in groups.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])
