"""``fidelity.run``: one call from a decoder and a checkpoint to a judged run directory (the CLI's ``run`` calls it).

    import fidelity
    res = fidelity.run(decoder="transformers", checkpoint="ckpt/", decoder_dtype="bf16", decode_steps=16)
    res.verdict, res.first_divergence, res.run_dir
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fidelity.decoders.base import Decoder
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import MANIFEST, TraceError
from fidelity.decoders.transformers import TransformersDecoder
from fidelity.harness.oracle_run import ORACLE_DTYPES
from fidelity.harness.runner import RunSpec, checkpoint_info, config_difference
from fidelity.job import RunResult, run_job
from fidelity.model import text
from fidelity.model.checkpoint import Checkpoint, CheckpointError
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_checkpoint, is_default, prompt_for
from fidelity.model.load import load_checkpoint
from fidelity.model.synthesize import synthesize

DECODERS = ("production", "transformers", "trace:DIR")


def open_checkpoint(checkpoint: Checkpoint | str | Path | None, trace: TraceDecoder | None = None) -> Checkpoint:
    """A checkpoint object, a directory, or None: the trace's recorded checkpoint, else the trained default (for a
    trace, with a warning saying so)."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    if checkpoint is not None:
        return load_checkpoint(checkpoint)
    recorded = (trace.manifest.get("checkpoint") or {}) if trace is not None else {}
    if recorded.get("path"):
        return load_trace_checkpoint(trace)
    if not recorded.get("preset"):
        if trace is not None:
            warnings.warn(no_checkpoint_note(trace), UserWarning, stacklevel=3)
        return load_checkpoint(default_checkpoint())
    preset = recorded["preset"]
    check_trace_config(trace, ModelConfig.preset(preset), recorded_checkpoint(trace))  # before the synthesis
    ckpt = synthesize(ModelConfig.preset(preset), seed=int(recorded.get("seed", 0)))
    ckpt.origin["preset"] = preset
    return ckpt


def open_decoder(decoder: Decoder | str, ckpt: Checkpoint, profile="reference", max_context: int = 4096,
                 device: str = "cpu", dtype: str = "bf16") -> Decoder:
    """``production``, ``transformers`` or ``trace:DIR`` (or a Decoder, returned as it is)."""
    if isinstance(decoder, Decoder):
        return decoder
    if decoder == "production":
        return ProductionDecoder(ckpt, profile, max_context, device)
    if decoder == "transformers":
        return TransformersDecoder.from_checkpoint(ckpt, dtype, device)
    if decoder.startswith("trace:"):
        return TraceDecoder(decoder.removeprefix("trace:"))
    raise ValueError(f"decoder: expected one of {DECODERS} or a Decoder, found {decoder!r}")


def load_trace_checkpoint(trace: TraceDecoder) -> Checkpoint:
    """The checkpoint at trace.json's ``checkpoint.path`` (read from the trace's folder); errors name trace.json."""
    path = trace.checkpoint_path()
    try:
        return load_checkpoint(path)
    except CheckpointError as err:
        raise TraceError(f"{trace.dir / MANIFEST}: checkpoint.path: {err}") from None


def no_checkpoint_note(trace: TraceDecoder) -> str:
    """What a replay of a trace that names no checkpoint is compared with, in one line."""
    return f"{trace.dir / MANIFEST} names no checkpoint: compared with the trained default checkpoint " \
           f"{default_checkpoint()}"


def in_words(ckpt: Checkpoint) -> str:
    """A checkpoint in words: the trained default or a directory with its path, else synthetic weights."""
    if ckpt.path:
        return f"{'the trained default checkpoint' if is_default(ckpt.path) else 'checkpoint'} {ckpt.path}"
    origin = ckpt.origin
    return f"synthetic weights (preset {origin.get('preset', '?')!r}, seed {origin.get('seed', '?')})"


def recorded_checkpoint(trace: TraceDecoder) -> str:
    """The checkpoint a replay of ``trace`` uses when none is given, in words, with where it comes from."""
    recorded = trace.manifest.get("checkpoint") or {}
    if recorded.get("path"):
        return f"checkpoint {trace.checkpoint_path()} (trace.json's checkpoint.path)"
    if recorded.get("preset"):
        return f"preset '{recorded['preset']}' seed {int(recorded.get('seed', 0))} (trace.json's checkpoint)"
    return f"the trained default checkpoint {default_checkpoint()} (trace.json names no checkpoint)"


