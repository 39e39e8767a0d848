"""``fidelity.run``: one call from a decoder and a checkpoint to a judged run directory (the CLI's ``run`` calls it).

    import fidelity
    res = fidelity.run(decoder="transformers", checkpoint="ckpt/", decoder_dtype="bf16", decode_steps=16)
    res.verdict, res.first_divergence, res.run_dir
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from fidelity.model.default import RANDOM_PROMPT_LEN, default_checkpoint, default_prompt, is_default, prompt_for
from fidelity.model.load import load_checkpoint
from fidelity.model.synthesize import synthesize
from fidelity.model.weights import fp32_nbytes

DECODERS = ("production", "transformers", "trace:DIR")
SYNTH_LIMIT_BYTES = 4 << 30  # a preset larger than this in fp32 is synthesized on the GPU only
NAMES = {"checkpoint": "given", "preset": "given", "max_context": "max_context",
         "graphs": "graphs"}  # how errors name the inputs


class InputError(ValueError):
    """A run input that cannot work (a preset too large for the host, a prompt beyond max_context), found before
    any work."""


def warn(kind: str, message: str) -> None:
    """The default ``notify``: a ``UserWarning`` (``kind`` is ``note`` or ``warning``)."""
    warnings.warn(message, UserWarning, stacklevel=3)


def on_gpu(device: str | None) -> bool:
    return torch.device(device or "cpu").type == "cuda"


def preset_config(preset: str, layers: int | None = None, device: str = "cpu") -> ModelConfig:
    """The config of ``preset`` (its first ``layers``; cheap: nothing synthesized); one too large for the host is
    refused unless it can be generated on the GPU."""
    cfg = ModelConfig.preset(preset)
    if layers:
        cfg = cfg.first_layers(layers)
    if not on_gpu(device) and (size := fp32_nbytes(cfg)) > SYNTH_LIMIT_BYTES:
        raise InputError(f"preset '{preset}' has {size / 4e9:.1f}e9 parameters ({size / 2**30:.0f} GiB in fp32): on "
                         "a CPU synthesize only width-reduced configs (e.g. --preset tiny); release-sized slices "
                         "(--preset flash --layers 4) are generated on a GPU with --device cuda")
    return cfg


@dataclass
class CheckpointPlan:
    """The checkpoint a run reads, known before its weights are: one opened (headers only) or a preset that
    ``open`` synthesizes; ``config`` and the default ``prompt`` come first, so every input is checked before."""

    config: ModelConfig
    ckpt: Checkpoint | None = None
    preset: str = "tiny"
    seed: int = 0
    layers: int | None = None
    device: str = "cpu"
    what: str = ""  # the checkpoint in words, once opened

    @property
    def path(self) -> Path | None:
        return self.ckpt.path if self.ckpt is not None else None

    def prompt(self, length: int | None = None) -> torch.Tensor:
        """The default prompt: the trained default's text, else ``length`` random ids (``prompt_for``)."""
        if self.ckpt is not None:
            return prompt_for(self.ckpt, length, self.seed)
        return default_prompt(self.config.vocab_size, length or RANDOM_PROMPT_LEN, self.seed)

    def open(self) -> Checkpoint:
        """The checkpoint: the opened one, or the preset synthesized now. A preset too large for the host is
        generated on the GPU, each tensor when first read and kept there in its stored format (GPU tensors differ
        from the CPU's of the same seed)."""
        if self.ckpt is not None:
            self.what = self.what or in_words(self.ckpt)
            return self.ckpt
        device = self.device if on_gpu(self.device) and fp32_nbytes(self.config) > SYNTH_LIMIT_BYTES else "cpu"
        self.ckpt = synthesize(self.config, seed=self.seed, lazy=device != "cpu", device=device)
        layers = f", first {self.layers} layers" if self.layers else ""
        self.ckpt.origin.update(preset=self.preset + layers, device=str(device))
        self.what = f"preset '{self.preset}{layers}' (synthetic on {device}, seed {self.seed})"
        return self.ckpt


