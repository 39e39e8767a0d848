"""The embedded default: a DSv4-shaped checkpoint (tiny shape) trained on the Python standard library's sources,
in the release layout, with its tokenizer and the default prompt (``fidelity train`` made it; the recipe, log and
loss curve are in ``benchmarks/results/``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).parents[1] / "data" / "default"
RANDOM_PROMPT_LEN = 1024  # the default prompt's length on other checkpoints (random ids)
PROMPT_FILE = "prompt.txt"  # the default run's prompt: Python source written for this package (not in the corpus)


def default_checkpoint() -> Path:
    """The folder of the trained default checkpoint (config.json, model.safetensors, tokenizer.json)."""
    if not (DEFAULT_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"default checkpoint: expected {DEFAULT_DIR / 'model.safetensors'}, found no such "
                                "file (an incomplete installation?)")
    return DEFAULT_DIR


def is_default(path: str | Path | None) -> bool:
    return path is not None and Path(path).resolve() == DEFAULT_DIR.resolve()


def default_prompt(vocab_size: int, length: int, seed: int = 0) -> torch.Tensor:
    """A deterministic pseudo-random prompt [length] of token ids in [3, vocab) (0 BOS, 1 EOS, 2 end of turn)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(3, vocab_size, (length,), generator=gen)


def default_prompt_ids(vocab_size: int, bos_id: int = 0, length: int | None = None) -> torch.Tensor:
    """The default run's prompt: BOS + ``prompt.txt`` tokenized with the default's tokenizer (about 1.2K ids);
    ``length``: its first ``length`` ids, the text repeated as often as a longer prompt needs."""
    from fidelity.model import text

    tok = text.load(DEFAULT_DIR / "tokenizer.json")
    body = (DEFAULT_DIR / PROMPT_FILE).read_text(encoding="utf-8")
    ids = text.encode_prompt(tok, body, bos_id, vocab_size)
    if length is not None and length > len(ids):  # one more copy than needed: merges across copies may save ids
        ids = text.encode_prompt(tok, body * (1 + math.ceil(length / (len(ids) - 1))), bos_id, vocab_size)
    return ids if length is None else ids[:length]


def prompt_for(ckpt, length: int | None = None, seed: int = 0) -> torch.Tensor:
    """The default prompt on ``ckpt``: the default's text (its first ``length`` ids) on the trained default,
    else ``length`` (default RANDOM_PROMPT_LEN) deterministic random ids (``default_prompt``)."""
    if is_default(ckpt.path):
        return default_prompt_ids(ckpt.config.vocab_size, ckpt.config.bos_token_id, length)
    return default_prompt(ckpt.config.vocab_size, RANDOM_PROMPT_LEN if length is None else length, seed)
