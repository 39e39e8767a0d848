"""A recorded trace (``fidelity.decoders.trace_file``) replayed as a decoder under test, one sequence at a time: the
calls must come in the recorded order with the recorded tokens; each returns the recorded logits and hands the
recorded sites (this sequence's rows, shards joined) to the recorder."""

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
from fidelity.decoders.trace_file import (
    ENTRY_SITES,
    MANIFEST,
    REPLICATED,
    Segment,
    TraceError,
    read_trace,
    stored_name,
)
from fidelity.model.config import ConfigError, ModelConfig
from fidelity.model.sites import (
    SITE,
    SITE_TABLE,
    Recorder,
    is_site,
    same_layer,
    site_name,
    site_template,
    trailing_shape,
)

RESERVED = ("ids", "positions", "logits")
# the rest are floats; attn.kv_cache holds raw bytes (uint8 / any integer dtype of 1 byte)
INTEGER_SITES = frozenset({SITE.indexer_topk, SITE.attn_visible, SITE.moe_experts, SITE.attn_kv_cache})
MODE_INPUTS = frozenset({*LAYER_INPUTS, *OP_INPUTS, *OP_INPUTS_COMPRESSED, *OP_INPUTS_INDEXER})
# sites the runner reads beside another one of the same layer and call: a CSA layer's visible set is judged
# against the decoder's own top-k picks, routing weights per expert id
READ_WITH = {SITE.attn_visible: SITE.indexer_topk, SITE.moe_weights: SITE.moe_experts}


