"""Known-answer tests of the decode-loop hygiene (fidelity.model.sampling) and the sampler-agreement probe."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sampling import (
    Generation,
    Sampler,
    SamplerConfig,
    StopSet,
    TokenizerFileError,
    apply_repetition_penalty,
    draw_noise,
    generate,
    sample_scores,
    sampler_problems,
    top_p_mask,
)
from probes.sampler import sampler_agreement

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
V_CHAT = 128830


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- config ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"seed": -3}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_sampler_config_names_the_field(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 123},
     {"temperature": 0, "top_p": 1, "repetition_penalty": 1e-3, "seed": 0}],
)
def test_good_configs_are_accepted_and_kept_as_given(kwargs: dict):
    assert sampler_problems(**{**{"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "seed": 0},
                               **kwargs}) == {}
    cfg = SamplerConfig(**kwargs)
    for field, value in kwargs.items():
        assert getattr(cfg, field) == value
    if not kwargs:  # the defaults are greedy and penalty-free
        assert (cfg.temperature, cfg.top_p, cfg.repetition_penalty, cfg.seed) == (0.0, 1.0, 1.0, 0)


# ---- the draw -------------------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_and_ignores_seed():
    for seed in range(5):
        logits = randn(1000, seed=seed)
        for s in (0, 99):
            assert Sampler(SamplerConfig(seed=s)).pick(logits) == int(logits.argmax())


def test_draw_matches_the_reference_formula():
    """argmax(log p - log E) == the reference's argmax(softmax(logits / T) / E) with the same E."""
    cfg = SamplerConfig(temperature=0.8, seed=7)
    for step in range(30):
        logits = randn(257, seed=step)
        noise = draw_noise(257, cfg.seed, step)
        ref = (torch.softmax(logits / 0.8, dim=-1, dtype=torch.float32) / noise).argmax()
        assert int(sample_scores(logits, None, cfg, noise).argmax()) == int(ref)


def test_same_seed_same_picks_and_different_seeds_differ():
    logits = torch.zeros(64)  # flat: every pick is decided by the noise alone
    picks = {}
    for seed in (3, 3, 4):
        s = Sampler(SamplerConfig(temperature=1.0, seed=seed))
        picks.setdefault(seed, []).append([s.pick(logits) for _ in range(50)])
    assert picks[3][0] == picks[3][1]
    assert picks[3][0] != picks[4][0]
    assert len(set(picks[3][0])) > 10  # the step changes the draw


def test_draw_at_step_k_does_not_depend_on_earlier_steps():
    cfg = SamplerConfig(temperature=1.0, seed=11)
    busy = Sampler(cfg)
    for i in range(17):  # earlier draws with other logits and histories
        busy.pick(randn(100, seed=100 + i), torch.tensor([i, i + 1]))
    logits = randn(100, seed=5)
    assert busy.step == 17
    assert busy.pick(logits) == Sampler(cfg).pick(logits, step=17)
    assert torch.equal(draw_noise(100, 11, 17), draw_noise(100, 11, 17))
    assert not torch.equal(draw_noise(100, 11, 17), draw_noise(100, 11, 18))


def test_noise_is_drawn_on_cpu_and_applied_on_the_logits_device():
    noise = draw_noise(10, 0, 0)
    assert noise.device.type == "cpu" and noise.dtype == torch.float32 and bool((noise > 0).all())
    logits = randn(10).to(torch.bfloat16)
    assert sample_scores(logits, None, SamplerConfig(temperature=1.0), noise).device == logits.device


def test_exp_argmax_draw_matches_softmax_frequencies():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    s = Sampler(SamplerConfig(temperature=1.0, seed=2024))
    n = 20_000
    logits = probs.log()
    counts = torch.bincount(torch.tensor([s.pick(logits) for _ in range(n)]), minlength=6).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 35.0  # 5 dof: p(chi2 > 35) ~ 1.5e-6; a wrong draw gives chi2 in the hundreds


def test_temperature_and_top_p_reshape_the_sampled_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    s = Sampler(SamplerConfig(temperature=0.5, top_p=0.7, seed=1))
    n = 4000
    counts = torch.bincount(torch.tensor([s.pick(probs.log()) for _ in range(n)]), minlength=4).double()
    sharp = probs.double() ** 2  # T = 0.5 squares p; nucleus >= 0.7 of the sharpened mass = tokens {0, 1}
    expected = torch.zeros(4, dtype=torch.float64)
    kept = sharp / sharp.sum()
    assert float(kept[0]) < 0.7 < float(kept[0] + kept[1])
    expected[:2] = kept[:2] / kept[:2].sum() * n
    assert counts[2:].sum() == 0
    chi2 = float(((counts[:2] - expected[:2]) ** 2 / expected[:2]).sum())
    assert chi2 < 25.0


