"""similarity: how close a production tensor is to the oracle's, after checking that their non-finite
patterns agree (docs/design.md "Probes").

Numeric metrics are float64 and computed only over coordinates that are finite in both tensors, so a
planted NaN is reported by ``nonfinite_*`` without turning every other metric into NaN. Conventions for
degenerate inputs (no coordinate differs, or a tensor is all zeros):
  cos = 1 if both are zero, 0 if only one is; calc_diff = 0 and rel_l2 = 0 if both are zero;
  sqnr_db = +inf when the error is exactly zero (identical tensors), -inf if only the signal is zero;
  max_abs_index = -1 when max_abs == 0.
"""

from __future__ import annotations

import math

import torch

from probes.sets import first_true

_NAN, _POS, _NEG = 1, 2, 3


def nonfinite_code(x: torch.Tensor) -> torch.Tensor:
    """Any shape -> int8, same shape: 0 finite, 1 NaN, 2 +inf, 3 -inf."""
    code = torch.zeros(x.shape, dtype=torch.int8, device=x.device)
    if not x.is_floating_point():
        return code
    code = code.masked_fill(x.isnan(), _NAN).masked_fill(x == float("inf"), _POS)
    return code.masked_fill(x == float("-inf"), _NEG)


def _prepare(ref: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Pairs [B, ...] -> both as [B, n] float64 with non-common-finite coordinates zeroed, plus the non-finite
    metrics [B]. On the CPU, where reading a value back costs nothing, all-finite tensors take
    :func:`_finite_pair` (same values, a third of the ops); elsewhere :func:`_masked_pair` (no host read)."""
    if ref.shape != test.shape:
        raise ValueError(f"similarity: ref shape {tuple(ref.shape)} != test shape {tuple(test.shape)}")
    test = test.to(ref.device)
    flat = (ref.shape[0], math.prod(ref.shape[1:]))
    ref, test = ref.reshape(flat), test.reshape(flat)
    if ref.device.type == "cpu" and _all_finite(ref) and _all_finite(test):
        return _finite_pair(ref, test)
    return _masked_pair(ref, test)


def _all_finite(x: torch.Tensor) -> bool:
    return not x.is_floating_point() or bool(x.isfinite().all())


def _finite_pair(ref: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`_masked_pair` of [B, n] tensors finite everywhere: nothing to zero, no non-finite coordinate."""
    b, n = ref.shape
    zero = torch.zeros(b, dtype=torch.int64)
    nonfinite = {"nonfinite_mismatch": zero, "nonfinite_first": torch.full((b,), -1), "test_nonfinite": zero,
                 "ref_nonfinite": zero, "compared": torch.full((b,), n)}
    return ref.to(torch.float64), test.to(torch.float64), nonfinite


def _masked_pair(ref: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """[B, n] tensors as float64, coordinates not finite in both zeroed, and the non-finite metrics [B]."""
    cr, ct = nonfinite_code(ref), nonfinite_code(test)
    mismatch = cr != ct
    both = (cr == 0) & (ct == 0)
    x = torch.where(both, ref.to(torch.float64), 0.0)
    y = torch.where(both, test.to(torch.float64), 0.0)
    nonfinite = {
        "nonfinite_mismatch": mismatch.sum(-1),
        "nonfinite_first": first_true(mismatch),
        "test_nonfinite": (ct != 0).sum(-1),
        "ref_nonfinite": (cr != 0).sum(-1),
        "compared": both.sum(-1),
    }
    return x, y, nonfinite


def _cos_calc_diff(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y float64 [..., d] -> (cos, calc_diff, |x|^2) over the last dim."""
    dot, xx, yy = (x * y).sum(-1), (x * x).sum(-1), (y * y).sum(-1)
    both_zero = (xx == 0) & (yy == 0)
    cos = torch.where(xx * yy > 0, dot / (xx * yy).sqrt(), both_zero.to(torch.float64))
    calc_diff = torch.where(both_zero, 0.0, 1 - 2 * dot / (xx + yy))
    return cos, calc_diff, xx


def similarity(ref: torch.Tensor, test: torch.Tensor) -> dict[str, torch.Tensor]:
    """ref (oracle), test (production): same shape, any dtype -> 0-d metrics.

    float64: cos, calc_diff, rel_l2, max_abs, sqnr_db; int64: max_abs_index (flat index into the shape,
    see ``unravel``), nonfinite_mismatch, nonfinite_first (flat, -1 none), test_nonfinite, ref_nonfinite,
    compared (coordinates finite in both).
    """
    if ref.shape != test.shape:
        raise ValueError(f"similarity: ref shape {tuple(ref.shape)} != test shape {tuple(test.shape)}")
    return {k: v[0] for k, v in similarity_batch(ref[None], test[None]).items()}


def similarity_batch(ref: torch.Tensor, test: torch.Tensor) -> dict[str, torch.Tensor]:
    """B pairs of one shape, ref and test [B, ...] (a site of B layers) -> :func:`similarity`'s metrics as [B]
    tensors, each over its own pair, in the same number of launches as one pair."""
    x, y, out = _prepare(ref, test)
    cos, calc_diff, xx = _cos_calc_diff(x, y)
    err = (x - y).abs_()
    ee = (err * err).sum(-1)
    if err.shape[-1]:
        max_abs, idx = err.max(dim=-1)
    else:  # an empty tensor: no error anywhere
        max_abs, idx = err.new_zeros(err.shape[0]), torch.full((err.shape[0],), -1, device=err.device)
    out.update(
        cos=cos,
        calc_diff=calc_diff,
        rel_l2=torch.where(ee == 0, 0.0, ee.sqrt() / xx.sqrt()),
        max_abs=max_abs,
        max_abs_index=torch.where(max_abs > 0, idx, -1),
        sqnr_db=torch.where(ee == 0, float("inf"), 10 * torch.log10(xx / ee)),
    )
    return out


def similarity_per_position(ref: torch.Tensor, test: torch.Tensor) -> dict[str, torch.Tensor]:
    """ref, test [n, ...] (dim 0 = tokens) -> [n] metrics: cos, calc_diff, max_abs (float64, over coordinates
    finite in both) and nonfinite_mismatch (int64)."""
    if ref.ndim == 0:
        raise ValueError("similarity_per_position: needs a token dim 0")
    x, y, nonfinite = _prepare(ref, test)  # [n, d]: one pair per token
    cos, calc_diff, _ = _cos_calc_diff(x, y)
    err = torch.cat(((x - y).abs(), x.new_zeros(x.shape[0], 1)), dim=1)
    return {
        "cos": cos,
        "calc_diff": calc_diff,
        "max_abs": err.amax(dim=1),
        "nonfinite_mismatch": nonfinite["nonfinite_mismatch"],
    }


def unravel(index: int, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...] | None:
    """Flat index (as reported by ``max_abs_index`` / ``nonfinite_first``) -> coordinate; None for -1."""
    index = int(index)
    if index < 0:
        return None
    coord = []
    for size in reversed(tuple(shape)):
        coord.append(index % size)
        index //= size
    return tuple(reversed(coord))
