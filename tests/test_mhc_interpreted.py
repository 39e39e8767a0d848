"""The mHC split-K finish kernels without a GPU: Triton's CPU interpreter runs ``hc_pre_cuda`` / ``hc_head_cuda``'s
finish launches on partials torch computes (``tests/interpreted/mhc_checks.py``), against the ops' tolerance
contracts at decode's and prefill's tiles, and decode's grouped split sums against prefill's split order. Skipped
where triton is not installed."""

import pytest

pytest.importorskip("triton")

from tests.interpreted import run_checks  # noqa: E402

CHECKS = ["hc_pre_split_finish_contract", "hc_head_split_finish_contract", "decode_and_prefill_finish_agree"]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return run_checks("mhc_checks")


def test_the_interpreted_run_reports_every_check(interpreted):
    assert sorted(interpreted) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted_mhc_check_passes(interpreted, check):
    assert interpreted[check] == "", f"{check}: {interpreted[check]}"


def test_a_decode_finish_loads_every_split_at_once_and_prefill_keeps_the_split_order():
    """One token with V4-Flash's 128 split-K partials (4 x 4096 columns in 128-column slices): one group of 128
    splits, so the finish waits for one load instead of one per split; 16 or more tokens keep the mix kernels' tile
    and sum the splits one at a time (the bits of the prefill path as before)."""
    from fidelity.decoders.production.kernels import mhc

    assert mhc._finish_tiles(1, 16, 256, 128, 16) == (1, 512, 128)
    assert mhc._finish_tiles(3, 16, 256, 128, 16) == (4, 128, 32)  # [4 tokens, 32 splits, 16 mixes] a load
    assert mhc._finish_tiles(16, 16, 256, 17, 16) == (16, 256, 1)
    assert mhc._finish_tiles(4096, 64, 64, 4, 16) == (64, 64, 1)
