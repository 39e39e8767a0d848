"""transformers' DeepseekV4ForCausalLM with several sequences (TransformersDecoder.forward / fork / rollback): forks
and rollbacks equal cold runs, batched rows equal their own runs, and transformers' own limits pinned as findings
(its DSv4 cache layers are not croppable; a padded row's compressor pools the padding, transformers #45938)."""

from __future__ import annotations

import pytest
import torch

from fidelity.decoders import TransformersDecoder
from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Call, DecoderError
from fidelity.model.config import ModelConfig
from tests.hf_reference import random_hf_model

CFG = ModelConfig.preset("tiny").replace(vocab_size=512)
P = 140  # past the window (128) and the first HCA window (128)


@pytest.fixture(scope="module")
def model():
    """The model, with no decoder on it (a decoder hooks the model it is given)."""
    return random_hf_model(CFG, seed=0)


def _decoder() -> TransformersDecoder:
    """A decoder on its own copy of the model (random_hf_model is deterministic)."""
    return TransformersDecoder(random_hf_model(CFG, seed=0), CFG)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _cold(*chunks: torch.Tensor) -> list[torch.Tensor]:
    """A new decoder fed ``chunks`` one call each: the logits of every call."""
    dec = _decoder()
    return [dec.prefill(c) for c in chunks]


def test_every_capability_is_served():
    assert _decoder().capabilities() == {BATCH: None, FORK: None, ROLLBACK: None}


def test_a_fork_equals_a_cold_run_of_its_prefix():
    prompt, a, b = _ids(P, 1), _ids(5, 2), _ids(7, 3)
    dec = _decoder()
    dec.prefill(prompt)
    dec.fork(1, 0, P)
    got_b = dec.forward([Call(1, b, P)])[0]
    got_a = dec.forward([Call(0, a, P)])[0]
    assert _rel(got_b, _cold(prompt, b)[1]) < 1e-5
    assert torch.equal(got_a, _cold(prompt, a)[1])  # the parent is untouched by its fork
    # at the start of a kept call (sequence 0 has moved on to P + 5)
    dec.fork(2, 0, P)
    assert _rel(dec.forward([Call(2, b, P)])[0], _cold(prompt, b)[1]) < 1e-5
    with pytest.raises(DecoderError, match=r"cannot fork sequence 0 at position 70: its cache is kept only at "
                                           r"positions \[0, 140, 145\]") as err:
        dec.fork(3, 0, 70)
    assert "\n" not in str(err.value)


def test_a_rollback_equals_a_sequence_that_never_saw_the_rejected_tokens():
    prompt, proposed, nxt = _ids(P, 4), _ids(6, 5), _ids(3, 6)
    dec = _decoder()
    dec.prefill(prompt)
    dec.forward([Call(0, proposed, P)])  # a speculative block: keep 2 of 6 (P + 2 closes no CSA window, P + 6 does)
    dec.rollback(0, P + 2)
    assert dec.pos == P + 2
    got = dec.forward([Call(0, nxt, P + 2)])[0]
    never = _cold(prompt, proposed[:2], nxt)[2]
    assert torch.equal(got, never), _rel(got, never)
    # back into the prompt: the state at 0 restored and P - 10 tokens fed again
    dec.rollback(0, P - 10)
    got = dec.forward([Call(0, nxt, P - 10)])[0]
    assert _rel(got, _cold(prompt[:P - 10], nxt)[1]) < 1e-5


def test_transformers_dsv4_cache_cannot_crop(model):
    """Finding: transformers' DSv4 cache layers declare themselves not croppable, and rightly: crop trims the window
    keys but keeps the compressor state (entries, entry count, buffers), and raises once the window is full. This is
    why rollback restores a copy and replays; if this test fails, transformers changed crop: revisit rollback."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=_ids(60, 7)[None], cache=cache, use_cache=True)
    assert cache.is_croppable is False
    entries = cache.layers[2].entry_count["compressor"]
    cache.crop(-6)
    assert cache.get_seq_length() == 54 and cache.layers[2].entry_count["compressor"] == entries == 15
    model(input_ids=_ids(P, 8)[None], cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="sliding window size was already reached"):
        cache.crop(-1)


def test_rows_of_one_start_and_length_batch_and_equal_their_own_runs():
    a, c, d = _ids(P, 9), _ids(P, 10), _ids(P - 3, 11)
    dec = _decoder()
    first = dec.forward([Call(2, c, 0), Call(0, a, 0), Call(1, d, 0)])  # c and a in one model call, d on its own
    steps = dec.forward([Call(0, torch.tensor([5]), P), Call(2, torch.tensor([7]), P)])
    for got, chunks in ((first[1], (a,)), (first[0], (c,)), (first[2], (d,)), (steps[0], (a, torch.tensor([5]))),
                        (steps[1], (c, torch.tensor([7])))):
        want = _cold(*chunks)[-1]
        assert _rel(got, want) < 1e-5 and _cos(got, want) > 0.999999


def test_finding_a_padded_row_diverges_from_its_own_run_transformers_45938(model):
    """Finding (transformers #45938, the compressor ignores padding): a prompt left-padded into a batch, with the
    attention mask and per-row positions that generate() uses, does not give its own run's logits: its compressors
    pool the pad tokens (measured on this model: max|diff|/max|logit| 0.54, cos 0.968). The unpadded row and a
    right-padded first call agree to fp32 rounding. When this fails, transformers fixed the issue: update
    fidelity.decoders.transformers.BATCHING and let ragged calls share a padded model call."""
    long, short = _ids(150, 12), _ids(137, 13)
    with torch.no_grad():
        own_long, own_short = (model(input_ids=x[None]).logits[0] for x in (long, short))
        pad = torch.zeros(150 - 137, dtype=torch.long)
        ones, zeros = torch.ones(137, dtype=torch.long), torch.zeros_like(pad)
        left = model(input_ids=torch.stack([long, torch.cat([pad, short])]),
                     attention_mask=torch.stack([torch.ones(150, dtype=torch.long), torch.cat([zeros, ones])]),
                     position_ids=torch.stack([torch.arange(150), torch.cat([zeros, torch.arange(137)])])).logits
        right = model(input_ids=torch.stack([long, torch.cat([short, pad])]),
                      attention_mask=torch.stack([torch.ones(150, dtype=torch.long), torch.cat([ones, zeros])]),
                      position_ids=torch.arange(150)[None].expand(2, -1)).logits
    assert _rel(left[0], own_long) < 1e-5 and _rel(right[1, :137], own_short) < 1e-5
    assert _rel(left[1, 13:], own_short) > 0.1 and _cos(left[1, 13:], own_short) < 0.99


def test_calls_that_do_not_continue_their_sequence_are_refused_in_one_line():
    dec = _decoder()
    dec.prefill(_ids(10, 14))
    with pytest.raises(DecoderError, match=r"sequence 0 stands at position 10; a call of 3 tokens starting at 9 "
                                           r"cannot continue it") as err:
        dec.forward([Call(0, _ids(3, 15), 9)])
    assert "\n" not in str(err.value)
    with pytest.raises(DecoderError, match=r"distinct sequences, got sequences \[1, 1\]"):
        dec.forward([Call(1, _ids(3, 15), 0), Call(1, _ids(3, 16), 0)])
    with pytest.raises(DecoderError, match=r"cannot roll sequence 0 back to position 11: it stands at position 10"):
        dec.rollback(0, 11)
