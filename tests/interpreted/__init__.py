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


def index_through_item() -> None:
    """Triton 3.6's interpreter passes int arguments as one-element arrays and indexes them with ``int(array)``,
    which NumPy 2.4 refuses for arrays of one dimension, so a loop with a runtime bound (``range(0, n, step)``)
    fails there. Index through ``.item()`` instead (what older NumPy did); for the interpreted checks only."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def contract_error(op: str, fn, max_examples: int) -> str:
    """'' when ``fn`` meets op ``op``'s contract on ``max_examples`` drawn cases, else the failure's last 2000
    characters (a check's error text)."""
    from fidelity.testing import check_against_oracle

    try:
        check_against_oracle(op, fn, max_examples=max_examples)
    except AssertionError as e:
        return str(e)[-2000:]
    return ""