def plan_checkpoint(checkpoint: Checkpoint | str | Path | None = None, trace: TraceDecoder | None = None, *,
                    preset: str | None = None, seed: int = 0, layers: int | None = None, device: str = "cpu",
                    names: dict[str, str] | None = None,
                    notify: Callable[[str, str], None] = warn) -> CheckpointPlan:
    """The checkpoint of a run: ``checkpoint`` (opened, headers only), ``preset`` (``layers``, ``seed``), a
    replayed ``trace``'s recorded checkpoint (a relative path read from the trace's folder) or preset, else the
    trained default (for a trace, with a note saying so). A replayed trace's config must be the checkpoint's.
    ``names``: how errors name the checkpoint and preset inputs (the CLI: its options)."""
    names = {**NAMES, **(names or {})}
    recorded = (trace.manifest.get("checkpoint") or {}) if trace is not None and not preset else {}
    default = not (checkpoint or recorded.get("path") or preset or recorded.get("preset") or layers)
    ckpt, named = None, False  # named: the caller named the checkpoint or preset
    if isinstance(checkpoint, Checkpoint):
        ckpt, named = checkpoint, True
    elif checkpoint:
        ckpt, named = load_checkpoint(checkpoint), True
    elif recorded.get("path"):
        ckpt = load_trace_checkpoint(trace)
    elif default:
        ckpt = load_checkpoint(default_checkpoint())
    elif not preset and recorded.get("preset"):
        preset, seed = recorded["preset"], int(recorded.get("seed", 0))
    else:
        named = True
    preset = preset or "tiny"
    cfg = ckpt.config if ckpt is not None else preset_config(preset, layers, device)
    if trace is not None:
        given = f"{in_words(ckpt)} ({names['checkpoint']})" if ckpt is not None else \
            f"preset '{preset}' seed {seed} ({names['preset']})"
        check_trace_config(trace, cfg, given if named else recorded_checkpoint(trace))
        if default:
            notify("note", no_checkpoint_note(trace))
    return CheckpointPlan(cfg, ckpt, preset, seed, layers, device)


def open_checkpoint(checkpoint: Checkpoint | str | Path | None, trace: TraceDecoder | None = None) -> Checkpoint:
    """A checkpoint object, a directory, or None: the trace's recorded checkpoint, else the trained default (for a
    trace, with a warning saying so)."""
    return plan_checkpoint(checkpoint, trace).open()


def check_context(prompt_len: int, decode_steps: int, max_context: int, name: str = "max_context") -> None:
    """A prompt and decode steps that do not fit ``max_context`` are refused."""
    if prompt_len + decode_steps > max_context:
        raise InputError(f"prompt: {prompt_len} tokens + {decode_steps} decode steps exceeds {name} {max_context}")


def warn_past_max_seq_len(cfg: ModelConfig, prompt_len: int, decode_steps: int,
                          notify: Callable[[str, str], None] = warn) -> None:
    """One warning when a run reaches positions past the config's max_seq_len (it still runs)."""
    if prompt_len + decode_steps > cfg.max_seq_len:
        steps = f" + {plural(decode_steps, 'decode step')}" if decode_steps else ""
        notify("warning", f"prompt {plural(prompt_len, 'token')}{steps} goes past the config's max_seq_len "
                          f"{cfg.max_seq_len}; running anyway")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def open_decoder(decoder: Decoder | str, ckpt: Checkpoint, profile="reference", max_context: int = 4096,
                 device: str = "cpu", dtype: str = "bf16", graphs: bool | None = None) -> Decoder:
    """``production`` (``graphs``: its graph decode, ``ProductionDecoder``), ``transformers`` or ``trace:DIR`` (or a
    Decoder, returned as it is)."""
    if isinstance(decoder, Decoder):
        return decoder
    if decoder == "production":
        return ProductionDecoder(ckpt, profile, max_context, device, graphs=graphs)
    if decoder == "transformers":
        return TransformersDecoder.from_checkpoint(ckpt, dtype, device)
    if decoder.startswith("trace:"):
        return TraceDecoder(decoder.removeprefix("trace:"))
    raise ValueError(f"decoder: expected one of {DECODERS} or a Decoder, found {decoder!r}")


def check_graphs(graphs: bool | None, decoder: Decoder | str, name: str = "graphs") -> None:
    """``graphs`` given (True or False) for a decoder other than the one ``run`` builds as ``production`` is
    refused: graph decode is the production decoder's, and a Decoder passed in was built with its own setting."""
    if graphs is None or decoder == "production":
        return
    option = ("--graphs" if graphs else "--no-graphs") if name.startswith("--") else f"{name}={graphs}"
    found = decoder if isinstance(decoder, str) else f"a {type(decoder).__name__} passed in (built with its own)"
    raise InputError(f"{option}: graph decode applies to the production decoder that the run builds "
                     f"(decoder 'production'), found {found}")


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


