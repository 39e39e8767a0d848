"""benchmarks/kernel_sites.py: ops attributed to the decoder line that ran them, read from a real profiler trace of
a decode step (on the CPU the host ops stand in for kernels; the sweep over Python frames is the same)."""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fidelity.decoders.production import ProductionModel
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_sites  # noqa: E402


def _traced_step(tmp_path: Path) -> list[dict]:
    model = ProductionModel(synthesize(ModelConfig.preset("tiny"), seed=0), "reference", max_context=64)
    session = model.session()
    session.prefill(torch.arange(9))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        session.step(3)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    return kernel_sites.load_trace(tmp_path / "trace.json")


def test_every_op_of_a_decode_step_is_attributed_to_the_decoder_frames_that_ran_it(tmp_path):
    ops = kernel_sites.attributed(_traced_step(tmp_path), cat="cpu_op")
    assert len(ops) > 100
    assert all(op["frames"] and op["frames"][0].startswith(("decoder.py:", "model.py:")) for op in ops)
    heads = [op for op in ops if "model.py:head" in op["frames"]]
    # the LM head's GEMM, launched from ``head`` through ``ops.rows_mm``
    assert any(op["name"] == "aten::matmul" and op["frames"][-2:] == ["model.py:head", "ops.py:rows_mm"]
               for op in heads), sorted({tuple(op["frames"][-2:]) for op in heads})
    assert any(f.startswith("attention.py:decode") for op in ops for f in op["frames"])


def test_sites_sum_to_the_attributed_time_and_name_their_frames(tmp_path):
    ops = kernel_sites.attributed(_traced_step(tmp_path), cat="cpu_op")
    rows = kernel_sites.by_site(ops, steps=1, depth=2)
    assert abs(sum(r["us_per_step"] for r in rows) - sum(op["us"] for op in ops)) < 1e-6 * sum(op["us"] for op in ops)
    assert sum(r["calls_per_step"] for r in rows) == len(ops)
    assert [r["us_per_step"] for r in rows] == sorted((r["us_per_step"] for r in rows), reverse=True)
    assert all(1 <= len(r["site"].split(" > ")) <= 2 for r in rows)
