"""A recorded trace (``fidelity.decoders.trace_file``) replayed as a decoder under test: the calls must come in the
recorded order with the recorded tokens; each returns the recorded logits and hands the recorded sites to the
recorder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from fidelity.decoders.base import Decoder
from fidelity.decoders.trace_file import TraceError, read_manifest
from fidelity.model.config import ConfigError, ModelConfig
from fidelity.model.sites import is_site, site_template, trailing_shape

RESERVED = ("ids", "positions", "logits")


class TraceDecoder(Decoder):
    """Replays the trace in ``directory``; ``prompt`` and ``generated`` are what a run must feed it."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        try:
            self.config = ModelConfig.from_dict(self.manifest["config"], source=f"{self.dir}/trace.json: config")
        except ConfigError as err:
            raise TraceError(str(err)) from None
        self.prompt = torch.tensor(self.manifest["prompt"], dtype=torch.long)
        self.generated = [int(t) for t in self.manifest["generated"]]
        self.steps = self.manifest["steps"]
        self.n_prefill = len(self.steps) - len(self.generated)  # the prompt's calls (chunks), then one per token
        if self.n_prefill < 1:
            raise TraceError(f"{self.dir}/trace.json: steps: expected at least {len(self.generated) + 1} (the "
                             f"prefill and one per generated token), found {len(self.steps)}")
        self.label = f"trace ({self.manifest.get('decoder', 'unnamed')})"
        self.profile = dict(self.manifest.get("profile") or {"name": self.dir.name, "precision": "bf16"})
        self.rec = None
        self.pos = 0
        self.calls = 0
        names = {n for s in self.steps for n in s.get("sites", [])}
        unknown = sorted(n for n in names if not is_site(n))
        if unknown:
            raise TraceError(f"{self.dir}/trace.json: unknown site names {unknown[:5]}; sites are listed in "
                             "fidelity.model.sites.SITES")
        self._sites = frozenset(site_template(n) for n in names) | {"logits"}
        sizes = [s["positions"][1] - s["positions"][0] for s in self.steps[: self.n_prefill]]
        if sum(sizes) != len(self.prompt):
            raise TraceError(f"{self.dir}/trace.json: the prefill steps cover {sum(sizes)} positions, the prompt has "
                             f"{len(self.prompt)} tokens")
        self.chunks = sizes  # the prompt's chunks, as the trace's engine fed them
        fed = [*self.prompt.split(sizes), *(torch.tensor([t]) for t in self.generated)]
        pos = 0
        for step, ids in zip(self.steps, fed, strict=True):  # every step checked before a run starts
            self._check(self.dir / step["file"], ids, pos)
            pos += len(ids)
        self.fed = fed

    def sites(self) -> frozenset[str]:
        return self._sites

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids).long().flatten()
        if self.calls >= self.n_prefill:
            raise TraceError(f"trace {self.dir}: prefill call {self.calls + 1}; the trace has {self.n_prefill}")
        want = self.fed[self.calls]
        if not torch.equal(ids, want):
            first = _first_difference(ids.tolist(), want.tolist())
            raise TraceError(f"trace {self.dir}: prefill call {self.calls + 1} differs from the trace's at token "
                             f"{first} (run: {len(ids)} tokens, trace: {len(want)}); replay with the trace's prompt "
                             "and chunks")
        return self._replay(ids)

    def step(self, token: int) -> torch.Tensor:
        k = self.calls - self.n_prefill
        if k >= len(self.generated):
            raise TraceError(f"trace {self.dir}: decode step {k + 1} requested, the trace has {len(self.generated)}")
        if int(token) != self.generated[k]:
            raise TraceError(f"trace {self.dir}: decode step {k + 1} fed token {int(token)}, the trace fed "
                             f"{self.generated[k]}; replay with the trace's tokens (stream 'given')")
        return self._replay(torch.tensor([int(token)]))[0]

    def _replay(self, ids: torch.Tensor) -> torch.Tensor:
        with safe_open(str(self.dir / self.steps[self.calls]["file"]), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        if self.rec is not None:
            self.rec.step = self.calls
            for name, t in tensors.items():
                if name not in RESERVED and self.rec.wants(name):
                    self.rec(name, t)
            if self.rec.wants("logits"):
                self.rec("logits", tensors["logits"])
        self.pos += len(ids)
        self.calls += 1
        return tensors["logits"].float()

    def _check(self, path: Path, ids: torch.Tensor, pos: int) -> None:
        """One step file: readable, the ids fed and their positions, the logits' shape, one row per token for
        per-token sites and the config's trailing shape for every site (read from the header)."""
        n, vocab = len(ids), self.config.vocab_size
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
                fed = {k: f.get_tensor(k).long() for k in ("ids", "positions") if k in shapes}
        except Exception as err:  # safetensors raises its own error types for missing or corrupt files
            raise TraceError(f"{path}: unreadable safetensors file: {err}") from None
        for key in RESERVED:
            if key not in shapes:
                raise TraceError(f"{path}: missing tensor {key!r}")
        if not torch.equal(fed["ids"], ids):
            raise TraceError(f"{path}: ids {fed['ids'].tolist()[:8]} differ from the tokens fed {ids.tolist()[:8]} "
                             "(trace.json's prompt and generated)")
        if not torch.equal(fed["positions"], torch.arange(pos, pos + n)):
            raise TraceError(f"{path}: positions: expected {pos}..{pos + n - 1}, found {fed['positions'].tolist()[:8]}")
        if shapes["logits"] != (n, vocab):
            raise TraceError(f"{path}: logits: expected shape [{n}, {vocab}], found {list(shapes['logits'])}")
        for name, shape in shapes.items():
            if name in RESERVED:
                continue
            if not is_site(name):
                raise TraceError(f"{path}: unknown site {name!r}; sites are listed in fidelity.model.sites.SITES")
            per_token = not name.endswith(("compressed_kv", "indexer.keys"))
            if per_token and (not shape or shape[0] != n):
                raise TraceError(f"{path}: {name}: expected {n} rows (one per token of the call), found shape "
                                 f"{list(shape)}")
            rest = trailing_shape(site_template(name), self.config)
            if rest is not None and shape[1:] != rest:
                raise TraceError(f"{path}: {name}: expected shape [{shape[0] if shape else '?'}, "
                                 f"{', '.join(map(str, rest))}], found {list(shape)}")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