# ---- repetition penalty ---------------------------------------------------------------------------------------


def test_repetition_penalty_known_values():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1, 0]), 2.0)
    assert torch.equal(out, torch.tensor([1.0, -2.0, 0.5, 3.0]))  # duplicates penalised once
    assert torch.equal(apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long), 2.0), logits)


PickFn = Callable[[torch.Tensor, torch.Tensor, int], int]


def demotes_prompt_only_token(pick: PickFn) -> bool:
    """Token 5 is greedy-best but appears only in the prompt; a penalty of 2 must hand the pick to token 6."""
    logits = torch.zeros(10)
    logits[5], logits[6] = 2.0, 1.5
    prompt, generated = torch.tensor([BOS, 5, 3]), torch.tensor([7, 8])
    return pick(logits, torch.cat((prompt, generated)), len(prompt)) == 6


def test_repetition_penalty_covers_prompt_tokens_and_the_mutant_does_not():
    cfg = SamplerConfig(repetition_penalty=2.0)

    def ours(logits: torch.Tensor, history: torch.Tensor, prompt_len: int) -> int:
        return Sampler(cfg).pick(logits, history)

    def ignores_prompt(logits: torch.Tensor, history: torch.Tensor, prompt_len: int) -> int:  # the port bug
        return Sampler(cfg).pick(logits, history[prompt_len:])

    assert demotes_prompt_only_token(ours)
    assert not demotes_prompt_only_token(ignores_prompt)


def test_repetition_window_penalises_only_the_last_n_ids_of_prompt_and_generated():
    logits = torch.tensor([2.0, 2.0, 2.0, 2.0, -1.0])
    history = torch.tensor([0, 1, 2, 3, 4])  # the prompt 0, 1, 2, then the generated 3, 4
    out = sample_scores(logits, history, SamplerConfig(repetition_penalty=2.0, repetition_window=3), None)
    assert torch.equal(out, torch.tensor([2.0, 2.0, 1.0, 1.0, -2.0]))  # ids 2, 3, 4: the prompt's last id included
    whole = sample_scores(logits, history, SamplerConfig(repetition_penalty=2.0), None)
    assert torch.equal(whole, torch.tensor([1.0, 1.0, 1.0, 1.0, -2.0]))  # window 0: every id
    wide = sample_scores(logits, history, SamplerConfig(repetition_penalty=2.0, repetition_window=99), None)
    assert torch.equal(wide, whole)


def test_repetition_window_reaches_into_the_prompt_and_the_mutant_does_not():
    """A window of 4 after two generated ids holds the prompt's last two ids (5, 3): the pick moves to 6. The port
    bug keeps its window over the generated ids only, so 5 stays unpenalised."""
    cfg = SamplerConfig(repetition_penalty=2.0, repetition_window=4)

    def ours(logits: torch.Tensor, history: torch.Tensor, prompt_len: int) -> int:
        return Sampler(cfg).pick(logits, history)

    def window_of_generated(logits: torch.Tensor, history: torch.Tensor, prompt_len: int) -> int:
        return Sampler(cfg).pick(logits, history[prompt_len:])

    assert demotes_prompt_only_token(ours)
    assert not demotes_prompt_only_token(window_of_generated)


def test_repetition_window_must_be_a_count():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="repetition_window: expected an integer >= 0"):
            SamplerConfig(repetition_window=bad)


# ---- top-p ----------------------------------------------------------------------------------------------------


def test_top_p_keeps_exactly_the_expected_nucleus():
    probs = torch.tensor([0.3, 0.05, 0.5, 0.15])  # sorted: idx 2 (0.5), 0 (0.3), 3 (0.15), 1 (0.05)
    logp = torch.log_softmax(probs.log(), dim=-1)
    cases = {0.1: {2}, 0.45: {2}, 0.75: {2, 0}, 0.85: {2, 0, 3}, 0.99: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, nucleus in cases.items():
        kept = set(torch.nonzero(top_p_mask(logp, top_p)).flatten().tolist())
        assert kept == nucleus, top_p
    peaked = torch.log_softmax(torch.tensor([0.0, 50.0, 0.0]), dim=-1)
    assert top_p_mask(peaked, 1e-9).sum() == 1  # always at least one token


def test_top_p_tiny_nucleus_samples_only_the_top_token():
    s = Sampler(SamplerConfig(temperature=1.0, top_p=0.05, seed=9))
    logits = torch.tensor([0.0, 0.1, -0.1, 0.05])
    assert {s.pick(logits) for _ in range(100)} == {1}


# ---- stop tokens ----------------------------------------------------------------------------------------------


def dsv4_added_tokens() -> list[dict]:
    names = {
        BOS: "<｜begin▁of▁sentence｜>",
        EOS: "<｜end▁of▁sentence｜>",
        USER: "<｜User｜>",
        ASSISTANT: "<｜Assistant｜>",
        THINK: "<think>",
        END_THINK: "</think>",
    }
    return [{"id": i, "content": c, "special": True, "single_word": False} for i, c in names.items()]


def write(path: Path, obj: object) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False), encoding="utf-8")
    return path


