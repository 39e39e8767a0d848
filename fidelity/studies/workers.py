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

MAX_JOBS = 64


def check_jobs(jobs: int) -> int:
    """``jobs`` when it is a worker count this machine can give; ValueError in one line otherwise."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--jobs: expected an integer from 1 to {MAX_JOBS}, found {jobs!r}")
    return jobs


def run_tasks(play: Callable[[Any], list[str]], tasks: Sequence[Any], jobs: int,
              init: Callable[..., None], init_args: tuple, tell: Callable[[str], None]) -> None:
    """``play(task)`` for every task in ``jobs`` worker processes (each set up by ``init(*init_args)``), in the
    order given (put the longest first); the lines each returns are told as it finishes. An error in a task stops
    the job: the tasks not started are cancelled, the ones running finish (their records kept), the error is
    raised here."""
    if not tasks:
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx, initializer=init,
                             initargs=init_args) as pool:
        pending = {pool.submit(play, t) for t in tasks}
        done_count = 0
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    for line in f.result():
                        tell(line)
                    done_count += 1
                    tell(f"[{done_count} of {len(tasks)} done in {min(jobs, len(tasks))} worker processes]")
        except BaseException:
            for f in pending:
                f.cancel()
            raise
