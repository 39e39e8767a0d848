"""The Triton radix top-k without a GPU: Triton's CPU interpreter runs the kernels (in a subprocess, since the
interpreter is chosen when the kernels are defined) and every check must give exactly the CPU stable sort's picks.
Skipped where triton is not installed (the test extra installs it on Linux)."""

import pytest

pytest.importorskip("triton")

from tests.interpreted import run_checks  # noqa: E402

CHECKS = [f"{name}_{dtype}" for dtype in ("bfloat16", "float32")
          for name in ("random", "signed_zero_nan_inf_ties", "few_distinct_values", "strided_rows_and_leading_dims",
                       "all_zero_rows", "stable_topk_route_radix")]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    return run_checks("radix_topk_checks")


def test_the_interpreted_run_reports_every_check(interpreted):
    assert sorted(interpreted) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_radix_topk_interpreted_gives_the_cpu_stable_sort_picks(interpreted, check):
    assert interpreted[check] == [], f"{check}: picks differ from the CPU stable sort on {interpreted[check]}"
