"""Decode-loop hygiene: seeded sampling, stop tokens and the one generation loop (``generate``).

The draw is the reference's (spec §5): ``softmax(logits / max(T, 1e-5))`` then ``argmax(p / E)`` with
E ~ Exp(1); temperature 0 is a plain argmax. Before it come the CTRL-style repetition penalty over every
distinct id in the prompt *and* the generated tokens (with ``repetition_window`` N > 0: in the last N ids of that
history, prompt ids included while fewer than N were generated), then nucleus (top-p) filtering. The noise E is drawn
on CPU from a generator seeded by (seed, step) alone, so the pick at step k is the same on every device and
does not depend on how many draws came before. The ordering is done in log space
(``log p - log E``), which ranks tokens exactly as ``p / E`` does.

Stop tokens (decision): EOS plus the chat end-of-turn markers in ``END_OF_TURN``. For DSv4 these are
``<｜end▁of▁sentence｜>`` (the end of every assistant turn) and ``<｜User｜>`` (a new user turn can only
start after the assistant's turn ended, so emitting it means the turn is over). ``<｜Assistant｜>``,
``<think>``/``</think>``, DSML and reminder tokens are *not* stops: they occur inside an assistant turn or
only in prompts. The reference ``generate()`` stops on EOS alone: use ``StopSet.from_config`` to match it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fidelity.model.config import ModelConfig

MIN_TEMPERATURE = 1e-5  # the reference's max(T, 1e-5)
SEED_STRIDE = 1_000_003  # per-step generator seed = seed * SEED_STRIDE + step (mod 2**63)
EOS_CONTENT = "<｜end▁of▁sentence｜>"
END_OF_TURN: tuple[str, ...] = (EOS_CONTENT, "<｜User｜>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# ---- configuration ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerConfig:
    """Sampling knobs; defaults are greedy. ``seed`` fixes the Exp(1) noise of every step. ``repetition_window``:
    the penalty covers the last N ids of prompt + generated (0: all of them)."""

    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    repetition_window: int = 0

    def __post_init__(self) -> None:
        p = sampler_problems(self.temperature, self.top_p, self.repetition_penalty, self.seed,
                             self.repetition_window)
        if p:
            raise ValueError("SamplerConfig: " + "; ".join(f"{field}: {what}" for field, what in p.items()))


def sampler_problems(temperature: Any, top_p: Any, repetition_penalty: Any, seed: Any,
                     repetition_window: Any = 0) -> dict[str, str]:
    """{field: 'expected ..., found ...'} for each ``SamplerConfig`` field whose value is out of range."""
    p: dict[str, str] = {}
    t, tp, rp, s = temperature, top_p, repetition_penalty, seed
    if not _is_real(t) or not math.isfinite(t) or t < 0:
        p["temperature"] = f"expected a finite number >= 0, found {t!r}"
    if not _is_real(tp) or not 0 < tp <= 1:
        p["top_p"] = f"expected a number in (0, 1], found {tp!r}"
    if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
        p["repetition_penalty"] = f"expected a finite number > 0, found {rp!r}"
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        p["seed"] = f"expected an integer >= 0, found {s!r}"
    w = repetition_window
    if not isinstance(w, int) or isinstance(w, bool) or w < 0:
        p["repetition_window"] = f"expected an integer >= 0 (0: the whole history), found {w!r}"
    return p


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


# ---- the pure math (shared with probes.sampler) --------------------------------------------------------------


def draw_noise(vocab_size: int, seed: int, step: int) -> torch.Tensor:
    """[vocab_size] float32 CPU Exp(1) draws from a generator seeded by (seed, step) only."""
    if step < 0:
        raise ValueError(f"step: expected >= 0, found {step}")
    gen = torch.Generator(device="cpu").manual_seed((seed * SEED_STRIDE + step) % 2**63)
    noise = torch.empty(vocab_size, dtype=torch.float32).exponential_(1.0, generator=gen)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # guard log(0); Exp(1) hits 0 with prob ~0


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """CTRL rule for every distinct id in ``history``: logit / penalty if > 0 else logit * penalty.

    Duplicated ids write the same value, so no ``unique`` (and no host sync) is needed.
    """
    if history is None or penalty == 1.0 or history.numel() == 0:
        return logits
    idx = history.reshape(-1).to(device=logits.device, dtype=torch.long)
    picked = logits.gather(0, idx)
    return logits.scatter(0, idx, torch.where(picked > 0, picked / penalty, picked * penalty))


def penalty_window(history: torch.Tensor | None, window: int) -> torch.Tensor | None:
    """The ids the repetition penalty covers: the last ``window`` of ``history`` [n] (all of it when 0)."""
    if history is None or window == 0:
        return history
    return history.reshape(-1)[-window:]


def top_p_mask(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool [V]: the smallest set of most probable tokens with mass >= top_p (always >= 1 token)."""
    if top_p >= 1.0:
        return torch.ones_like(logp, dtype=torch.bool)
    sorted_p, order = logp.exp().sort(descending=True, stable=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass strictly ahead of each token
    keep_sorted = before < top_p
    keep_sorted[0] = True
    return torch.empty_like(keep_sorted).scatter_(0, order, keep_sorted)


def sample_scores(
    logits: torch.Tensor, history: torch.Tensor | None, config: SamplerConfig, noise: torch.Tensor | None
) -> torch.Tensor:
    """[V] logits -> [V] float32 scores whose argmax is the pick; device-side, no host sync.

    T > 0: ``log softmax(penalized / max(T, 1e-5)) - log(noise)`` (= log(p / E)), -inf outside the
    nucleus. T == 0: the penalized logits (greedy; ``noise`` unused and may be None).
    """
    if logits.ndim != 1:
        raise ValueError(f"sample_scores: expected logits [V], found shape {tuple(logits.shape)}")
    recent = penalty_window(history, config.repetition_window)
    x = apply_repetition_penalty(logits.to(torch.float32), recent, config.repetition_penalty)
    if config.temperature == 0:
        return x
    if noise is None or noise.shape != x.shape:
        found = None if noise is None else tuple(noise.shape)
        raise ValueError(f"sample_scores: expected noise of shape {tuple(x.shape)}, found {found}")
    logp = torch.log_softmax(x / max(config.temperature, MIN_TEMPERATURE), dim=-1)
    logp = logp.masked_fill(~top_p_mask(logp, config.top_p), float("-inf"))
    return logp - noise.to(device=x.device, dtype=torch.float32).log()


# ---- the sampler ---------------------------------------------------------------------------------------------


class Sampler:
    """Seeded picker: ``pick(logits, history, step)``; the step defaults to a running count of picks."""

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config or SamplerConfig()
        self.step = 0

    def scores(self, logits: torch.Tensor, history: torch.Tensor | None, step: int) -> torch.Tensor:
        """[V] scores of step ``step`` (see ``sample_scores``)."""
        noise = None if self.config.temperature == 0 else draw_noise(logits.shape[-1], self.config.seed, step)
        return sample_scores(logits, history, self.config, noise)

    def pick(self, logits: torch.Tensor, history: torch.Tensor | None = None, step: int | None = None) -> int:
        """Token id for ``logits`` [V]; ``history`` = prompt + generated ids (all penalised)."""
        step = self.step if step is None else step
        token = int(self.scores(logits, history, step).argmax().item())
        self.step = step + 1
        return token

    def reset(self) -> None:
        self.step = 0


# ---- stop tokens ---------------------------------------------------------------------------------------------


class TokenizerFileError(ValueError):
    """A tokenizer/generation config file that cannot yield stop tokens; names the file and field."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class StopSet:
    """Token ids that end generation (the stop token itself is kept in the output)."""

    ids: frozenset[int]

    @classmethod
    def of(cls, ids: Iterable[int]) -> StopSet:
        return cls(frozenset(int(i) for i in ids))

    @classmethod
    def from_config(cls, cfg: ModelConfig, extra: Iterable[int] = ()) -> StopSet:
        """{eos_token_id} | stop_token_ids | extra."""
        return cls.of([cfg.eos_token_id, *cfg.stop_token_ids, *extra])

    @classmethod
    def from_tokenizer_file(cls, path: str | Path, extra: Iterable[int] = ()) -> StopSet:
        """EOS + end-of-turn ids from a tokenizer.json, tokenizer_config.json or generation_config.json.

        The kind is recognised from the content. A directory reads whichever of ``TOKENIZER_FILES`` exist.
        """
        path = Path(path)
        if path.is_dir():
            files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
            if not files:
                raise TokenizerFileError(path, f"no tokenizer file found (expected one of {TOKENIZER_FILES})")
            return cls.of([i for f in files for i in cls.from_tokenizer_file(f).ids] + list(extra))
        raw = _read_json(path)
        if "added_tokens" in raw or "model" in raw:
            ids = _from_tokenizer_json(path, raw)
        elif "added_tokens_decoder" in raw or "eos_token" in raw:
            ids = _from_tokenizer_config(path, raw)
        elif "eos_token_id" in raw:
            ids = _int_list(path, "eos_token_id", raw["eos_token_id"])
        else:
            raise TokenizerFileError(
                path,
                "no stop-token field: expected 'added_tokens' (tokenizer.json), 'eos_token' / "
                "'added_tokens_decoder' (tokenizer_config.json) or 'eos_token_id' (generation_config.json)",
            )
        return cls.of([*ids, *extra])

    def __contains__(self, token: object) -> bool:
        if isinstance(token, torch.Tensor):
            token = int(token.item())
        return token in self.ids

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.ids))

    def __len__(self) -> int:
        return len(self.ids)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TokenizerFileError(path, "file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerFileError(path, f"not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise TokenizerFileError(path, f"expected a JSON object, found {type(raw).__name__}")
    return raw


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _int_list(path: Path, field: str, value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(_is_id(v) for v in values):
        raise TokenizerFileError(
            path, f"{field}: expected a token id >= 0 or a non-empty list of them, found {value!r}"
        )
    return values


def _content(path: Path, field: str, token: Any) -> str:
    """An AddedToken's text: a plain string or a dict with 'content'."""
    text = token.get("content") if isinstance(token, dict) else token
    if not isinstance(text, str):
        raise TokenizerFileError(
            path, f"{field}: expected a string or an object with a string 'content', found {token!r}"
        )
    return text


def _from_tokenizer_json(path: Path, raw: dict[str, Any]) -> list[int]:
    added = raw.get("added_tokens", [])
    if not isinstance(added, list):
        raise TokenizerFileError(path, f"added_tokens: expected a list, found {type(added).__name__}")
    by_text: dict[str, int] = {}
    for n, tok in enumerate(added):
        if not isinstance(tok, dict) or not _is_id(tok.get("id")) or not isinstance(tok.get("content"), str):
            raise TokenizerFileError(
                path,
                f"added_tokens[{n}]: expected an object with an int 'id' and a string 'content', found {tok!r:.120}",
            )
        by_text[tok["content"]] = tok["id"]
    vocab = raw.get("model", {}).get("vocab") if isinstance(raw.get("model"), dict) else None
    if isinstance(vocab, dict):  # BPE-style vocab: text -> id (added tokens win)
        by_text = {**{t: v for t, v in vocab.items() if t in END_OF_TURN and _is_id(v)}, **by_text}
    ids = [by_text[t] for t in END_OF_TURN if t in by_text]
    if EOS_CONTENT not in by_text:
        raise TokenizerFileError(
            path, f"added_tokens: no EOS token {EOS_CONTENT!r} (end-of-turn markers looked for: {list(END_OF_TURN)})"
        )
    return ids


def _from_tokenizer_config(path: Path, raw: dict[str, Any]) -> list[int]:
    decoder = raw.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerFileError(path, f"added_tokens_decoder: expected an object, found {type(decoder).__name__}")
    by_text: dict[str, int] = {}
    for key, tok in decoder.items():
        if not key.isdigit():
            raise TokenizerFileError(path, f"added_tokens_decoder: expected token-id keys, found {key!r}")
        by_text[_content(path, f"added_tokens_decoder[{key}]", tok)] = int(key)
    ids = [by_text[t] for t in END_OF_TURN if t in by_text]
    if "eos_token" in raw and raw["eos_token"] is not None:
        eos = _content(path, "eos_token", raw["eos_token"])
        if eos not in by_text:
            raise TokenizerFileError(path, f"eos_token: {eos!r} is not in added_tokens_decoder, so its id is unknown")
        ids.insert(0, by_text[eos])
    if not ids:
        raise TokenizerFileError(
            path, f"eos_token: missing, and added_tokens_decoder holds no end-of-turn token {list(END_OF_TURN)}"
        )
    return ids


# ---- the generate loop ---------------------------------------------------------------------------------------


class Generation(NamedTuple):
    """Generated ids (prompt excluded; a stop token is included) and why it ended: 'stop' or 'length'."""

    ids: list[int]
    reason: str


def generate(
    prefill_fn: Callable[[torch.Tensor], torch.Tensor],
    step_fn: Callable[[int], torch.Tensor],
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    sampler: Sampler,
    stops: StopSet | Iterable[int],
) -> Generation:
    """Decode with a caller-owned model session.

    ``prefill_fn(prompt [P] int64 CPU) -> logits [V]`` for the position after the prompt;
    ``step_fn(token) -> logits [V]`` feeds one generated token. Step k draws with (seed, k), so a rerun
    with the same seed and logits picks the same tokens. No forward is run after the last pick.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, found {max_new_tokens}")
    stop_set = stops if isinstance(stops, StopSet) else StopSet.of(stops)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).cpu()
    if prompt.numel() == 0:
        raise ValueError("prompt_ids: expected at least one token (BOS)")
    if max_new_tokens == 0:
        return Generation([], "length")
    n = prompt.numel()
    history = torch.cat((prompt, torch.zeros(max_new_tokens, dtype=torch.long)))
    out: list[int] = []
    logits = prefill_fn(prompt)
    for k in range(max_new_tokens):
        token = sampler.pick(logits, history[: n + k], step=k)
        out.append(token)
        history[n + k] = token
        if token in stop_set:
            return Generation(out, "stop")
        if k + 1 < max_new_tokens:
            logits = step_fn(token)
    return Generation(out, "length")
