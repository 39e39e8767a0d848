"""A recorded trace (``fidelity.decoders.trace_file``) replayed as a decoder under test: the calls must come in the
recorded order with the recorded tokens; each returns the recorded logits and hands the recorded sites to the
recorder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from fidelity.decoders.base import (
    LAYER_INPUTS,
    OP_INPUTS,
    OP_INPUTS_COMPRESSED,
    OP_INPUTS_INDEXER,
    Decoder,
    required_sites,
)
from fidelity.decoders.trace_file import MANIFEST, TraceError, read_manifest
from fidelity.model.config import ConfigError, ModelConfig
from fidelity.model.sites import SITE_TABLE, is_site, same_layer, site_name, site_template, trailing_shape

RESERVED = ("ids", "positions", "logits")
INTEGER_SITES = frozenset({"L{i}.indexer.topk", "L{i}.attn.visible", "L{i}.moe.experts"})  # the rest are floats
MODE_INPUTS = frozenset({*LAYER_INPUTS, *OP_INPUTS, *OP_INPUTS_COMPRESSED, *OP_INPUTS_INDEXER})
# sites the runner reads beside another one of the same layer and call: a CSA layer's visible set is judged
# against the decoder's own top-k picks, routing weights per expert id
READ_WITH = {"L{i}.attn.visible": "L{i}.indexer.topk", "L{i}.moe.weights": "L{i}.moe.experts"}


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
        pos, held = 0, []
        for step, ids in zip(self.steps, fed, strict=True):  # every step checked before a run starts
            held.append(self._check(step, ids, pos))
            pos += len(ids)
        self._check_sites(held)
        self.fed = fed

    def checkpoint_path(self) -> Path | None:
        """trace.json's ``checkpoint.path``, a relative one read from the trace's folder; None when it has none.
        TraceError (naming trace.json) when no checkpoint directory is there."""
        raw = (self.manifest.get("checkpoint") or {}).get("path")
        if not raw:
            return None
        path = self.dir / raw
        if not path.is_dir():
            found = "a file" if path.exists() else "nothing"
            raise TraceError(f"{self.dir / MANIFEST}: checkpoint.path {raw!r}: expected a checkpoint directory at "
                             f"{path} (a relative path is read from the trace's folder), found {found}; give the "
                             "checkpoint instead (--checkpoint)")
        return path

    def reset(self) -> None:
        """Rewind to the trace's first call."""
        self.pos = 0
        self.calls = 0

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

    def _check(self, step: dict, ids: torch.Tensor, pos: int) -> set[str]:
        """One step file (read from its header): readable, the ids fed and their positions, the logits' shape,
        every site's dtype, one row per token for per-token sites and the config's trailing shape; its sites are
        those trace.json lists for it. Returns the names of its sites."""
        path = self.dir / step["file"]
        n, vocab = len(ids), self.config.vocab_size
        try:
            with safe_open(str(path), framework="pt") as f:
                headers = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118
                shapes = {k: tuple(h.get_shape()) for k, h in headers.items()}
                dtypes = {k: h.get_dtype() for k, h in headers.items()}
                fed = {k: f.get_tensor(k).long() for k in ("ids", "positions") if k in shapes}
        except Exception as err:  # safetensors raises its own error types for missing or corrupt files
            raise TraceError(f"{path}: unreadable safetensors file: {err}") from None
        for key in RESERVED:
            if key not in shapes:
                raise TraceError(f"{path}: missing tensor {key!r}")
        for key, kind in (("ids", "integer"), ("positions", "integer"), ("logits", "float")):
            _check_dtype(path, key, kind, dtypes[key])
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
            template = site_template(name)
            _check_dtype(path, name, "integer" if template in INTEGER_SITES else "float", dtypes[name])
            per_token = not name.endswith(("compressed_kv", "indexer.keys"))
            if per_token and (not shape or shape[0] != n):
                raise TraceError(f"{path}: {name}: expected {n} rows (one per token of the call), found shape "
                                 f"{list(shape)}")
            rest = trailing_shape(template, self.config)
            if rest is not None and shape[1:] != rest:
                raise TraceError(f"{path}: {name}: expected shape [{shape[0] if shape else '?'}, "
                                 f"{', '.join(map(str, rest))}], found {list(shape)}")
        held = set(shapes) - set(RESERVED)
        if "sites" in step:
            listed = set(step["sites"]) - {"logits"}
            if absent := sorted(listed - held):
                raise TraceError(f"{path}: {absent[0]}: trace.json lists it for this step, the file does not hold it")
            if unlisted := sorted(held - listed):
                raise TraceError(f"{path}: {unlisted[0]}: the file holds it, trace.json does not list it for this "
                                 "step")
        return held

    def _check_sites(self, held: list[set[str]]) -> None:
        """Every step file holds the sites the runner reads from its call (``held``: each file's site names): a
        site another step file holds (at a decode call only those compared at every step or read by a mode), each
        layer's instance of the inputs of a mode whose every input the trace reports, and the sites read beside
        them (``READ_WITH``)."""
        first: dict[str, str] = {}
        for k, names in enumerate(held):
            for name in sorted(names):
                first.setdefault(name, self.steps[k]["file"])
        inputs: dict[str, str] = {}
        for mode in ("layer", "op"):
            need = required_sites(mode, self.config)
            if set(need) <= self._sites:
                why = f"the trace reports every input of {mode} mode, read at every call in each layer that has it"
                inputs.update({name: why for t in need for name in _layer_names(t, self.config)})
        for k, names in enumerate(held):
            prefill = k < self.n_prefill
            expected = dict(inputs)
            for name, file in first.items():
                t = site_template(name)
                if prefill or SITE_TABLE[t].every_step or t in MODE_INPUTS:
                    when = "every call" if SITE_TABLE[t].every_step or t in MODE_INPUTS else "the prefill"
                    expected.setdefault(name, f"{file} holds it, read at {when}")
            for name in list(expected):
                beside = READ_WITH.get(site_template(name))
                if beside and (other := same_layer(beside, name)) in _layer_names(beside, self.config):
                    expected.setdefault(other, f"the runner reads it beside {name}")
            missing = sorted(set(expected) - names)
            if missing:
                raise TraceError(f"{self.dir / self.steps[k]['file']}: {missing[0]}: expected "
                                 f"({expected[missing[0]]}), found none")


def _layer_names(template: str, cfg: ModelConfig) -> list[str]:
    """The site names of ``template`` in the layers where it exists (compressed entries: HCA and CSA layers; the
    indexer: CSA layers)."""
    if "{i}" not in template:
        return [template]
    ratios = cfg.compress_ratios
    if template.startswith("L{i}.indexer."):
        layers = [i for i in range(cfg.n_layers) if ratios[i] == 4]
    elif template == "L{i}.attn.compressed_kv":
        layers = [i for i in range(cfg.n_layers) if ratios[i]]
    else:
        layers = list(range(cfg.n_layers))
    return [site_name(template, i) for i in layers]


def _check_dtype(path: Path, name: str, kind: str, dtype: str) -> None:
    """``dtype`` (a safetensors header's: F32, BF16, I64, ...) is of ``kind``: float or integer."""
    found = "float" if dtype.startswith(("F", "BF")) else "integer" if dtype.startswith(("I", "U")) else dtype
    if found != kind:
        raise TraceError(f"{path}: {name}: expected {'an' if kind == 'integer' else 'a'} {kind} dtype, found {dtype}")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
