"""Programmatic dependent launch: a kernel launched with ``PDL_LAUNCH`` may start before the previous kernel in the
stream has finished, so it must wait (``wait_for_previous_kernel``) before it touches memory. Checked on the source:
every launch site that passes the option launches a kernel whose first statement is the wait."""

import ast
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[1] / "fidelity" / "decoders" / "production" / "kernels"


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if docstring else body[0]


def _waits_first(fn: ast.FunctionDef) -> bool:
    s = _first_statement(fn)
    return isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and \
        getattr(s.value.func, "id", None) == "wait_for_previous_kernel"


def _pdl_launches(tree: ast.Module) -> list[tuple[str, int]]:
    """(kernel name, line) of each ``kernel[grid](..., **PDL_LAUNCH)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                any(k.arg is None and getattr(k.value, "id", None) == "PDL_LAUNCH" for k in node.keywords):
            out.append((getattr(node.func.value, "id", "?"), node.lineno))
    return out


def test_every_programmatic_launch_starts_a_kernel_that_waits_for_the_previous_one():
    checked = 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, line in _pdl_launches(tree):
            assert name in defs, f"{path.name}:{line}: launches {name}, not defined in the module"
            assert _waits_first(defs[name]), f"{path.name}:{line}: {name} is launched with PDL_LAUNCH but does not " \
                                             f"begin with wait_for_previous_kernel()"
            checked += 1
    assert checked >= 30  # the decode step's Triton kernels


def test_the_check_flags_a_kernel_that_reads_before_waiting():
    src = ("def _k(x_ptr):\n    v = tl.load(x_ptr)\n    wait_for_previous_kernel()\n\n"
           "def launch(x):\n    _k[(1,)](x, **PDL_LAUNCH)\n")
    tree = ast.parse(src)
    (name, _), = _pdl_launches(tree)
    assert not _waits_first(next(n for n in tree.body if n.name == name))


def test_launches_are_plain_under_the_interpreter_and_without_a_gpu():
    import torch

    from fidelity.decoders.production.kernels import _common as pdl

    if not torch.cuda.is_available() or pdl.INTERPRET:
        assert pdl.PDL_LAUNCH == {} and not pdl.ENABLED
    else:
        assert pdl.ENABLED == (torch.cuda.get_device_capability()[0] >= 9)