def test_stop_set_from_config_and_extra():
    cfg = ModelConfig().replace(eos_token_id=1, stop_token_ids=(1, 7))
    stops = StopSet.from_config(cfg, extra=(USER,))
    assert list(stops) == [1, 7, USER] and 1 in stops and torch.tensor(7) in stops and 2 not in stops


def test_the_release_presets_stop_on_eos_and_the_user_turn_marker():
    for name in ("flash", "pro"):
        cfg = ModelConfig.preset(name)
        assert list(StopSet.from_config(cfg)) == [1, USER]
        assert cfg.to_hf_dict()["eos_token_id"] == [1, USER]
        assert ModelConfig.from_dict(cfg.to_hf_dict()).stop_token_ids == (USER,)


def test_stop_set_from_each_tokenizer_file_kind(tmp_path: Path):
    tok = write(tmp_path / "tokenizer.json", {"added_tokens": dsv4_added_tokens(), "model": {"vocab": {"a": 2}}})
    decoder = {str(t["id"]): {"content": t["content"], "special": True} for t in dsv4_added_tokens()}
    tcfg = write(
        tmp_path / "tokenizer_config.json",
        {"eos_token": {"content": "<｜end▁of▁sentence｜>"}, "added_tokens_decoder": decoder},
    )
    gen = write(tmp_path / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1, 5]})
    assert set(StopSet.from_tokenizer_file(tok)) == {EOS, USER}
    assert set(StopSet.from_tokenizer_file(tcfg)) == {EOS, USER}
    assert set(StopSet.from_tokenizer_file(gen)) == {1, 5}
    assert set(StopSet.from_tokenizer_file(tmp_path)) == {EOS, USER, 5}
    for not_stop in (BOS, ASSISTANT, THINK, END_THINK):
        assert not_stop not in StopSet.from_tokenizer_file(tok)


@pytest.mark.parametrize(
    ("name", "content", "field"),
    [
        ("tokenizer.json", "{not json", "not valid JSON"),
        ("tokenizer.json", [1, 2], "expected a JSON object"),
        ("tokenizer.json", {"added_tokens": {"a": 1}}, "added_tokens"),
        ("tokenizer.json", {"added_tokens": [{"content": "<｜User｜>"}]}, r"added_tokens\[0\]"),
        ("tokenizer.json", {"added_tokens": [{"id": 3, "content": "<｜User｜>"}]}, "no EOS token"),
        ("tokenizer_config.json", {"eos_token": "</s>", "added_tokens_decoder": {}}, "eos_token"),
        ("tokenizer_config.json", {"eos_token": 5}, "eos_token"),
        ("tokenizer_config.json", {"added_tokens_decoder": {"x": {"content": "a"}}}, "added_tokens_decoder"),
        ("generation_config.json", {"eos_token_id": "1"}, "eos_token_id"),
        ("generation_config.json", {"eos_token_id": []}, "eos_token_id"),
        ("config.json", {"hidden_size": 4}, "no stop-token field"),
    ],
)
def test_malformed_tokenizer_files_name_the_file_and_field(tmp_path: Path, name: str, content: object, field: str):
    path = write(tmp_path / name, content)
    with pytest.raises(TokenizerFileError, match=field) as err:
        StopSet.from_tokenizer_file(path)
    assert str(path) in str(err.value)


def test_missing_tokenizer_file_and_empty_directory(tmp_path: Path):
    with pytest.raises(TokenizerFileError, match="file not found"):
        StopSet.from_tokenizer_file(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerFileError, match="no tokenizer file"):
        StopSet.from_tokenizer_file(tmp_path)


# ---- generate -------------------------------------------------------------------------------------------------


class ScriptedModel:
    """A fake session whose greedy next token follows ``script``; records the calls."""

    def __init__(self, script: list[int], vocab: int = V_CHAT) -> None:
        self.script, self.vocab, self.calls = script, vocab, []

    def logits(self) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[self.script[min(len(self.calls) - 1, len(self.script) - 1)]] = 10.0
        return out

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        self.calls.append(("prefill", prompt.tolist()))
        return self.logits()

    def step(self, token: int) -> torch.Tensor:
        self.calls.append(("step", token))
        return self.logits()


PROMPT = [BOS, USER, 42, ASSISTANT, END_THINK]


