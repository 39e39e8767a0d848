"""Stops over a long multi-turn generation: a chat prompt with user turns, 500+ decode tokens, and an end-of-turn
token deep in the stream; the built-in decoder and a foreign one (transformers, whose own generation config says
where it stops) must stop exactly where the reference stop set says."""

from __future__ import annotations

import pytest
import torch

import fidelity
from fidelity.decoders.transformers import TransformersDecoder
from fidelity.model import text
from fidelity.model.default import default_prompt_ids
from fidelity.outputs.rundir import read_run

CHAT = ("<｜User｜>Write a function that adds two numbers.\n"
        "def add(a, b):\n    return a + b\n<｜end▁of▁sentence｜>"
        "<｜User｜>Now one that subtracts them, with a docstring.\n")
STOP_AT = 520  # the decode step whose token is the end-of-turn marker


@pytest.fixture(scope="module")
def setup():
    ckpt = fidelity.load_checkpoint(fidelity.default_checkpoint())
    tok = text.load(fidelity.default_checkpoint() / "tokenizer.json")
    prompt = text.encode_prompt(tok, CHAT, 0, ckpt.config.vocab_size)
    assert (prompt == 2).sum() == 2 and (prompt == 1).sum() == 1  # two user turns, one finished assistant turn
    cont = default_prompt_ids(ckpt.config.vocab_size, length=STOP_AT + 41)[1:].clone()  # code, no stop id in it
    assert not torch.isin(cont, torch.tensor([1, 2])).any()
    cont[STOP_AT] = 2  # <｜User｜>: the assistant's turn is over
    return ckpt, prompt, cont


def _run(setup, decoder, tmp_path, run_id, cont=None):
    ckpt, prompt, long = setup
    cont = long if cont is None else cont
    return fidelity.run(decoder, ckpt, prompt, len(cont), ("free",), tmp_path, run_id=run_id, stream="given",
                        continuation=cont)


def _stop_rows(res):
    df = read_run(res.run_dir)[0]
    return df[(df["site"] == "stops") & (df["metric"] == "stop_mismatch")]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["production", "transformers"])
def test_both_decoders_stop_exactly_at_the_end_of_turn_after_500_tokens(setup, tmp_path, which):
    decoder = "production" if which == "production" else TransformersDecoder.from_checkpoint(setup[0], "fp32")
    res = _run(setup, decoder, tmp_path, which)
    assert res.manifest["stop_reason"] == "stop" and res.manifest["decode_steps"] == STOP_AT + 1
    rows = _stop_rows(res)
    assert len(rows) == STOP_AT + 1 and rows["value"].sum() == 0 and res.passed


def test_an_engine_that_stops_on_eos_alone_runs_past_the_end_of_turn_and_is_caught(setup, tmp_path):
    decoder = TransformersDecoder.from_checkpoint(setup[0], "fp32")
    decoder.model.generation_config.eos_token_id = 1  # the port forgot the end-of-turn id
    short = setup[2][:40].clone()
    short[20] = 2
    res = _run(setup, decoder, tmp_path, "eos-only", short)
    assert res.manifest["decode_steps"] == 40 and res.manifest["stop_reason"] == "length"
    assert res.manifest["decoder_stop_ids"] == [1]
    div = res.first_divergence
    assert (div.site, div.metric, div.step) == ("stops", "stop_mismatch", 20)  # the call that picked token 20
