"""Checking an implementation against its contract: one case (:func:`check_case`), a hypothesis search
(:func:`check_against_oracle`), every registered implementation (:func:`check_all_registered`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import hypothesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fidelity.testing.cases import FP64, Case, Tolerance, _at
from fidelity.testing.contracts import contract_of, strategy_of

# --------------------------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------------------------


def _nonfinite_code(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf (same shape, int8)."""
    code = torch.zeros(x.shape, dtype=torch.int8)
    if not x.is_floating_point():
        return code
    return code.masked_fill(x.isnan(), 1).masked_fill(x == math.inf, 2).masked_fill(x == -math.inf, 3)




def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _fmt_cos(v: float) -> str:
    return f"1 - {1 - v:.3g}" if 0.99 < v < 1 else _fmt(v)


def _exact_problems(name: str, found: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """Equal values (+0 == -0), NaN exactly where the reference has NaN."""
    f, r = found.to(FP64) if found.is_floating_point() else found, ref.to(FP64) if ref.is_floating_point() else ref
    bad = (f != r) & ~(_nonfinite_code(f).eq(1) & _nonfinite_code(r).eq(1))
    if not bool(bad.any()):
        return []
    first = int(bad.flatten().nonzero()[0])
    at = _at(ref.shape, first)
    return [f"output {name!r}: not exact: {int(bad.sum())} of {bad.numel()} elements differ; first at {at}: "
            f"expected {ref.flatten()[first].item()!r}, found {found.flatten()[first].item()!r}"]


def _tolerance_problems(name: str, found: torch.Tensor, ref: torch.Tensor, tol: Tolerance, case: Case) -> list[str]:
    problems = []
    cf, cr = _nonfinite_code(found), _nonfinite_code(ref)
    mismatch = cf != cr
    if bool(mismatch.any()):
        first = int(mismatch.flatten().nonzero()[0])
        problems.append(
            f"output {name!r}: non-finite pattern differs at {int(mismatch.sum())} of {mismatch.numel()} positions; "
            f"first at {_at(ref.shape, first)}: expected {ref.flatten()[first].item()!r}, "
            f"found {found.flatten()[first].item()!r}")
    both = (cf == 0) & (cr == 0)
    x = torch.where(both, ref.to(FP64), 0.0)
    y = torch.where(both, found.to(FP64), 0.0)
    if (tol.cos_min is not None or tol.calc_diff_max is not None) and ref.numel():
        d = ref.shape[-1] if ref.ndim else 1
        xr, yr = x.reshape(-1, d), y.reshape(-1, d)
        dot, xx, yy = (xr * yr).sum(-1), xr.square().sum(-1), yr.square().sum(-1)
        both_zero = (xx == 0) & (yy == 0)
        cos = torch.where(xx * yy > 0, dot / (xx * yy).sqrt(), both_zero.to(FP64))
        calc_diff = torch.where(both_zero, 0.0, 1 - 2 * dot / (xx + yy).clamp(min=1e-300))
        rows = ref.shape[:-1] if ref.ndim else torch.Size([])
        for metric, values, limit, worst_fn, ok in (
            ("cos", cos, tol.cos_min, torch.argmin, lambda v, lim: v >= lim),
            ("calc_diff", calc_diff, tol.calc_diff_max, torch.argmax, lambda v, lim: v <= lim),
        ):
            if limit is None or values.numel() == 0:
                continue
            w = int(worst_fn(values))
            v = float(values[w])
            if not ok(v, limit):
                e = int((xr[w] - yr[w]).abs().argmax())
                op, fmt = (">=", _fmt_cos) if metric == "cos" else ("<=", _fmt)
                problems.append(
                    f"output {name!r}: {metric} expected {op} {fmt(limit)}, found {fmt(v)} at row {_at(rows, w)} "
                    f"(rows over {list(rows)}, {d} elements each); worst element [{e}] of that row: "
                    f"expected {_fmt(float(xr[w, e]))}, found {_fmt(float(yr[w, e]))}")
    if tol.bound is not None:
        limit = tol.bound(case).to(FP64)
        err = (x - y).abs()
        over = err > limit
        if bool(over.any()):
            excess = torch.where(over, err - limit, -1.0)
            first = int(excess.flatten().argmax())
            problems.append(
                f"output {name!r}: elementwise error bound exceeded at {int(over.sum())} of {over.numel()} "
                f"positions; worst at {_at(ref.shape, first)}: expected {_fmt(float(x.flatten()[first]))} "
                f"+- {_fmt(float(limit.flatten()[first]))}, found {_fmt(float(y.flatten()[first]))}")
    return problems


def _to(v: Any, device: torch.device | str | None) -> Any:
    """A copy of tensor ``v`` on ``device`` (a copy even on the same device: kernels may work in place)."""
    return v.to(v.device if device is None else device, copy=True) if isinstance(v, torch.Tensor) else v


def check_case(op_name: str, fn: Callable[..., Any], case: Case, device: torch.device | str | None = None) -> None:
    """Run ``fn`` on one :class:`Case` (tensors moved to ``device``, results back to CPU) and compare with the
    contract of ``op_name``; raises AssertionError naming the op, output, metric, expected vs found and the
    input shapes."""
    contract = contract_of(op_name)
    head = f"{op_name}: implementation {getattr(fn, '__name__', repr(fn))!r} fails its {contract.kind} contract"
    where = f"inputs: {case.describe()}"
    expected = contract.expected(case)
    args = [_to(v, device) for v in case.args.values()]
    kwargs = {k: _to(v, device) for k, v in case.kwargs.items()}
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # a crash on valid inputs is a contract failure too
        raise AssertionError(f"{head}\n  raised {type(exc).__name__}: {exc}\n  {where}") from exc
    found = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    names = [o.name for o in contract.outputs]
    if len(found) != len(names) or not all(isinstance(t, torch.Tensor) for t in found):
        kinds = [type(t).__name__ for t in found]
        raise AssertionError(f"{head}\n  expected {len(names)} tensor output(s) {names}, found {kinds}\n  {where}")
    found = tuple(t.detach().cpu() for t in found)
    problems = []
    for out, f, e in zip(contract.outputs, found, expected, strict=True):
        if tuple(f.shape) != tuple(e.shape):
            problems.append(f"output {out.name!r}: shape expected {list(e.shape)}, found {list(f.shape)}")
        if out.dtype is None and (f.is_floating_point() or f.is_complex() or f.dtype == torch.bool):
            problems.append(f"output {out.name!r}: dtype expected an integer dtype, found {f.dtype}")
        elif out.dtype is not None and f.dtype != out.dtype:
            problems.append(f"output {out.name!r}: dtype expected {out.dtype}, found {f.dtype}")
    if not problems:
        if contract.canonical is not None:
            found, expected = contract.canonical(found), contract.canonical(expected)
        for out, f, e in zip(contract.outputs, found, expected, strict=True):
            if out.tolerance is None:
                problems += _exact_problems(out.name, f, e)
            else:
                problems += _tolerance_problems(out.name, f, e, out.tolerance, case)
    if problems:
        raise AssertionError("\n  ".join([head, *problems, where]))


def check_against_oracle(op_name: str, fn: Callable[..., Any], *, max_examples: int = 50,
                         device: torch.device | str | None = None, seed: int = 0,
                         strategy: st.SearchStrategy[Case] | None = None) -> None:
    """Property-test ``fn`` (called like the production op ``op_name``) against the op's contract.

    Hypothesis draws ``max_examples`` inputs from ``strategy`` (default: the contract's), derandomized by
    ``seed``, no deadline, no example database; inputs are moved to ``device`` (if given), outputs back to
    CPU. On failure raises AssertionError for the shrunk example (op, output, metric, expected vs found,
    input shapes; hypothesis adds the falsifying ``Case``).
    """
    contract_of(op_name)  # an unknown op fails here, before hypothesis runs
    inputs = strategy if strategy is not None else strategy_of(op_name)

    @settings(max_examples=max_examples, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=inputs)
    def run(case: Case) -> None:
        check_case(op_name, fn, case, device)

    hypothesis.seed(seed)(run)()


def check_all_registered(impl: str = "cpu", *, max_examples: int = 25, device: torch.device | str | None = None,
                         seed: int = 0) -> list[str]:
    """Check every op of the production REGISTRY that has implementation ``impl``; returns the op names
    checked, raises one AssertionError listing every failing op (and ops without a contract)."""
    from fidelity.decoders.production.registry import REGISTRY

    checked, failures = [], []
    for op, impls in sorted(REGISTRY.items()):
        if impl not in impls:
            continue
        checked.append(op)
        try:
            check_against_oracle(op, impls[impl], max_examples=max_examples, device=device, seed=seed)
        except (AssertionError, KeyError) as exc:
            failures.append(str(exc))
    if failures:
        raise AssertionError(f"{len(failures)} of {len(checked)} {impl!r} ops fail:\n" + "\n".join(failures))
    return checked
