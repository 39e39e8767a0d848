"""benchmarks/kernel_sections/common.py: a row's vendor floor uses the peaks of the card it ran on (an H100 row
measured against the H200's 4.8 TB/s read 0.63 where the card's own 3.35 TB/s gives 0.91), and a card without
known peaks gets the measured floor only."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kernel_sections import common  # noqa: E402


@pytest.fixture
def clean_state(monkeypatch):
    monkeypatch.setattr(common, "VENDOR", {})
    monkeypatch.setattr(common, "CEIL", {"bw": 3.0e12, "bf16": 800e12})
    monkeypatch.setattr(common, "RESULTS", [])


@pytest.mark.parametrize(("name", "tbps"), [("NVIDIA H200", 4.8), ("NVIDIA H100 80GB HBM3", 3.35)])
def test_vendor_floor_uses_the_bandwidth_of_the_card_that_ran(clean_state, name, tbps):
    common.VENDOR.update(common.vendor_peaks(name))
    r = common.record("k", "s", "v", {"us": 10.0}, bytes_=30e6, flops=0)
    assert r["floors"]["vendor"]["floor_us"] == pytest.approx(30e6 / (tbps * 1e12) * 1e6)
    assert r["frac_floor_vendor"] == pytest.approx(30e6 / (tbps * 1e12) * 1e6 / 10.0)
    assert r["frac_floor_measured"] == pytest.approx(1.0)


def test_a_card_without_known_peaks_carries_the_measured_floor_only(clean_state):
    common.VENDOR.update(common.vendor_peaks("NVIDIA H100 PCIe"))
    r = common.record("k", "s", "v", {"us": 10.0}, bytes_=30e6, flops=1e9)
    assert "vendor" not in r["floors"] and r["frac_floor_vendor"] is None
    assert r["floors"]["measured"]["bound"] == "memory"
