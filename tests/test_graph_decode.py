"""Graph decode (``fidelity.decoders.production.graph_decode``): fixed-shape, sync-free decode steps give the eager
session's logits and cache bytes bit for bit (profiles, faults, window wrap-around, top-k growing past the
visible entries), read no tensor value on the host, and refuse what they cannot do. The CUDA-graph replay
itself is tested on the GPU (``tests/gpu/test_production_cuda.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from fidelity.decoders.base import ContextError
from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.faults import inject
from fidelity.decoders.production.graph_decode import GraphDecodeSession
from fidelity.decoders.production.shapes import window_decode_idx, window_idx_on_device
from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder
from fidelity.model.synthesize import synthesize

TINY = ModelConfig.preset("tiny")  # window 128, index_topk 32, ratios (0, 0, 4, 128, 4, 128), hash layers
PROMPT, TOTAL = 120, 134  # decode crosses the window wrap (t = 127), compressions, and 32 visible keys (t = 127)


@pytest.fixture(scope="module")
def tiny():
    return synthesize(TINY, seed=0)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def _decode(session, ids: torch.Tensor, prompt: int = PROMPT) -> torch.Tensor:
    """The prefill's last logits, then each decode step's: [1 + len(ids) - prompt, vocab]."""
    out = [session.prefill(ids[:prompt])[-1]]
    return torch.stack(out + [session.step(int(t)) for t in ids[prompt:]])


def _state(session) -> dict[str, torch.Tensor]:
    """Every cache tensor as raw bytes (float8 storage compared bit for bit), by path."""
    out = {}
    for i, layer in enumerate(session.layers):
        for part in ("kv", "keys", "carry", "index_carry"):
            obj = getattr(layer, part)
            for name, t in (vars(obj).items() if obj is not None else ()):
                if isinstance(t, torch.Tensor):
                    out[f"{i}.{part}.{name}"] = t.view(torch.uint8) if t.element_size() == 1 else t
    return out


def _same_state(a, b) -> list[str]:
    sa, sb = _state(a), _state(b)
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.mark.parametrize("profile", ["reference", "fp4-indexer-packed", "fp8-kv-storage", "fp32-residual"])
def test_graph_decode_equals_eager_decode_bit_for_bit(tiny, profile):
    ids = _ids(TOTAL)
    eager = ProductionModel(tiny, profile, max_context=TOTAL + 2).session()
    graph = GraphDecodeSession(ProductionModel(tiny, profile, max_context=TOTAL + 2), graphs=False)
    a, b = _decode(eager, ids), _decode(graph, ids)
    assert torch.equal(a, b), (a != b).sum()
    assert _same_state(eager, graph) == []
    assert graph.pos == eager.pos == TOTAL


@pytest.fixture(scope="module")
def clean_steps(tiny) -> torch.Tensor:
    ids = _ids(TOTAL)
    s = ProductionModel(tiny, "reference", max_context=TOTAL + 2).session()
    s.prefill(ids[:PROMPT])
    return torch.stack([s.step(int(t)) for t in ids[PROMPT:]])


@pytest.mark.parametrize("fault", ["causal-off-by-one", "window-127", "window-no-self", "topk-cap-half",
                                   "compressed-rope-last", "routing-bias-in-weights"])
def test_graph_decode_carries_the_decode_faults(tiny, clean_steps, fault):
    """Each injected port bug changes the graph session's logits exactly as it changes the eager session's. Each
    acts on these steps directly, not through a selection among near ties: an extra or a missing attended row at
    every step (causal-off-by-one: an HCA entry not yet written; window-no-self; window-127 from t = 127), only
    16 of the 30-33 compressed entries attended (topk-cap-half), the RoPE of the compressed entries the decode
    steps write, which the attention reads (compressed-rope-last: every CSA entry while at most 32 are visible,
    the HCA entry of t = 127), the routing weights of the non-hash layers (routing-bias-in-weights).
    ``indexer-key-width`` acts only through the indexer's picks: its own test below builds the case in which they
    must differ."""
    ids = _ids(TOTAL)
    eager = ProductionModel(tiny, "reference", max_context=TOTAL + 2).session()
    graph = GraphDecodeSession(ProductionModel(tiny, "reference", max_context=TOTAL + 2), graphs=False)
    eager.prefill(ids[:PROMPT])
    graph.prefill(ids[:PROMPT])
    with inject(fault):
        a = torch.stack([eager.step(int(t)) for t in ids[PROMPT:]])
        b = torch.stack([graph.step(int(t)) for t in ids[PROMPT:]])
    assert torch.equal(a, b)
    assert not torch.equal(a, clean_steps)  # the fault shows in these steps


KEY_PROMPT, KEY_TOTAL = 200, 208  # 50 indexer entries after the prompt; the decode steps write entries 50 and 51
INDEXER_SITES = r"L\d+\.indexer\.(scores|topk)"
SCORE_MARGIN_ULPS = 16  # bf16 ulps of the row's largest score: far beyond any machine's rounding of the scores


def _csa_layers() -> list[int]:
    return [i for i, kind in enumerate(TINY.layer_kinds) if kind == "csa"]


def _decode_records(rec: Recorder, layer: int, name: str) -> list[torch.Tensor]:
    """The decode steps' records of ``L{layer}.indexer.{name}`` (the prefill's, the first, left out)."""
    return [t for _, t in rec.records[f"L{layer}.indexer.{name}"][1:]]


def _outranking_margin(scores: torch.Tensor, k: int) -> float:
    """How far the best entry with id >= k scores above the worst with id < k: positive means the top-k of
    ``scores`` [n] is not the k lowest ids."""
    return float(scores[k:].max() - scores[:k].min())


def test_graph_decode_carries_the_indexer_key_width_fault(tiny):
    """``indexer-key-width`` zeroes the rope dims of every indexer key written while it is injected, and the tiny
    shape's indexer keys are rope dims only (index_head_dim = rope_head_dim = 64): injected from the prefill on,
    every key is zero, every index score exactly 0, and the top-k keeps the 32 lowest of the 50-52 entry ids
    whatever the rounding. The clean scores rank an entry past id 31 above one below it by far more than
    rounding at every decode step, so the picks differ; then the logits must differ too."""
    assert TINY.index_head_dim == TINY.rope_head_dim  # the fault zeroes whole keys
    ids, k = _ids(KEY_TOTAL), TINY.index_topk
    clean_rec, fault_rec = Recorder([INDEXER_SITES]), Recorder([INDEXER_SITES])
    clean_session = ProductionModel(tiny, "reference", max_context=KEY_TOTAL + 2).session(clean_rec)
    clean = _decode(clean_session, ids, KEY_PROMPT)
    graph = GraphDecodeSession(ProductionModel(tiny, "reference", max_context=KEY_TOTAL + 2), graphs=False)
    with inject("indexer-key-width"):
        a = _decode(ProductionModel(tiny, "reference", max_context=KEY_TOTAL + 2).session(fault_rec), ids, KEY_PROMPT)
        b = _decode(graph, ids, KEY_PROMPT)
    for layer in _csa_layers():
        for scores, faulted, picks in zip(_decode_records(clean_rec, layer, "scores"),
                                          _decode_records(fault_rec, layer, "scores"),
                                          _decode_records(fault_rec, layer, "topk"), strict=True):
            assert scores.shape[1] > k  # the top-k selects among more entries than it keeps
            assert torch.equal(faulted, torch.zeros_like(faulted)) and torch.equal(picks[0], torch.arange(k))
            margin = SCORE_MARGIN_ULPS * torch.finfo(torch.bfloat16).eps * float(scores.abs().max())
            assert _outranking_margin(scores[0], k) > margin, (layer, scores)
    written = slice(KEY_PROMPT // 4, KEY_TOTAL // 4)  # the entries the decode steps wrote
    for layer in _csa_layers():
        assert not graph.layers[layer].keys.read(written).any()
        assert clean_session.layers[layer].keys.read(written).any(dim=1).all()
    assert torch.equal(a, b)
    assert not torch.equal(a[1:], clean[1:])  # the fault shows in the decode steps


@pytest.mark.parametrize("profile", ["reference", "fp8-kv-storage"])
def test_graph_decode_takes_a_wider_topk_injected_after_its_first_steps(tiny, profile):
    """Fault ``index-topk-hardcoded`` (top-k 2 * index_topk) injected after the production decoder's graph session
    sized its buffers and ran its first decode steps: it takes effect in graph decode (no switch to eager; on CUDA
    the changed faults re-capture, ``GraphDecodeSession._graph_step``), the steps give the eager session's logits
    under the same schedule bit for bit, and the gather buffer is re-sized as the eager session's is (not replaced
    by a fresh tensor each step) where graph decode gathers (packed FP8 rows); from a flat bf16 store its attention
    reads the rows in place, and the buffer keeps its size. 50-52 compressed entries are visible: more than
    index_topk (32), under twice it."""
    ids = _ids(KEY_TOTAL)
    schedule = [() if t < 3 else ("index-topk-hardcoded",) for t in range(KEY_TOTAL - KEY_PROMPT)]
    dec = ProductionDecoder(tiny, profile, max_context=KEY_TOTAL, graphs=True)
    runs, sessions = {}, {"graph": dec}
    for name in ("clean", "eager", "graph"):
        s = sessions.setdefault(name, ProductionModel(tiny, profile, max_context=KEY_TOTAL).session())
        s.prefill(ids[:KEY_PROMPT])
        out = []
        for t, faults in zip(ids[KEY_PROMPT:], schedule, strict=True):
            with inject(*(faults if name != "clean" else ())):
                out.append(s.step(int(t)))
        runs[name] = torch.stack(out)
    assert torch.equal(runs["graph"], runs["eager"])
    assert torch.equal(runs["graph"][:3], runs["clean"][:3])
    assert not torch.equal(runs["graph"][3:], runs["clean"][3:])  # the fault shows once injected
    info = dec.info()
    assert isinstance(dec.session, GraphDecodeSession) and dec.pos == KEY_TOTAL
    assert info["decode_graphs"] and info["decode_graphs_off"] is None
    rows = [(g.gather.shape[0], e.gather.shape[0]) for g, e in zip(dec.session.layers, sessions["eager"].layers,
                                                                    strict=True)]
    if profile == "reference":  # nothing gathered: the rows are read where the store holds them
        assert all(a <= b for a, b in rows) and any(a < b for a, b in rows)
    else:  # graph decode reads no slots buffer: decode_slots gives its own
        assert all(a == b for a, b in rows)


@contextmanager
def _no_host_reads() -> Iterator[None]:
    """Make every Python-level read of a tensor's value raise (item, tolist, bool/int/float, nonzero, unique)."""
    def refuse(*_a, **_k):
        raise AssertionError("host read of a tensor value")

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    saved_fn = {n: getattr(torch, n) for n in ("unique", "nonzero")}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        for n in saved_fn:
            setattr(torch, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        for n, f in saved_fn.items():
            setattr(torch, n, f)


def _step_body(session, token: int) -> None:
    """What ``step`` runs between its host-side checks and its bookkeeping, for a token at ``session.pos``."""
    policy = session.decode
    policy.ids_dev.fill_(token)
    policy.pos_dev.fill_(session.pos)
    session._forward(policy.ids_dev, policy.pos_dev)


def test_graph_decode_step_reads_no_tensor_value_on_the_host(tiny):
    """The detector catches the eager session's routing (``unique().tolist()``); the graph step passes it, so it
    issues no device-to-host sync that would break a CUDA-graph capture."""
    ids = _ids(PROMPT + 1)
    eager = ProductionModel(tiny, "reference", max_context=TOTAL).session()
    eager.prefill(ids[:PROMPT])
    with _no_host_reads(), pytest.raises(AssertionError, match="host read"):
        eager._forward(ids[PROMPT:], torch.tensor([PROMPT]))
    for profile in ("reference", "fp4-indexer-packed", "fp8-kv-storage"):
        graph = GraphDecodeSession(ProductionModel(tiny, profile, max_context=TOTAL), graphs=False)
        graph.prefill(ids[:PROMPT])
        for token in (5, 6, 7, 8):  # one full compression block
            with _no_host_reads():
                _step_body(graph, token)
            graph.pos += 1


@pytest.mark.parametrize("fault", [None, "window-127", "window-no-self"])
def test_window_indices_on_device_match_the_host_rule(fault):
    with inject(*([fault] if fault else [])):
        for t in (0, 1, 5, 126, 127, 128, 129, 255, 256, 1000):
            assert torch.equal(window_idx_on_device(torch.tensor([t]), 128), window_decode_idx(t, 128)), t


def test_graph_decode_refuses_what_it_cannot_run(tiny):
    model = ProductionModel(tiny, "reference", max_context=PROMPT + 1)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GraphDecodeSession(model, graphs=True)
    s = GraphDecodeSession(model, graphs=False)
    ids = _ids(PROMPT + 2)
    s.prefill(ids[:PROMPT])
    before = {k: v.clone() for k, v in _state(s).items()}
    with inject("cache-concat-growth"), pytest.raises(ValueError, match="cache-concat-growth"):
        s.step(int(ids[PROMPT]))
    s.step(int(ids[PROMPT]))
    with pytest.raises(ContextError, match="max_context"):
        s.step(int(ids[PROMPT + 1]))
    assert s.pos == PROMPT + 1
    assert any(not torch.equal(before[k], v) for k, v in _state(s).items())  # the one valid step wrote
