"""A long job's independent runs in worker processes (``--jobs N``).

Each worker is a fresh interpreter (``spawn``: safe after CUDA or OpenMP started in the parent) that builds its
context once (``init``: the checkpoint, decoder and faults of the job) and then plays the tasks it is handed, each
keeping its own record in the job directory as it finishes (``fidelity.studies.jobdir``). The parent then reads the
records back as if a stopped job had kept them: a job run with ``--jobs N`` reports what it does with one.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

import torch

MAX_JOBS = 64


def plan_spec(plan, ckpt, jobs: int) -> dict:
    """How a worker process opens the job's checkpoint again (``open_plan``): its directory, or the preset it was
    synthesized from; InputError in one line for a checkpoint built in memory (nothing a worker can reopen)."""
    from fidelity.api import InputError

    from_preset = plan.path is None and "preset" in ckpt.origin  # synthesized by ``plan.open``
    if plan.path is None and not from_preset:
        raise InputError(f"--jobs {jobs}: each worker process opens the checkpoint again, and this one has no "
                         "directory (a checkpoint object built in memory): save it, or run with jobs=1")
    return {"checkpoint": plan.path, "preset": plan.preset if from_preset else None, "seed": plan.seed,
            "layers": plan.layers, "device": plan.device}


def worker_spec(plan, checkpoint, jobs: int, decoder: str, decoder_dtype: str, device: str) -> dict:
    """What a worker process needs to open the job's checkpoint and decoder again (picklable): ``decoder``
    production or transformers (in ``decoder_dtype``)."""
    return {"plan": plan_spec(plan, checkpoint, jobs), "decoder": decoder, "decoder_dtype": decoder_dtype,
            "device": device, "threads": max(1, torch.get_num_threads() // jobs)}


def open_plan(spec: dict):
    """(plan, checkpoint) of a ``plan_spec`` in a worker process."""
    from fidelity.api import plan_checkpoint

    plan = plan_checkpoint(spec["checkpoint"], preset=spec["preset"], seed=spec["seed"], layers=spec["layers"],
                           device=spec["device"])
    return plan, plan.open()


def check_jobs(jobs: int) -> int:
    """``jobs`` when it is a worker count this machine can give; ValueError in one line otherwise."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--jobs: expected an integer from 1 to {MAX_JOBS}, found {jobs!r}")
    return jobs


def run_tasks(play: Callable[[Any], list[str]], tasks: Sequence[Any], jobs: int,
              init: Callable[..., None], init_args: tuple,
              done: Callable[[list[str], int, int], None] = lambda lines, k, n: None) -> None:
    """``play(task)`` for every task in ``jobs`` worker processes (each set up by ``init(*init_args)``), in the
    order given (put the longest first); ``done(lines, k, n)`` as each finishes (the lines it returned, k of n
    finished). An error in a task stops the job: the tasks not started are cancelled, the ones running finish
    (their records kept), the error is raised here."""
    if not tasks:
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx, initializer=init,
                             initargs=init_args) as pool:
        pending = {pool.submit(play, t) for t in tasks}
        finished = 0
        try:
            while pending:
                ready, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in ready:
                    lines = f.result()
                    finished += 1
                    done(lines, finished, len(tasks))
        except BaseException:
            for f in pending:
                f.cancel()
            raise
