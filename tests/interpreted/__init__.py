"""Kernel checks run under Triton's CPU interpreter, each module in a subprocess (the interpreter is chosen when the
kernels are defined): :func:`run_checks` runs one and returns the JSON object it prints last."""

import json
import os
import subprocess
import sys
from pathlib import Path


def run_checks(module: str) -> dict:
    """``TRITON_INTERPRET=1 python -m tests.interpreted.<module>`` from the repository root -> its JSON result. One
    torch thread: the emulations' fp32 sums then take one order, so a check's bits do not depend on the machine."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", f"tests.interpreted.{module}"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
