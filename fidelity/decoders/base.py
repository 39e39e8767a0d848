"""What the runner needs from a decoder under test, and which comparison modes its reported sites allow.

A decoder prefills a prompt and steps one token at a time, returning fp32 logits, and hands tensors to the
``Recorder`` the runner sets on ``rec`` under the harness's site names (``fidelity/model/sites.py``). Free mode needs
the logits only; layer mode needs each layer's input streams (``embed`` and ``L{i}.residual``); op mode needs
every op's inputs (``OP_INPUTS``). The runner runs the modes a decoder's sites allow and records why it skipped
the others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sampling import Sampler, StopSet
from fidelity.model.sites import SITE, Recorder

LAYER_INPUTS = (SITE.embed, SITE.residual)
# op mode: the exact inputs of the oracle's ops (oracles.op_mode.OpReplay reads these from the decoder's records)
OP_INPUTS = (SITE.embed, SITE.attn_in, SITE.attn_q, SITE.attn_kv, SITE.attn_visible, SITE.moe_in, SITE.residual)
OP_INPUTS_COMPRESSED = (SITE.attn_compressed_kv,)  # HCA and CSA layers
OP_INPUTS_INDEXER = (SITE.indexer_q, SITE.indexer_weights, SITE.indexer_keys)  # CSA layers


class DecoderError(ValueError):
    """A decoder that cannot do what a run asks of it; the message names the decoder and what is wrong."""


class ContextError(ValueError):
    """A prompt or decode step beyond a decoder's ``max_context``: raised before any state changes."""


def raised(err: BaseException) -> str:
    """What a decoder raised, for a report: the exception's type and the first line of its message (300 chars)."""
    first_line = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first_line}"


@dataclass(frozen=True)
class Call:
    """One sequence's part of a model call: token ids [n] of sequence ``seq`` at positions ``start`` ..
    ``start + n - 1`` (``start`` is where the sequence stands: a call continues it)."""

    seq: int
    ids: torch.Tensor
    start: int


# What a decoder may support beyond one sequence fed one way (``Decoder.capabilities``):
BATCH = "batch"  # several sequences in one model call (``forward`` with calls of different ``seq``)
FORK = "fork"  # a new sequence starts from another's state at a position it has reached (prefix reuse)
ROLLBACK = "rollback"  # a sequence returns to an earlier position (rejected speculative tokens)
CAPABILITIES = (BATCH, FORK, ROLLBACK)


