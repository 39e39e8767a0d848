"""The oracle's growing caches (``oracles.cache``) change no bit of what it computes: ``Rows`` reads as the
concatenation of what was appended, ``gather_rows`` as indexing the concatenated tables, and a multi-chunk run
(prefill chunks across the window and compression boundaries, sampled rows, decode steps) records the same bits in
every site of the free, layer and op modes as with the plain concatenations they replace."""

from __future__ import annotations

import pytest
import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder
from fidelity.model.synthesize import synthesize
from oracles import OracleModel, Reference, cache, model, op_mode

CALLS = [300, 1, 4, 127, 128, 259, 1, 1, 1, 1]  # prefill chunks, then decode steps


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _odd_values(*shape: int, seed: int) -> torch.Tensor:
    """Random fp32 values with NaN, +-inf and -0.0 among them."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    flat = t.view(-1)
    flat[::7], flat[1::11], flat[2::13], flat[3::17] = float("nan"), float("inf"), float("-inf"), -0.0
    return t


def test_rows_read_as_the_concatenation_of_what_was_appended():
    rows, parts = cache.Rows(), []
    assert _same(rows.all(3, torch.zeros(1, dtype=torch.float64)), torch.zeros((0, 3), dtype=torch.float64))
    for k, m in enumerate([5, 0, 1, 7, 0, 2, 30, 1]):  # empty appends and several growths
        part = _odd_values(m, 3, seed=k)
        rows.append(part)
        parts.append(part)
        assert _same(rows.all(3, part), torch.cat(parts))


def test_gather_rows_reads_what_indexing_the_concatenated_tables_reads():
    tables = (_odd_values(9, 4, seed=0), _odd_values(0, 4, seed=1), _odd_values(20, 4, seed=2), torch.zeros(1, 4))
    rows = torch.randint(0, 30, (6, 11), generator=torch.Generator().manual_seed(3))
    assert _same(cache.gather_rows(tables, rows), torch.cat(tables)[rows])
    with pytest.raises(IndexError):
        cache.gather_rows((torch.zeros(0, 4),), rows)


def _plain(monkeypatch) -> None:
    """The concatenations the caches replace: every earlier row concatenated at each read, tables built whole."""

    def append(self, rows: torch.Tensor) -> None:
        self.parts = [*getattr(self, "parts", []), rows]

    def all_rows(self, width: int, like: torch.Tensor) -> torch.Tensor:
        parts = getattr(self, "parts", [])
        return torch.cat(parts) if parts else like.new_zeros((0, width))

    def gather(tables, rows):
        return torch.cat(tables)[rows]

    monkeypatch.setattr(cache.Rows, "append", append)
    monkeypatch.setattr(cache.Rows, "all", all_rows)
    monkeypatch.setattr(model, "gather_rows", gather)
    monkeypatch.setattr(op_mode, "gather_rows", gather)
    whole = Recorder.get

    def copied(self, site, rows=None):  # every read a copy of all the call's rows, then the rows asked for
        out = whole(self, site).clone()
        return out if rows is None else out[rows]

    monkeypatch.setattr(Recorder, "get", copied)


def _records(oracle: OracleModel, ids: torch.Tensor) -> list[dict[str, list[tuple[int, torch.Tensor]]]]:
    """Every record of each call: free mode on every row (also the feed of the other two), layer and op modes on
    three sampled rows of each prefill chunk."""
    refs = {mode: Reference(oracle, mode) for mode in ("free", "layer", "op")}
    out = []
    for k, chunk in enumerate(ids.split(CALLS)):
        feed = refs["free"].run(chunk)
        rows = torch.tensor([0, len(chunk) // 2, len(chunk) - 1]).unique() if k < 6 else None
        out += [feed.records, *(refs[mode].run(chunk, feed, rows).records for mode in ("layer", "op"))]
    return out


def test_a_multi_chunk_run_records_the_same_bits_as_with_plain_concatenations(monkeypatch):
    oracle = OracleModel(synthesize(ModelConfig.preset("tiny"), seed=0))
    ids = torch.randint(3, 4096, (sum(CALLS),), generator=torch.Generator().manual_seed(5))
    fast = _records(oracle, ids)
    _plain(monkeypatch)
    plain = _records(oracle, ids)
    assert len(fast) == len(plain)
    for call, (a, b) in enumerate(zip(fast, plain, strict=True)):
        assert a.keys() == b.keys(), call
        for site in a:
            assert len(a[site]) == len(b[site]), (call, site)
            for (_, x), (_, y) in zip(a[site], b[site], strict=True):
                assert _same(x, y), (call, site)
    assert any(s.endswith("indexer.scores") for s in fast[1]) and any(s.endswith("attn.core") for s in fast[2])
