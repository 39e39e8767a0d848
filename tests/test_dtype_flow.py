"""Dtype flow (``fidelity dtype-flow``): a value narrowed to a smaller float and widened again by its very next use
is a round trip, found through views and assigned to the site emitted next; other uses of a narrow value are not."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fidelity
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.dtype_flow import DtypeFlow, dtype_flow, flow_table
from fidelity.model.default import prompt_for
from fidelity.model.load import load_checkpoint


def _trips(fn) -> list[tuple]:
    flow = DtypeFlow()
    with flow:
        fn(torch.randn(4, 8))
        flow.mark("site")
    return [t.path for t in flow.trips]


def test_a_narrowed_value_widened_by_its_next_use_is_a_round_trip_even_through_views():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert _trips(lambda x: x.to(bf16).float()) == [(fp32, bf16, fp32)]
    assert _trips(lambda x: x.to(bf16).view(-1)[2:].double()) == [(fp32, bf16, torch.float64)]
    assert _trips(lambda x: (x.to(bf16) @ x.T.to(bf16)).float()) == []  # used narrow (the product) first
    assert _trips(lambda x: x.to(bf16).to(torch.float16)) == []  # same width: not a widening
    assert _trips(lambda x: x.double().float()) == []  # fp64 -> fp32 narrows, nothing widens it


@pytest.fixture(scope="module")
def tables():
    ckpt = load_checkpoint(fidelity.default_checkpoint())
    prompt = prompt_for(ckpt, 24, 0)
    return {p: {(r["site"], r["round trip"]): r for r in flow_table(dtype_flow(ProductionModel(ckpt, p, 25), prompt))}
            for p in ("reference", "fp32-residual")}


def test_bf16_residual_streams_are_round_trips_that_the_fp32_residual_profile_removes(tables):
    key = ("L1.mhc_attn.pre", "fp32 -> bf16 -> fp32")  # hc_post stores bf16 streams, hc_pre reads them as fp32
    assert tables["reference"][key]["prefill"] == 1 and tables["reference"][key]["decode step"] == 1
    assert key not in tables["fp32-residual"]
    assert ("L0.moe.out", "fp32 -> bf16 -> fp32") in tables["fp32-residual"]  # bf16 expert outputs, fp32 sum


def test_dtype_flow_command_prints_the_table_and_refuses_an_unknown_profile():
    ok = subprocess.run([sys.executable, "-m", "fidelity.cli", "dtype-flow", "--prompt-len", "16"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "| L1.mhc_attn.pre | fp32 -> bf16 -> fp32 | 1 | 1 |" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "fidelity.cli", "dtype-flow", "--profile", "fp9"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "profile: expected one of" in bad.stderr
