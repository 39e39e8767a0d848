"""The cache-layout mutants show only where their layout exists: each fault, injected under the reference profile
(flat bf16 KV rows, bf16 indexer keys), raises no alarm at all; under the mutant's profile it is caught where it
was planted. Plus the two patch points on a store of their own: what the faulty read returns, byte for byte."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fidelity.decoders.production.cache import PLANAR_BLOCK, KeyStore, KVStore
from fidelity.decoders.production.faults import inject
from fidelity.decoders.profiles import get_profile
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.studies.detection import gate_failures
from fidelity.studies.mutant_runs import MutantSettings, run_mutants, run_one
from fidelity.studies.mutants import BY_NAME

CACHE_LAYOUT = ("paged-flat-addressing", "indexer-keys-planar")
SEED = 0


@pytest.fixture(scope="module")
def ckpt():
    return synthesize(ModelConfig.preset("tiny"), seed=SEED)


def test_each_needs_a_profile_that_makes_its_layout():
    paged = get_profile(BY_NAME["paged-flat-addressing"].options["profile"])
    assert paged.kv_block == 16 and get_profile("reference").kv_block == 0
    keys = get_profile(BY_NAME["indexer-keys-planar"].options["profile"])
    assert (keys.indexer_qk, keys.indexer_storage) == ("fp8", "packed")


@pytest.mark.parametrize("name", CACHE_LAYOUT)
def test_no_alarm_without_its_layout(ckpt, name):
    judged = run_one(ckpt, replace(BY_NAME[name], options={}), MutantSettings(seed=SEED))
    assert set(judged["profile"]) == {"reference"} and len(judged) > 0
    alarms = judged[~judged["passed"]]
    assert alarms.empty, f"{name} alarmed under the reference profile: {alarms.head(3).to_dict('records')}"


def test_caught_and_located_under_its_profile(ckpt):
    matrix = run_mutants(ckpt, list(CACHE_LAYOUT), MutantSettings(seed=SEED))
    assert gate_failures(matrix) == []  # the clean decoder silent under each profile, each mutant located
    first = matrix[(matrix["probe"] == "first") & (matrix["mutant"] != "clean")].set_index("mutant")
    assert first.loc[list(CACHE_LAYOUT), "located"].all()
    assert first.loc["paged-flat-addressing", "site"] == "L2.attn.core"  # the first compressed layer, decode
    assert first.loc["paged-flat-addressing", "step"] == 1
    assert first.loc["indexer-keys-planar", "site"] == "L2.indexer.scores"  # the prefill's scores
    assert first.loc["indexer-keys-planar", "step"] == 0


def _kv_store(block: int) -> KVStore:
    store = KVStore(70, 8, 0, "bf16", block=block)
    store.write(slice(0, 70), torch.arange(70 * 8, dtype=torch.bfloat16).reshape(70, 8))
    return store


def test_flat_addressing_reads_storage_rows_at_the_flat_slots_only_when_paged():
    slots = torch.arange(70)
    flat = _kv_store(0)
    with inject("paged-flat-addressing"):
        assert torch.equal(flat.read_into(slots, torch.empty(70, 8, dtype=torch.bfloat16)), flat.read(slots))
    paged = _kv_store(16)
    right = paged.read(slots)
    with inject("paged-flat-addressing"):
        got = paged.read_into(slots, torch.empty(70, 8, dtype=torch.bfloat16))
    assert torch.equal(got, paged.rows[:70])  # storage row s for slot s: the block table ignored
    assert torch.equal(right, paged.rows[paged.physical(slots)])
    moved = (got != right).any(dim=1)
    assert moved[:32].all() and not moved[32:48].any() and moved[48:].all()  # 5 blocks reversed: block 2 stays


def test_planar_keys_read_back_as_interleaved_bytes():
    d, n = 64, PLANAR_BLOCK + 6
    store = KeyStore(n, d, "fp8", packed=True)
    g = torch.Generator().manual_seed(0)
    store.write(slice(0, n), torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n)[:, None])
    right = store.read(slice(0, n))
    with inject("indexer-keys-planar"):
        got = store.read(slice(0, n))
    # the writer's bytes, built key by key: per block of PLANAR_BLOCK keys (the last padded with zero keys) every
    # key's d code bytes, then every key's scale byte; the reader takes key j at j * (d + 1)
    codes = torch.zeros(2 * PLANAR_BLOCK, d, dtype=torch.uint8)
    scales = torch.zeros(2 * PLANAR_BLOCK, 1, dtype=torch.uint8)
    codes[:n], scales[:n] = store.codes.view(torch.uint8), store.scales
    planar = torch.cat([torch.cat((codes[b : b + PLANAR_BLOCK].flatten(), scales[b : b + PLANAR_BLOCK].flatten()))
                        for b in (0, PLANAR_BLOCK)])
    for j in (0, 1, 5, PLANAR_BLOCK - 1, PLANAR_BLOCK, n - 1):
        key = planar[j * (d + 1) : (j + 1) * (d + 1)]
        want = key[:d].view(torch.float8_e4m3fn).float() * 2.0 ** (key[d].item() - 127)
        # a code byte 0x7F / 0xFF (the e4m3 NaN) can come from the scale bytes: NaN where the reader's is
        torch.testing.assert_close(got[j], want.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True, msg=str(j))
    # every key after the first read wrong (its codes shifted, a code byte read as its scale); the first keeps its
    # codes and reads the next key's first code byte as its scale (right only where the two bytes agree)
    assert (got != right).any(dim=1)[1:].all()


@pytest.mark.parametrize("fmt,packed", [("fp8", False), ("fp4", True), ("fp4", False)])
def test_planar_fault_leaves_other_key_stores_alone(fmt, packed):
    store = KeyStore(40, 64, fmt, packed=packed)
    store.write(slice(0, 40), torch.randn(40, 64))
    right = store.read(slice(0, 40))
    with inject("indexer-keys-planar"):
        assert torch.equal(store.read(slice(0, 40)), right)