class Decoder(ABC):
    """A decoder under test: ``prefill(ids) -> logits [T, V]``, ``step(id) -> logits [V]``, sites into ``rec``.

    ``label`` names it in reports; ``profile`` is what the manifest records as the profile (format fields where
    known; ``precision`` = exact / bf16 / quantized picks the default thresholds otherwise); ``pos`` counts the
    tokens consumed. Every run starts with ``reset()``, so one decoder object can serve several runs.
    """

    label: str
    config: ModelConfig
    profile: dict
    rec: Recorder | None = None
    pos: int = 0
    # a decoder that records the sites of every sequence of a ``forward`` sets ``records_sequences`` and reads
    # ``recorders`` ({seq: Recorder}; None: sequence 0's ``rec`` only)
    records_sequences: bool = False
    recorders: dict[int, Recorder] | None = None
    # set by the harness while it reads only the last row of what ``prefill`` returns (the sites it compares come
    # through ``rec``): a decoder may then compute and return that row alone, [1, vocab]
    last_logits_only: bool = False

    @abstractmethod
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt ids [T] at positions 0..T-1 -> fp32 logits [T, vocab]."""

    @abstractmethod
    def step(self, token: int) -> torch.Tensor:
        """One token at position ``pos`` -> fp32 logits [vocab]."""

    @abstractmethod
    def sites(self) -> frozenset[str]:
        """Site templates (``L{i}.attn.q``, ``logits``, ...) this decoder reports."""

    def capabilities(self) -> dict[str, str | None]:
        """For each of ``CAPABILITIES``: None when this decoder supports it, else why not (scenarios that need it
        are skipped with that reason). The default: one sequence, no forks, no rollbacks."""
        return {c: f"{self.label} implements only prefill and step (one sequence)" for c in CAPABILITIES}

    def forward(self, calls: list[Call]) -> list[torch.Tensor]:
        """Several sequences' calls in one model call -> fp32 logits [n_i, vocab] per call, in order. The default
        serves one call of sequence 0 continuing at ``pos`` through ``prefill`` / ``step``."""
        if len(calls) != 1 or calls[0].seq != 0 or calls[0].start != self.pos:
            raise DecoderError(f"{self.label}: {self.capabilities()[BATCH]}")
        call = calls[0]
        if len(call.ids) == 1 and self.pos > 0:
            return [self.step(int(call.ids[0]))[None]]
        return [self.prefill(call.ids)]

    def fork(self, seq: int, parent: int, pos: int) -> None:
        """Start sequence ``seq`` from sequence ``parent``'s state at position ``pos`` (its first ``pos`` tokens)."""
        raise DecoderError(f"{self.label}: cannot fork: {self.capabilities()[FORK]}")

    def rollback(self, seq: int, pos: int) -> None:
        """Return sequence ``seq`` to position ``pos``: every state (caches, compressor carries, window ring,
        indexer keys) as if the tokens from ``pos`` on had never been fed."""
        raise DecoderError(f"{self.label}: cannot roll back: {self.capabilities()[ROLLBACK]}")

    def reset(self) -> None:
        """Forget every token consumed (caches emptied, ``pos`` 0): the start of a run. This default has nothing to
        forget while ``pos`` is 0 and raises DecoderError otherwise; a decoder that serves several runs overrides
        it."""
        if self.pos:
            raise DecoderError(f"{self.label}: has consumed {self.pos} tokens and cannot start a new run: it does "
                               "not implement Decoder.reset; pass a new decoder to each run")

    def same_bits(self, split: tuple[int, ...] = ()) -> str:
        """Why this decoder returns bit-equal logits for the same tokens fed in calls that differ only by the call
        boundaries ``split`` (positions where one side starts a call and the other does not; () for the same calls,
        whatever forks, rollbacks or other sequences came between), '' where it promises no equal bits (the
        self-consistency pairs are then judged by bounds). This default promises nothing."""
        return ""

    def cache_bytes(self) -> int | None:
        """Bytes the decoder's caches hold (None when it cannot say): the memory probe's cache_growth."""
        return None

    def info(self) -> dict:
        """Entries for the run's manifest (implementations, routes, dtype, ...)."""
        return {}

    def stop_ids(self) -> tuple[int, ...] | None:
        """The token ids this decoder's own generation stops on (an engine's generation config), or None when it
        stops where the harness's stop set says (the built-in decoder). The stops probe compares them with the
        reference stop set at every decode token."""
        return None

    def stop_set(self, reference: StopSet) -> StopSet:
        """The stop set this decoder's generation uses in a run whose reference stop set is ``reference``: its own
        ``stop_ids`` where it has them, else the reference's."""
        own = self.stop_ids()
        return StopSet.of(own) if own is not None else reference

    def pick(self, sampler: Sampler, logits: torch.Tensor, history: torch.Tensor, step: int) -> int:
        """This decoder's own pick of decode token ``step`` from its logits [vocab] fp32 after ``history`` (prompt
        and generated ids): the run's sampler here; a decoder with a sampler of its own overrides it. The sampler
        probe compares the pick with the reference sampler's on the same logits."""
        return sampler.pick(logits, history, step)


def required_sites(mode: str, cfg: ModelConfig) -> list[str]:
    """The site templates ``mode`` needs from the decoder for ``cfg`` (free: logits only)."""
    if mode == "free":
        return ["logits"]
    if mode == "layer":
        return list(LAYER_INPUTS)
    need = list(OP_INPUTS)
    if any(cfg.compress_ratios[i] for i in range(cfg.n_layers)):
        need += OP_INPUTS_COMPRESSED
    if any(cfg.compress_ratios[i] == 4 for i in range(cfg.n_layers)):
        need += OP_INPUTS_INDEXER
    return need


def mode_support(decoder: Decoder, modes: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """(modes that can run, {skipped mode: why}) from the sites ``decoder`` reports."""
    have = decoder.sites()
    ran, skipped = [], {}
    for mode in modes:
        missing = [s for s in required_sites(mode, decoder.config) if s not in have]
        if missing:
            skipped[mode] = f"the decoder does not report {', '.join(missing)}"
        else:
            ran.append(mode)
    return tuple(ran), skipped
