"""Byte-level BPE tokenizer of the default checkpoint (``tokenizers``), with the ids the config knows:
0 BOS, 1 EOS, 2 end of turn (a stop token), then learned merges up to the model's vocabulary."""

from __future__ import annotations

from collections.abc import Iterable

# ids 0, 1, 2 = ModelConfig's BOS, EOS and stop_token_ids, spelled as DSv4's tokenizer spells them, so that
# ``StopSet.from_tokenizer_file`` finds EOS and the end-of-turn marker (``<｜User｜>``) by name
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"tokenizer: special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def encode_document(tok, text: str) -> list[int]:
    """BOS, the text's ids, EOS: one corpus document."""
    return [0, *tok.encode(text).ids, 1]