def test_generate_stops_on_eos_and_includes_it():
    model = ScriptedModel([5, 6, EOS, 9])
    out = generate(model.prefill, model.step, PROMPT, 10, Sampler(), StopSet.from_config(ModelConfig()))
    assert out == Generation([5, 6, EOS], "stop") and out.reason == "stop"
    assert model.calls == [("prefill", PROMPT), ("step", 5), ("step", 6)]


def test_generate_stops_on_end_of_turn_from_a_tokenizer_file_and_the_mutant_runs_to_length(tmp_path: Path):
    tok = write(tmp_path / "tokenizer.json", {"added_tokens": dsv4_added_tokens()})
    script = [THINK, 7, END_THINK, 8, USER, 9, 9, 9, 9, 9, 9, 9]
    ids, reason = generate(
        (m := ScriptedModel(script)).prefill, m.step, PROMPT, 8, Sampler(), StopSet.from_tokenizer_file(tok)
    )
    assert (ids, reason) == ([THINK, 7, END_THINK, 8, USER], "stop")
    eos_only = StopSet.of([EOS])  # mutant: the end-of-turn token is missing
    ids, reason = generate((m := ScriptedModel(script)).prefill, m.step, PROMPT, 8, Sampler(), eos_only)
    assert reason == "length" and len(ids) == 8 and USER in ids
    assert len(m.calls) == 8  # prefill + 7 steps: no forward after the last pick


def test_generate_is_reproducible_and_penalises_prompt_tokens():
    vocab = 50
    base = randn(vocab, seed=3)

    def run(seed: int) -> list[int]:
        cfg = SamplerConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.3, seed=seed)
        return generate(lambda p: base, lambda t: base, [0, 2, 3], 30, Sampler(cfg), [EOS]).ids

    assert run(1) == run(1) and run(1) != run(2)
    top = int(base.argmax())
    greedy = generate(lambda p: base, lambda t: base, [top], 1, Sampler(SamplerConfig(repetition_penalty=100.0)), [])
    assert greedy.ids != [top]


def test_generate_edge_cases():
    model = ScriptedModel([5])
    assert generate(model.prefill, model.step, [BOS], 0, Sampler(), [EOS]) == Generation([], "length")
    assert model.calls == []
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model.prefill, model.step, [BOS], -1, Sampler(), [EOS])
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(model.prefill, model.step, [], 3, Sampler(), [EOS])


# ---- the probe ------------------------------------------------------------------------------------------------


def test_sampler_agreement_identical_logits_agree_with_the_sampler_pick():
    cfg = SamplerConfig(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=4)
    history = torch.tensor([0, 3, 3, 9])
    for step in range(10):
        logits = randn(200, seed=step)
        m = sampler_agreement(logits, logits.clone(), history, cfg, step)
        assert all(v.ndim == 0 for v in m.values())
        assert m["same_pick"].dtype == torch.int64 and m["pick_margin"].dtype == torch.float64
        assert m["same_pick"] == 1 and m["ref_pick"] == m["test_pick"]
        assert int(m["ref_pick"]) == Sampler(cfg).pick(logits, history, step=step)
        assert float(m["pick_margin"]) > 0


def test_sampler_agreement_margin_is_the_log_ratio_gap_and_a_flip_is_reported():
    cfg = SamplerConfig(temperature=1.0, seed=0)
    logits = torch.zeros(8)
    noise = draw_noise(8, 0, 3)
    ratio = torch.softmax(logits, -1) / noise
    top2 = ratio.double().topk(2).values
    m = sampler_agreement(logits, logits, None, cfg, 3)
    assert float(m["pick_margin"]) == pytest.approx(math.log(top2[0] / top2[1]), rel=1e-5)
    winner, runner = ratio.topk(2).indices.tolist()
    flipped = logits.clone()
    flipped[runner] += float(m["pick_margin"]) + 0.01  # just enough to overtake
    f = sampler_agreement(logits, flipped, None, cfg, 3)
    assert f["same_pick"] == 0 and f["ref_pick"] == winner and f["test_pick"] == runner


def test_sampler_agreement_greedy_margin_and_single_candidate():
    ref, test = torch.tensor([1.0, 3.0, 2.5]), torch.tensor([1.0, 2.0, 2.5])
    m = sampler_agreement(ref, test, None, SamplerConfig(), 0)
    assert m["same_pick"] == 0 and m["ref_pick"] == 1 and m["test_pick"] == 2
    assert float(m["pick_margin"]) == pytest.approx(0.5)
    nucleus1 = sampler_agreement(ref, ref, None, SamplerConfig(temperature=1.0, top_p=0.01), 0)
    assert float(nucleus1["pick_margin"]) == math.inf and nucleus1["same_pick"] == 1
    with pytest.raises(ValueError, match="shapes"):
        sampler_agreement(ref, torch.zeros(4), None, SamplerConfig(), 0)
