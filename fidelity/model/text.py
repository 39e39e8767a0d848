"""Text in and out: a checkpoint's ``tokenizer.json`` (``tokenizers``), prompts from text, and continuations as text.

A text prompt is BOS followed by the text's ids, as the default checkpoint saw every training document.
"""

from __future__ import annotations

from pathlib import Path

import torch


class TextError(ValueError):
    """Text that cannot be used as asked (no tokenizer beside the checkpoint, an unreadable or empty file)."""


def tokenizer_path(checkpoint_dir: str | Path | None) -> Path | None:
    """``checkpoint_dir/tokenizer.json`` when it exists, else None."""
    if checkpoint_dir is None:
        return None
    p = Path(checkpoint_dir) / "tokenizer.json"
    return p if p.is_file() else None


def load(path: str | Path):
    """The ``tokenizers.Tokenizer`` in ``path``; a TextError naming the file when it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception for missing files and bad JSON alike
        raise TextError(f"tokenizer {path}: cannot be read: {err}") from None


def encode_prompt(tok, text: str, bos_id: int, vocab_size: int, option: str = "--prompt-text") -> torch.Tensor:
    """[BOS, ids of text...] as int64; every id must be below the model's ``vocab_size``."""
    if not text:
        raise TextError(f"{option}: expected some text, found an empty string")
    ids = [bos_id, *tok.encode(text).ids]
    if max(ids) >= vocab_size:
        raise TextError(f"{option}: the tokenizer gives id {max(ids)}, expected ids below the model's vocab_size "
                        f"{vocab_size}: the tokenizer does not belong to this checkpoint")
    return torch.tensor(ids, dtype=torch.long)


def read_text(path: str | Path, option: str = "--prompt-text-file") -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise TextError(f"{option}: cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise TextError(f"{option} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text:
        raise TextError(f"{option} {path}: expected some text, found an empty file")
    return text


def decode(tok, ids: list[int]) -> str:
    """The text of ``ids`` (special tokens dropped, as ``tokenizers`` decodes)."""
    return tok.decode([int(i) for i in ids])


def continuations(tok, prompt: list[int], oracle: list[int], decoder: list[int], tail_chars: int = 400) -> dict:
    """The prompt's last characters and both models' picks as text, and the first step where the picks part.

    ``decoder`` holds the decoder's pick at each step given the shared (teacher-forced) history; its text is
    shown up to and including the step where it first parts from the oracle's, later picks answer a history the
    decoder did not choose."""
    parted = next((k for k, (a, b) in enumerate(zip(oracle, decoder, strict=False)) if a != b), None)
    upto = decoder if parted is None else decoder[: parted + 1]
    out = {"prompt_tail": decode(tok, prompt)[-tail_chars:], "oracle": decode(tok, oracle),
           "decoder": decode(tok, upto), "parted_at": parted}
    if parted is not None:
        out["oracle_token"] = decode(tok, [oracle[parted]])
        out["decoder_token"] = decode(tok, [decoder[parted]])
        out["agreed_text"] = decode(tok, oracle[:parted])
    return out
