"""Progress of long work on stderr: a tqdm bar on a terminal, a log line every few seconds (and at the end of each
phase) otherwise, so that a run in CI or under ``nohup`` still says what it is doing."""

from __future__ import annotations

import sys
import time
from typing import TextIO

LOG_EVERY_S = 10.0


class Progress:
    """``progress(phase, done, total, note="")``: call it as work completes; a new phase closes the previous one."""

    def __init__(self, stream: TextIO | None = None, every: float = LOG_EVERY_S, bar: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.bar = self.stream.isatty() if bar is None else bar
        self.phase: str | None = None
        self._tqdm = None
        self._t0 = self._last = 0.0

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        now = time.perf_counter()
        new = phase != self.phase
        if new:
            self.close()
            self.phase, self._t0, self._last = phase, now, now
            if self.bar:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, desc=phase, file=self.stream, leave=True, dynamic_ncols=True)
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(note, refresh=False)
            self._tqdm.update(done - self._tqdm.n)
        elif new or done == total or now - self._last >= self.every:
            self._last = now
            extra = f", {note}" if note else ""
            print(f"{phase} {done}/{total} ({now - self._t0:.1f} s{extra})", file=self.stream, flush=True)
        if done == total:
            self.close()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        self.phase = None