class TraceHeader:
    """A trace's trace.json alone, checked (fields, events, positions), and its model config: enough to choose and
    check the checkpoint of a replay before any step file is read."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.trace = read_trace(self.dir)
        self.manifest = self.trace.manifest
        try:
            self.config = ModelConfig.from_dict(self.manifest["config"], source=f"{self.dir}/trace.json: config")
        except ConfigError as err:
            raise TraceError(str(err)) from None

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


class TraceDecoder(TraceHeader, Decoder):
    """Replays one sequence of the trace in ``directory`` (``seq``: which; may be left out when the trace holds
    one): its timeline (a fork's parent's calls up to the fork, rows a rollback voided left out) as the runner
    drives a decoder: ``prompt`` in ``chunks`` (its calls up to the last of several tokens), then ``generated``
    one token per call. Every step file is checked (read from its header) before a run starts."""

    def __init__(self, directory: str | Path, seq: int | None = None):
        super().__init__(directory)
        seqs = self.trace.sequences
        if seq is None and len(seqs) > 1:
            raise TraceError(f"trace {self.dir}: holds sequences {seqs}; replay one (TraceDecoder(dir, seq=K), "
                             "--trace-seq K) or run them all (fidelity run --decoder trace:DIR without --trace-seq)")
        self.seq = seqs[0] if seq is None else int(seq)
        self.steps = self.trace.timeline(self.seq)
        names = {stored_name(n)[0] for c in self.trace.calls for n in c.sites}
        unknown = sorted(n for n in names if not is_site(n))
        if unknown:
            raise TraceError(f"{self.dir}/trace.json: unknown site names {unknown[:5]}; sites are listed in "
                             "fidelity.model.sites.SITES")
        held = [self._check(step) for step in self.steps]  # every step checked before a run starts
        several = [k for k, s in enumerate(self.steps) if s.keep > 1]
        self.n_prefill = several[-1] + 1 if several else 1  # the prompt's calls (chunks), then one per token
        fed = [self._ids(s) for s in self.steps]
        if self.manifest["version"] == 1:
            self._check_v1_tokens(fed)
        self.fed = fed
        self.prompt = torch.cat(fed[: self.n_prefill])
        self.chunks = [len(t) for t in fed[: self.n_prefill]]  # the prompt's chunks, as the trace's engine fed them
        self.generated = [int(t) for t in fed[self.n_prefill :]]
        who = self.manifest.get("decoder", "unnamed")
        self.label = f"trace ({who})" if len(seqs) == 1 else f"trace ({who}), sequence {self.seq}"
        self.profile = dict(self.manifest.get("profile") or {"name": self.dir.name, "precision": "bf16"})
        self.rec = None
        self.pos = 0
        self.calls = 0
        self._held: list[tuple[dict, dict]] | None = None  # every step's tensors and rank parts, once ``in_memory``
        self._sites = frozenset(site_template(n) for names in held for n in names) | {"logits"}
        self._check_sites(held)

    def _check_v1_tokens(self, fed: list[torch.Tensor]) -> None:
        """A version 1 trace's prompt and generated ids (trace.json) are the tokens its step files hold."""
        prompt, generated = self.manifest["prompt"], self.manifest["generated"]
        n_prompt = len(self.steps) - len(generated)
        sizes = [len(t) for t in fed[: max(n_prompt, 0)]]
        if n_prompt < 1 or sum(sizes) != len(prompt):
            raise TraceError(f"{self.dir}/trace.json: the prefill steps cover {sum(sizes)} positions, the prompt has "
                             f"{len(prompt)} tokens")
        want = [*torch.tensor(prompt, dtype=torch.long).split(sizes), *(torch.tensor([t]) for t in generated)]
        for step, got, ids in zip(self.steps, fed, want, strict=True):
            if not torch.equal(got, ids):
                raise TraceError(f"{self.dir / step.call.file}: ids {got.tolist()[:8]} differ from the tokens fed "
                                 f"{ids.tolist()[:8]} (trace.json's prompt and generated)")

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

    def recorded_calls(self) -> list[tuple[torch.Tensor, Recorder]]:
        """Every call of this sequence as the runner will replay it: its token ids and a recorder holding its sites
        (what a stream oracle reads ahead of the run)."""
        out = []
        for k, step in enumerate(self.steps):
            tensors, _ = self._held[k] if self._held is not None else self._tensors(step)
            rec = Recorder(device=None, step=k)
            for name, t in tensors.items():
                if name != "logits":
                    rec(name, t)
            out.append((self.fed[k], rec))
        return out

    def in_memory(self) -> TraceDecoder:
        """Every step's tensors read now (this sequence's rows, shards joined), so that the trace's folder may go;
        returns itself."""
        self._held = [self._tensors(step) for step in self.steps]
        return self

    def _tensors(self, step: Segment) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
        """This sequence's rows of ``step``'s tensors (shards joined), and of each sharded site its ranks' own rows
        ``[(rank, dim or None (a whole copy), tensor)]``, which the runner judges one by one too."""
        tensors, parts = {}, {}
        with safe_open(str(self.dir / step.call.file), framework="pt") as f:
            for name, stored in self._resolve(step, list(f.keys())).items():  # noqa: SIM118 (no __iter__)
                own = "@" in stored[0]
                if name == "logits":
                    tensors[name] = self._logits(step, self._joined(f, stored), own)
                    continue
                tensors[name] = self._rows(step, name, self._joined(f, stored), own)
                dim = self.trace.split_dim(stored[0]) if len(stored) > 1 else None
                if dim is not None and site_template(name) not in ENTRY_SITES:
                    parts[name] = [(r, None if dim == REPLICATED else dim, self._rows(step, name, f.get_tensor(p), own))
                                   for r, p in enumerate(stored)]
        return tensors, parts

    def _logits(self, step: Segment, t: torch.Tensor, own: bool) -> torch.Tensor:
        """This sequence's logits of ``step``: its rows, or where the engine computed only each sequence's last row
        (one logits row per sequence of the call), that row alone."""
        if not own and self._last_rows_only(step, t.shape[0]):
            k = step.call.rows.index(step.rows)
            return t[k : k + 1]
        return self._rows(step, "logits", t, own)

    def _last_rows_only(self, step: Segment, n: int) -> bool:
        total = sum(r.n for r in step.call.rows)
        return n == len(step.call.rows) and n != total

    def _replay(self, ids: torch.Tensor) -> torch.Tensor:
        step = self.steps[self.calls]
        tensors, parts = self._held[self.calls] if self._held is not None else self._tensors(step)
        if self.rec is not None:
            self.rec.step = self.calls
            for name, t in tensors.items():
                if name != "logits" and self.rec.wants(name):
                    self.rec(name, t)
                    for rank, dim, part in parts.get(name, ()) if hasattr(self.rec, "part") else ():
                        self.rec.part(name, rank, len(parts[name]), dim, part)
            if self.rec.wants("logits"):
                last = len(tensors["logits"]) == 1 and step.keep > 1
                self.rec("logits", tensors["logits"], at=torch.tensor([step.keep - 1]) if last else None)
        self.pos += len(ids)
        self.calls += 1
        return tensors["logits"].float()

    # ---- reading one step's tensors ---------------------------------------------------------------------------
    def _resolve(self, step: Segment, keys: list[str]) -> dict[str, list[str]]:
        """This sequence's tensors in ``step``'s file: {site or ``logits``: the stored names holding it (one, or
        its shards by rank)}; a site stored for this sequence (``@seq``) wins over the call's whole tensor."""
        chosen: dict[str, tuple[bool, dict[int | None, str]]] = {}
        for key in keys:
            if key in ("ids", "positions", "seq"):
                continue
            site, seq, rank = stored_name(key)
            if seq is not None and seq != step.rows.seq:
                continue
            own = seq is not None
            have = chosen.get(site)
            if have is None or (own and not have[0]):
                chosen[site] = (own, {})
            if chosen[site][0] == own:
                chosen[site][1][rank] = key
        out = {}
        for site, (_, parts) in chosen.items():
            ranks = self.trace.ranks if None not in parts else 1
            if set(parts) != ({None} if ranks == 1 else set(range(ranks))):
                missing = sorted(set(range(ranks)) - set(parts))
                raise TraceError(f"{self.dir / step.call.file}: {site}: shards of ranks {missing} missing (expected "
                                 f"#0..#{ranks - 1}, trace.json's shards.ranks)")
            out[site] = [parts[r] for r in sorted(parts, key=lambda r: -1 if r is None else r)]
        return out

    def _joined(self, f, parts: list[str], header: bool = False):
        """One stored tensor, or its shards joined along the trace's split dim (``header``: the safetensors
        slices, for shapes and dtypes without reading data)."""
        get = f.get_slice if header else f.get_tensor
        if len(parts) == 1:
            return get(parts[0])
        dim = self.trace.split_dim(parts[0])
        if dim == REPLICATED:
            return get(parts[0])
        if header:
            shapes = [list(f.get_slice(p).get_shape()) for p in parts]
            shape = shapes[0][:dim] + [sum(s[dim] for s in shapes)] + shapes[0][dim + 1 :]
            return _Header(shape, f.get_slice(parts[0]).get_dtype())
        return torch.cat([f.get_tensor(p) for p in parts], dim=dim)

    def _rows(self, step: Segment, site: str, t: torch.Tensor, own: bool) -> torch.Tensor:
        """This sequence's kept rows of ``site``'s tensor ``t``: stored for this sequence (``own``) or the call's
        whole tensor."""
        if site_template(site) in ENTRY_SITES:
            return self._entries(step, site, t)
        lo = 0 if own else step.rows.offset
        return t[lo : lo + step.keep]

    def _entries(self, step: Segment, site: str, t):
        """The compressed entries of ``step``'s kept rows: the first (start + keep)//r - start//r of those its call
        completed (r: the layer's ratio; 4 for indexer keys)."""
        layer = int(site[1 : site.index(".")])
        r = 4 if site.endswith("indexer.keys") else self.config.compress_ratios[layer]
        full = (step.start + step.rows.n) // r - step.start // r
        keep = step.stop // r - step.start // r
        n = t[0] if isinstance(t, list) else t.shape[0]
        if step.keep < step.rows.n and n != full:
            raise TraceError(f"{self.dir / step.call.file}: {site}: expected {full} entries (the blocks its call "
                             f"completes), found {n}; the call is cut by a rollback or fork, so its entries must be "
                             "these")
        return t[:keep] if step.keep < step.rows.n else t

    def _ids(self, step: Segment) -> torch.Tensor:
        with safe_open(str(self.dir / step.call.file), framework="pt") as f:
            return f.get_tensor("ids").long()[step.rows.offset : step.rows.offset + step.keep]

    def _check(self, step: Segment) -> set[str]:
        """One step file (read from its header): readable, this sequence's ids, positions and rows, the logits'
        shape, every site's dtype, one row per token for per-token sites and the config's trailing shape; the
        file holds what trace.json lists for it. Returns the names of this sequence's sites in it."""
        path = self.dir / step.call.file
        vocab, n = self.config.vocab_size, step.keep
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())  # noqa: SIM118
                resolved = self._resolve(step, keys)
                if missing := [k for k in ("ids", "positions", "logits") if k not in (*keys, *resolved)]:
                    raise TraceError(f"{path}: missing tensor {missing[0]!r}")
                headers = {name: (self._joined(f, parts, header=True), "@" in parts[0])
                           for name, parts in resolved.items()}
                fed = {k: f.get_tensor(k).long() for k in ("ids", "positions", "seq") if k in keys}
                dtypes = {k: f.get_slice(k).get_dtype() for k in ("ids", "positions", "seq") if k in keys}
        except TraceError:
            raise
        except Exception as err:  # safetensors raises its own error types for missing or corrupt files
            raise TraceError(f"{path}: unreadable safetensors file: {err}") from None
        for key, kind in (("ids", "integer"), ("positions", "integer"), ("seq", "integer")):
            if key in dtypes:
                _check_dtype(path, key, kind, dtypes[key])
        _check_dtype(path, "logits", "float", headers["logits"][0].get_dtype())
        total = sum(r.n for r in step.call.rows)
        if len(fed["ids"]) != total:
            raise TraceError(f"{path}: ids: expected {total} rows (trace.json's rows for this call), found "
                             f"{len(fed['ids'])}")
        want_seq = torch.cat([torch.full((r.n,), r.seq) for r in step.call.rows])
        if "seq" in fed and not torch.equal(fed["seq"], want_seq):
            raise TraceError(f"{path}: seq: expected {want_seq.tolist()[:8]} (trace.json's rows), found "
                             f"{fed['seq'].tolist()[:8]}")
        if "seq" not in fed and len(step.call.rows) > 1:
            raise TraceError(f"{path}: missing tensor 'seq' (the call holds {len(step.call.rows)} sequences)")
        if bad := ((fed["ids"] < 0) | (fed["ids"] >= vocab)).nonzero().flatten().tolist():
            raise TraceError(f"{path}: ids: row {bad[0]} is {int(fed['ids'][bad[0]])}, expected a token id in [0, "
                             f"{vocab}) (the config's vocab_size; an engine's padding rows do not belong in a "
                             f"trace){f', and {len(bad) - 1} more rows' if len(bad) > 1 else ''}")
        rows = fed["positions"][step.rows.offset : step.rows.offset + step.rows.n]
        if not torch.equal(rows, torch.arange(step.start, step.start + step.rows.n)):
            raise TraceError(f"{path}: positions: expected {step.start}..{step.start + step.rows.n - 1}, found "
                             f"{rows.tolist()[:8]}")
        self._check_shapes(step, path, headers, total, n, vocab)
        held = set(headers) - {"logits"}
        listed = {stored_name(s)[0] for s in step.call.sites if stored_name(s)[1] in (None, step.rows.seq)}
        stored = {stored_name(k)[0] for k in keys if k not in ("ids", "positions", "seq", "logits")
                  and stored_name(k)[1] in (None, step.rows.seq)}
        if self.manifest["version"] == 1 or step.call.sites:
            if absent := sorted(listed - stored):
                raise TraceError(f"{path}: {absent[0]}: trace.json lists it for this step, the file does not hold it")
            if unlisted := sorted(stored - listed):
                raise TraceError(f"{path}: {unlisted[0]}: the file holds it, trace.json does not list it for this "
                                 "step")
        return held

    def _check_shapes(self, step: Segment, path: Path, headers: dict, total: int, n: int, vocab: int) -> None:
        many = len(step.call.rows) > 1
        for name, (h, own) in headers.items():
            shape = list(h.get_shape())
            rows_stored = step.rows.n if own else total
            if name == "logits":
                last = self._last_rows_only(step, shape[0] if shape else 0) and not own
                if shape != [rows_stored, vocab] and not (last and shape[1:] == [vocab]):
                    raise TraceError(f"{path}: logits: expected shape [{rows_stored}, {vocab}], found {shape} (a "
                                     "row per token of the call, or per sequence: its last)")
                continue
            if not is_site(name):
                raise TraceError(f"{path}: unknown site {name!r}; sites are listed in fidelity.model.sites.SITES")
            template = site_template(name)
            _check_dtype(path, name, "integer" if template in INTEGER_SITES else "float", h.get_dtype())
            per_token = template not in ENTRY_SITES
            if not per_token and many and not own:
                raise TraceError(f"{path}: {name}: a call of several sequences stores compressed entries per "
                                 f"sequence ({name}@<seq>), found the call's whole tensor")
            if per_token and (not shape or shape[0] != rows_stored):
                whose = "" if rows_stored == total else f" of sequence {step.rows.seq}"
                raise TraceError(f"{path}: {name}: expected {rows_stored} rows (one per token of the call{whose}), "
                                 f"found shape {shape}")
            rest = trailing_shape(template, self.config)
            if rest is not None and tuple(shape[1:]) != rest:
                raise TraceError(f"{path}: {name}: expected shape [{shape[0] if shape else '?'}, "
                                 f"{', '.join(map(str, rest))}], found {shape}")
            if not per_token:
                self._entries(step, name, shape)

    def _check_sites(self, held: list[set[str]]) -> None:
        """Every step file holds the sites the runner reads from its call (``held``: each file's site names): a
        site another step file holds (at a decode call only those compared at every step or read by a mode), each
        layer's instance of the inputs of a mode whose every input the trace reports, and the sites read beside
        them (``READ_WITH``)."""
        first: dict[str, str] = {}
        for k, names in enumerate(held):
            for name in sorted(names):
                first.setdefault(name, self.steps[k].call.file)
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
                raise TraceError(f"{self.dir / self.steps[k].call.file}: {missing[0]}: expected "
                                 f"({expected[missing[0]]}), found none")


class _Header:
    """The shape and dtype of shards joined (what a safetensors slice says of one tensor)."""

    def __init__(self, shape: list[int], dtype: str):
        self.shape, self.dtype = shape, dtype

    def get_shape(self) -> list[int]:
        return self.shape

    def get_dtype(self) -> str:
        return self.dtype


def _layer_names(template: str, cfg: ModelConfig) -> list[str]:
    """The site names of ``template`` in the layers where it exists (compressed entries: HCA and CSA layers; the
    indexer: CSA layers)."""
    if "{i}" not in template:
        return [template]
    ratios = cfg.compress_ratios
    if template.startswith("L{i}.indexer."):
        layers = [i for i in range(cfg.n_layers) if ratios[i] == 4]
    elif template == SITE.attn_compressed_kv:
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