def check_trace_config(trace: TraceDecoder, config: ModelConfig, checkpoint: str) -> None:
    """A trace whose model differs from ``config`` (the config of ``checkpoint``: which one, in words) is
    refused, before any work."""
    if diff := config_difference(trace.config, config):
        raise TraceError(f"trace {trace.dir}: its config differs from the checkpoint's ({diff}); the checkpoint is "
                         f"{checkpoint}")


def check_trace_checkpoint(trace: TraceDecoder, ckpt: Checkpoint) -> None:
    """A trace recorded on another checkpoint (its content hash differs) is refused."""
    recorded = (trace.manifest.get("checkpoint") or {}).get("hash")
    if recorded and (found := checkpoint_info(ckpt)["hash"]) != recorded:
        raise TraceError(f"trace {trace.dir}: recorded on a checkpoint with hash {recorded}, this one has {found}")


def run(decoder: Decoder | str = "production", checkpoint: Checkpoint | str | Path | None = None,
        prompt: Sequence[int] | torch.Tensor | int | None = None, decode_steps: int | None = None,
        modes: Sequence[str] = ("free", "layer", "op"), out: str | Path = "runs", *, run_id: str | None = None,
        profile: str = "reference", decoder_dtype: str = "bf16", device: str = "cpu", oracle_dtype: str = "fp32",
        thresholds: str | Path | None = None, trace: str | Path | None = None, overwrite: bool = False,
        progress: Callable[..., None] | None = None, **spec_fields) -> RunResult:
    """Run ``decoder`` side by side with the oracle on ``checkpoint`` and write ``out/<run-id>/``.

    ``decoder``: ``production`` (the built-in decoder with ``profile``), ``transformers`` (DeepseekV4ForCausalLM in
    ``decoder_dtype``), ``trace:DIR`` (a recorded trace: its prompt and tokens are replayed), or any ``Decoder``.
    ``prompt``: token ids, or a length for the deterministic default prompt (the trained default's own text, else
    1024 random ids, when None; the first ``prompt`` ids of that text or random ids for a length). ``trace``: also
    record the decoder's calls as a trace there. ``spec_fields``: further ``RunSpec`` fields (``stream``,
    ``continuation``, ``sampler``, ``stop_ids``, ``max_context``, ``sample_queries``).
    """
    replay = TraceDecoder(decoder.removeprefix("trace:")) if isinstance(decoder, str) and \
        decoder.startswith("trace:") else (decoder if isinstance(decoder, TraceDecoder) else None)
    ckpt = open_checkpoint(checkpoint, replay)
    if replay is not None:
        check_trace_checkpoint(replay, ckpt)
        which = recorded_checkpoint(replay) if checkpoint is None else f"{in_words(ckpt)} (given)"
        check_trace_config(replay, ckpt.config, which)
        if prompt is not None and list(torch.as_tensor(prompt).flatten().tolist()) != replay.prompt.tolist():
            raise TraceError(f"trace {replay.dir}: the prompt given differs from the trace's; leave it out to replay")
        prompt, decode_steps = replay.prompt, len(replay.generated)
        spec_fields.update(stream="given", continuation=torch.tensor(replay.generated, dtype=torch.long),
                           prefill_chunk=replay.chunks)
    if prompt is None or isinstance(prompt, int):
        prompt = prompt_for(ckpt, prompt)
    if "tokenizer" not in spec_fields and (tok := text.tokenizer_path(ckpt.path)) is not None:
        spec_fields["tokenizer"] = str(tok)
    prompt = torch.as_tensor(prompt).long().flatten()
    steps = 64 if decode_steps is None else decode_steps
    spec = RunSpec(prompt=prompt, decode_steps=steps, profile=profile, modes=tuple(modes), device=device,
                   oracle_dtype=ORACLE_DTYPES[oracle_dtype], **spec_fields)
    max_context = spec.max_context or len(prompt) + steps
    dec = replay or open_decoder(decoder, ckpt, profile, max_context, device, decoder_dtype)
    return run_job(ckpt, spec, out, run_id, thresholds, overwrite, progress, dec, trace)
