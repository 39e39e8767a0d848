"""``fidelity.run``: one call from a decoder and a checkpoint to a judged run directory (the CLI's ``run`` calls it).

    import fidelity
    res = fidelity.run(decoder="transformers", checkpoint="ckpt/", decoder_dtype="bf16", decode_steps=16)
    res.verdict, res.first_divergence, res.run_dir
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fidelity.decoders.base import Decoder
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import TraceError
from fidelity.decoders.transformers import TransformersDecoder
from fidelity.harness.oracle_run import ORACLE_DTYPES
from fidelity.harness.runner import RunSpec, checkpoint_info
from fidelity.job import RunResult, run_job
from fidelity.model import text
from fidelity.model.checkpoint import Checkpoint
from fidelity.model.default import default_checkpoint, prompt_for
from fidelity.model.load import load_checkpoint
from fidelity.model.synthesize import synthesize

DECODERS = ("production", "transformers", "trace:DIR")


def open_checkpoint(checkpoint: Checkpoint | str | Path | None, trace: TraceDecoder | None = None) -> Checkpoint:
    """A checkpoint object, a directory, or None: the trace's recorded checkpoint, else the trained default."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    if checkpoint is not None:
        return load_checkpoint(checkpoint)
    recorded = trace.manifest.get("checkpoint", {}) if trace is not None else {}
    if recorded.get("path"):
        return load_checkpoint(recorded["path"])
    if not recorded.get("preset"):
        return load_checkpoint(default_checkpoint())
    from fidelity.model.config import ModelConfig

    preset = recorded["preset"]
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


def check_trace_checkpoint(trace: TraceDecoder, ckpt: Checkpoint) -> None:
    """A trace recorded on another checkpoint (its content hash differs) is refused."""
    recorded = trace.manifest.get("checkpoint", {}).get("hash")
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