def run(decoder: Decoder | str = "production", checkpoint: Checkpoint | CheckpointPlan | str | Path | None = None,
        prompt: Sequence[int] | torch.Tensor | int | None = None, decode_steps: int | None = None,
        modes: Sequence[str] = ("free", "layer", "op"), out: str | Path = "runs", *, run_id: str | None = None,
        profile: str = "reference", decoder_dtype: str = "bf16", device: str = "cpu", oracle_dtype: str = "fp32",
        thresholds: str | Path | None = None, trace: str | Path | None = None, write_dump: str | Path | None = None,
        overwrite: bool = False,
        progress: Callable[..., None] | None = None, notify: Callable[[str, str], None] = warn,
        names: dict[str, str] | None = None, graphs: bool | None = None, **spec_fields) -> RunResult:
    """Run ``decoder`` side by side with the oracle on ``checkpoint`` and write ``out/<run-id>/``.

    ``decoder``: ``production`` (the built-in decoder with ``profile``), ``transformers`` (DeepseekV4ForCausalLM in
    ``decoder_dtype``), ``trace:DIR`` (a recorded trace: its prompt and tokens are replayed), or any ``Decoder``.
    ``checkpoint``: a Checkpoint, a directory, a ``CheckpointPlan`` (``plan_checkpoint``) or None (``plan_checkpoint``'s
    default). ``prompt``: token ids, or a length for the deterministic default prompt (the trained default's own
    text, else 1024 random ids, when None; the first ``prompt`` ids of that text or random ids for a length).
    ``graphs`` (production only; None: on for ``device`` cuda, off on the CPU): decode in CUDA graphs, the sites
    recorded from the graph's outputs; True on the CPU runs the same fixed-shape step uncaptured; the manifest says
    which ran (``decode_graphs``, docs/running.md). ``trace``: also record the decoder's calls as a trace there;
    ``write_dump``: write the decoder's and the free-mode oracle's sites in SGLang's dumper layout there
    (docs/engines.md).
    ``notify(kind, message)`` hears notes and warnings (default: ``UserWarning``); ``names``: how errors name inputs
    (``max_context``, ``graphs``). ``spec_fields``: further
    ``RunSpec`` fields (``stream``, ``continuation``, ``sampler``, ``stop_ids``, ``max_context``,
    ``sample_queries``). Every input is checked before the checkpoint is synthesized or the run starts.
    """
    names = {**NAMES, **(names or {})}
    check_graphs(graphs, decoder, names["graphs"])
    replay = TraceDecoder(decoder.removeprefix("trace:")) if isinstance(decoder, str) and \
        decoder.startswith("trace:") else (decoder if isinstance(decoder, TraceDecoder) else None)
    plan = checkpoint if isinstance(checkpoint, CheckpointPlan) else \
        plan_checkpoint(checkpoint, replay, device=device, notify=notify)
    if replay is not None:
        if prompt is not None and list(torch.as_tensor(prompt).flatten().tolist()) != replay.prompt.tolist():
            raise TraceError(f"trace {replay.dir}: the prompt given differs from the trace's; leave it out to replay")
        prompt, decode_steps = replay.prompt, len(replay.generated)
        spec_fields.update(stream="given", continuation=torch.tensor(replay.generated, dtype=torch.long),
                           prefill_chunk=replay.chunks)
    if prompt is None or isinstance(prompt, int):
        prompt = plan.prompt(prompt)
    prompt = torch.as_tensor(prompt).long().flatten()
    steps = 64 if decode_steps is None else decode_steps
    max_context = spec_fields.get("max_context") or len(prompt) + steps
    check_context(len(prompt), steps, max_context, names["max_context"])
    warn_past_max_seq_len(plan.config, len(prompt), steps, notify)
    ckpt = plan.open()
    if replay is not None:
        check_trace_checkpoint(replay, ckpt)
    if spec_fields.get("tokenizer") is None and (tok := text.tokenizer_path(ckpt.path)) is not None:
        spec_fields["tokenizer"] = str(tok)
    spec_fields["max_context"] = max_context
    spec = RunSpec(prompt=prompt, decode_steps=steps, profile=profile, modes=tuple(modes), device=device,
                   oracle_dtype=ORACLE_DTYPES[oracle_dtype], **spec_fields)
    dec = replay or open_decoder(decoder, ckpt, profile, max_context, device, decoder_dtype, graphs)
    return run_job(ckpt, spec, out, run_id, thresholds, overwrite, progress, dec, trace, write_dump)
