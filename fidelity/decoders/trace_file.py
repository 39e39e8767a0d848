"""Traces: what a decoder computed, recorded by any engine's decode loop and judged offline against the oracle.

A trace is a directory:

- ``trace.json``: ``{"format": "dsv4-fidelity-trace", "version": 1, "decoder": label, "config": {...} (the
  official ``config.json`` fields), "profile": {...} (the decoder's numerics: a profile's fields, or ``name`` and
  ``precision``: exact / bf16 / quantized), "checkpoint": {...} (optional: path, a relative one read from the
  trace's folder, or preset and seed, and hash; without one a replay uses the trained default), "prompt": [ids],
  "generated": [ids fed at the decode steps], "steps": [{"file", "positions": [first, last + 1], "sites": [the
  file's site names]}]}``
- ``step-00000.safetensors`` (one file per model call: the prefill, then one per decode step): ``ids`` int64 [n]
  (the tokens of the call), ``positions`` int64 [n] (their positions), ``logits`` float [n, vocab], and any site
  of ``fidelity/model/sites.py`` under its name (``L3.attn.out`` ...), rows in the call's token order, floats
  except the integer ``indexer.topk``, ``attn.visible`` and ``moe.experts``. A site reported in one call is
  reported in every call, in each layer that has it (a site compared in the prefill only that no mode reads later,
  such as ``mhc_attn.pre``, in the prefill's calls only).

``TraceWriter`` writes one from a plain PyTorch decode loop (README "Test your own decoder"); ``TraceDecoder``
(``fidelity.decoders.trace``) replays it. The directory is written under a temporary name and renamed when
``finish`` is called, so a trace is never half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from fidelity.atomic_write import OutputError, check_new_dir
from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder, is_site

FORMAT, VERSION, MANIFEST = "dsv4-fidelity-trace", 1, "trace.json"


class TraceError(ValueError):
    """A trace that cannot be written or used; the message names the file, field or site, expected vs found."""


class TraceWriter:
    """Records a decoder's calls into a trace directory.

    Call it like a ``Recorder`` (``writer(site, tensor)``) while a model call runs, then ``end_step(ids, logits)``
    after the call; ``finish()`` after the last. ``config`` is a ``ModelConfig`` or a ``config.json`` path.
    """

    def __init__(self, directory: str | Path, config: ModelConfig | str | Path, prompt, decoder: str = "unnamed",
                 profile: dict | None = None, checkpoint: dict | None = None, overwrite: bool = False):
        """``profile``: the decoder's numerics, as a run manifest's profile (``{"name": ..., "precision": "bf16"}``
        picks the default thresholds of a bf16 decoder; ``exact`` / ``quantized`` the others)."""
        self.target = check_new_dir(directory, overwrite, "trace")
        self.config = config if isinstance(config, ModelConfig) else ModelConfig.from_file(config)
        self.prompt = [int(t) for t in torch.as_tensor(prompt).flatten().tolist()]
        self.decoder, self.checkpoint, self.overwrite = decoder, dict(checkpoint or {}), overwrite
        self.profile = dict(profile or {"name": decoder, "precision": "bf16"})
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.partial-", dir=self.target.parent))
        except OSError as err:
            raise OutputError(f"trace {self.target}: cannot write in {self.target.parent}: {err.strerror}") from None
        self.steps: list[dict] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pos = 0

    def wants(self, site: str) -> bool:  # Recorder-compatible
        return True

    def __call__(self, site: str, tensor: torch.Tensor) -> None:
        """Record ``tensor`` at ``site`` for the call in progress (rows concatenate if called twice)."""
        if not is_site(site):
            raise TraceError(f"trace: unknown site {site!r}; sites are listed in fidelity.model.sites.SITES")
        t = tensor.detach().to("cpu").contiguous()
        self.pending[site] = torch.cat((self.pending[site], t)) if site in self.pending else t

    def end_step(self, ids, logits: torch.Tensor) -> None:
        """Close the call that fed ``ids`` [n] (the prompt, then one token per decode step): its logits [n, vocab]
        (or [vocab] for one token) and the sites recorded since the previous call."""
        ids = torch.as_tensor(ids).long().flatten().cpu()
        logits = logits.detach().float().cpu().reshape(len(ids), -1)
        positions = torch.arange(self.pos, self.pos + len(ids))
        self._write(ids, positions, logits, self.pending)
        self.pending = {}

    def add_step(self, ids: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor, rec: Recorder) -> None:
        """The runner's path: one call's ids, positions, logits and the decoder's recorder."""
        sites = {site: rec.get(site) for site in rec.records}
        self._write(torch.as_tensor(ids).long().cpu(), positions.long().cpu(), logits.detach().float().cpu(), sites)

    def _write(self, ids: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor,
               sites: dict[str, torch.Tensor]) -> None:
        if int(positions[0]) != self.pos:
            raise TraceError(f"trace: step {len(self.steps)} starts at position {int(positions[0])}, expected "
                             f"{self.pos}")
        name = f"step-{len(self.steps):05d}.safetensors"
        tensors = {"ids": ids, "positions": positions, "logits": logits,
                   **{k: v.contiguous() for k, v in sites.items() if k != "logits"}}
        try:
            save_file(tensors, str(self.tmp / name), metadata={"format": "pt"})
        except OSError as err:
            raise OutputError(f"trace {self.target}: cannot write {name}: {err.strerror}") from None
        self.steps.append({"file": name, "positions": [int(positions[0]), int(positions[-1]) + 1],
                           "sites": sorted(sites)})
        self.pos += len(ids)

    def abort(self) -> None:
        """Remove what was written (a run that failed leaves no trace behind)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self, generated=None, checkpoint: dict | None = None) -> Path:
        """Write trace.json and move the trace into place. ``generated``: the ids fed at the decode steps
        (default: read from the steps)."""
        if not self.steps:
            raise TraceError("trace: no step was recorded")
        if generated is None:
            generated = [int(i) for s in self.steps[1:] for i in _ids_of(self.tmp / s["file"])]
        recorded = {**self.checkpoint, **(checkpoint or {})}
        if recorded.get("path"):
            recorded["path"] = self._relative(recorded["path"])
        manifest = {"format": FORMAT, "version": VERSION, "decoder": self.decoder, "profile": self.profile,
                    "config": self.config.to_official_dict(), "checkpoint": recorded,
                    "prompt": self.prompt, "generated": [int(t) for t in generated], "steps": self.steps}
        try:
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            self.tmp.chmod(0o755)
            if self.target.exists():
                if not self.overwrite:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    raise OutputError(f"trace {self.target}: appeared while writing; not replaced")
                shutil.rmtree(self.target)
            self.tmp.rename(self.target)
        except OSError as err:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise OutputError(f"trace {self.target}: cannot write: {err.strerror}") from None
        return self.target

    def _relative(self, path: str | Path) -> str:
        """A checkpoint path as trace.json holds it: an absolute one as it is, a relative one (to the current
        directory) made relative to the trace's folder, where a replay reads it from."""
        if Path(path).is_absolute():
            return str(path)
        return os.path.relpath(Path(path).resolve(), self.target.resolve())


def _ids_of(path: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("ids").tolist()


def read_manifest(directory: str | Path) -> dict:
    """A trace's ``trace.json``, checked for its format; TraceError names what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise TraceError(f"trace {directory}: no {MANIFEST} (is it a trace directory?)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise TraceError(f"{path}: format: expected {FORMAT!r}, found {found!r}")
    if manifest.get("version") != VERSION:
        raise TraceError(f"{path}: version: expected {VERSION}, found {manifest.get('version')!r}")
    for key in ("config", "prompt", "generated", "steps"):
        if key not in manifest:
            raise TraceError(f"{path}: missing field {key!r}")
    return manifest
