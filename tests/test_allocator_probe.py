"""The allocator probe (``probes.memory``): what a decoder's own calls allocate, keep and hold, judged after the
warm-up; the ``decode-buffer-kept`` mutant is caught on a real run; the decode gather works in the preallocated
buffers bit for bit."""

from __future__ import annotations

import pytest
import torch

import fidelity
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.cache import KVStore
from fidelity.decoders.production.faults import inject
from fidelity.harness.runner import Runner, RunSpec
from fidelity.harness.thresholds import MEMORY_GROWTH_BAND
from fidelity.model.default import prompt_for
from fidelity.model.load import load_checkpoint
from fidelity.studies.mutant_runs import MutantSettings, run_one
from fidelity.studies.mutants import BY_NAME
from probes.memory import (
    _MALLOC_IN_USE,
    WARMUP_DECODE_CALLS,
    allocator_counts,
    allocator_delta,
    handed_bytes,
    held_bytes,
)


def test_held_bytes_counts_each_storage_once_through_nested_containers():
    a = torch.zeros(100, dtype=torch.float32)

    class Holder:
        __slots__ = ("x",)

        def __init__(self, x):
            self.x = x

    root = {"list": [a, a[10:]], "slots": Holder((a.view(10, 10), torch.ones(3, dtype=torch.float64)))}
    assert held_bytes(root) == 400 + 24


def test_handed_bytes_rounds_like_the_cuda_allocator_only_on_cuda():
    assert handed_bytes([torch.zeros(3), torch.zeros(3)]) == 24  # two storages, CPU: exact bytes


@pytest.mark.skipif(_MALLOC_IN_USE is None, reason="glibc mallinfo2 missing")
def test_a_call_that_keeps_a_buffer_retains_its_bytes_beyond_its_outputs():
    kept = []

    def call():
        kept.append(torch.ones(1 << 20, dtype=torch.uint8))
        return torch.zeros(1 << 18, dtype=torch.uint8)

    before = allocator_counts("cpu")
    out = call()
    delta = allocator_delta(before, allocator_counts("cpu"), handed_bytes([out]))
    assert (1 << 20) <= delta["host_retained_delta"] < (1 << 20) + 4096


@pytest.fixture(scope="module")
def default_ckpt():
    return load_checkpoint(fidelity.default_checkpoint())


@pytest.fixture(scope="module")
def memory_rows(default_ckpt):
    """A clean 12-step run and the decode-buffer-kept mutant's run, judged (CPU)."""
    settings = MutantSettings(decode_steps=12, modes=("layer",))
    return {name: run_one(default_ckpt, BY_NAME.get(name), settings) for name in ("clean", "decode-buffer-kept")}


def _memory(df, metric):
    return df[(df["site"] == "memory") & (df["metric"] == metric)]


def test_clean_decoder_holds_nothing_new_after_the_warm_up(memory_rows):
    held = _memory(memory_rows["clean"], "held_growth")
    assert len(held) == 12 - WARMUP_DECODE_CALLS and (held["value"] == 0).all() and held["passed"].all()


def test_kept_decode_buffer_is_caught_by_held_growth(memory_rows):
    held = _memory(memory_rows["decode-buffer-kept"], "held_growth")
    per_step = held["value"].diff().dropna()
    # per decode step, rows of 128 bf16: two SWA layers (128), two CSA (128 + 65536/4), two HCA (128 + 65536/128)
    assert (per_step == 2 * 128 * 2 * (128 + (128 + 16384) + (128 + 512))).all()
    assert held["value"].max() > MEMORY_GROWTH_BAND and not held["passed"].all()


def test_decode_gather_into_preallocated_buffers_reads_the_same_rows():
    torch.manual_seed(0)
    for fmt in ("bf16", "fp8"):
        store = KVStore(40, 128, 64, fmt)
        store.write(slice(0, 40), torch.randn(40, 128).to(torch.bfloat16))
        slots = torch.tensor([5, 0, 39, 7])
        out = torch.full((4, 128), float("nan"), dtype=torch.bfloat16)
        assert torch.equal(store.read_into(slots, out), store.read(slots)) and torch.equal(out, store.read(slots))


def test_fault_free_decode_keeps_nothing_and_the_fault_keeps_a_buffer_per_attention_layer(default_ckpt):
    model = ProductionModel(default_ckpt, "reference", 400)
    session = model.session()
    session.prefill(prompt_for(default_ckpt, 300, 0))
    session.step(5)
    assert session.kept == []
    with inject("decode-buffer-kept"):
        session.step(5)
    assert len(session.kept) == default_ckpt.config.n_layers


def test_runner_records_the_decoders_memory_per_call(default_ckpt):
    spec = RunSpec(prompt=prompt_for(default_ckpt, 64, 0), decode_steps=4, modes=("free",))
    df, _ = Runner(default_ckpt, spec).run()
    mem = df[df["site"] == "memory"]
    per_call = mem[mem["metric"] == "held_bytes"]
    assert len(per_call) == 1 + 4 and (per_call["value"] > 0).all()
    assert set(mem[mem["metric"] == "held_growth"]["step"]) == {1 + WARMUP_DECODE_CALLS, 4}
