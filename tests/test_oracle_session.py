"""Incremental decode (prefill, then one token per step) equals the full-sequence forward, across window
(128) and compression (4 / 128) boundaries, including prefills that end exactly on a boundary."""

from __future__ import annotations

import pytest
import torch

from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from oracles import OracleModel

PARITY_REL_TOL = 1e-5  # fp32: same math, different grouping of the work


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())


def _check_parity(oracle: OracleModel, ids: torch.Tensor, prefills: list[int]) -> None:
    full = oracle.logits(ids)
    for n in prefills:
        session = oracle.session()
        logits = [session.prefill(ids[:n])]
        logits += [session.step(t)[None] for t in ids[n:]]
        inc = torch.cat(logits)
        assert _rel(inc, full) <= PARITY_REL_TOL, f"prefill {n} then {len(ids) - n} steps"


@pytest.fixture(scope="module")
def tiny_oracle() -> OracleModel:
    return OracleModel(synthesize(ModelConfig.preset("tiny"), seed=0))


def test_decode_matches_full_sequence_around_the_window_and_hca_boundaries(tiny_oracle):
    ids = torch.randint(2, 4096, (262,), generator=torch.Generator().manual_seed(0))
    _check_parity(tiny_oracle, ids[:132], [1, 3, 4, 5, 127, 128])
    _check_parity(tiny_oracle, ids, [255, 256, 257])


def test_decode_matches_full_sequence_around_4k(tiny_oracle):
    ids = torch.randint(2, 4096, (4098,), generator=torch.Generator().manual_seed(1))
    _check_parity(tiny_oracle, ids, [4095, 4096, 4097])


def test_chunked_prefill_matches_full_sequence(tiny_oracle):
    ids = torch.randint(2, 4096, (300,), generator=torch.Generator().manual_seed(2))
    full = tiny_oracle.logits(ids)
    session = tiny_oracle.session()
    parts = [session.forward(chunk) for chunk in ids.split([3, 130, 1, 66, 100])]
    assert _rel(torch.cat(parts), full) <= PARITY_REL_TOL


def test_last_rows_give_the_full_forwards_logits_at_those_rows(tiny_oracle):
    ids = torch.randint(2, 4096, (300,), generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([0, 127, 128, 255, 299])
    full = tiny_oracle.logits(ids)
    assert _rel(tiny_oracle.logits(ids, last_rows=rows), full[rows]) <= PARITY_REL_TOL
    session = tiny_oracle.session()
    session.prefill(ids[:299], last_rows=torch.tensor([298]))
    assert _rel(session.step(ids[299])[None], full[299:]) <= PARITY_REL_TOL  # the caches are complete


@pytest.mark.slow
def test_decode_matches_full_sequence_around_128k():
    """128K +- 1 on a narrow two-layer HCA + CSA model: 1024 HCA entries, 32768 indexer entries. Only the logits
    of the last rows are compared, so the last (CSA) layer's attention runs on those rows in both passes; every
    layer's caches, the HCA attention and the CSA decode steps cover the whole context."""
    cfg = ModelConfig.preset("tiny").replace(
        vocab_size=256, dim=128, n_layers=2, compress_ratios=(128, 4), n_hash_layers=1, n_heads=2, o_groups=1,
        q_lora_rank=128, moe_inter_dim=128, n_routed_experts=4, index_n_heads=1, max_seq_len=1 << 17,
    )
    oracle = OracleModel(synthesize(cfg, seed=0))
    ids = torch.randint(2, 256, (131074,), generator=torch.Generator().manual_seed(3))
    full = oracle.logits(ids, last_rows=torch.arange(131070, 131074))
    session = oracle.session()
    logits = [session.prefill(ids[:131071], last_rows=torch.tensor([131070]))]
    logits += [session.step(t)[None] for t in ids[131071:]]
    assert _rel(torch.cat(logits), full) <= PARITY_REL_TOL


def test_session_rejects_out_of_vocab_and_empty_input(tiny_oracle):
    session = tiny_oracle.session()
    with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 4096\), found \[5, 4096\]"):
        session.forward(torch.tensor([5, 4096]))
    with pytest.raises(ValueError, match="expected at least one token"):
        session.forward(torch.tensor([], dtype=torch.long))


def test_a_streamed_oracle_holds_one_layers_weights_at_a_time_and_gives_the_same_logits():
    """``stream_layers``: the weight cache never holds two layers' weights (the full fp32 model never exists), the
    logits are the cached oracle's bit for bit, and the run manifest's policy says so."""
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    ids = torch.randint(3, ckpt.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    streamed = OracleModel(ckpt, stream_layers=True)
    held: list[set[int]] = []
    read = streamed.w

    def w(name):
        out = read(name)
        held.append({int(k.split(".")[1]) for k in streamed._cache if k.startswith("layers.")})
        return out

    streamed.w = w
    session = streamed.session()
    got = torch.cat([session.prefill(ids[:37]), *(session.step(int(t))[None] for t in ids[37:])])
    cached = OracleModel(ckpt).session()
    want = torch.cat([cached.prefill(ids[:37]), *(cached.step(int(t))[None] for t in ids[37:])])
    assert torch.equal(got, want)
    assert max(len(h) for h in held) == 1 and {i for h in held for i in h} == set(range(ckpt.config.n_layers))
    assert streamed.weight_policy.startswith("one layer at a time")
    assert OracleModel(ckpt).weight_policy.startswith("all it reads")
