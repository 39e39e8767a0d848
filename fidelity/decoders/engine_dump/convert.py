"""An engine's dump, read as the engine wrote it, made into a trace (docs/traces.md) that ``TraceDecoder`` replays:
one call per forward pass, rows aligned to sequences (``align``), names mapped to sites (``names``), rank tensors
joined by the engine's ``dims`` annotations (``dims``; the name map's when the dump has none; else by shape: the
config's full shape on every rank = replicated, a part of it along one dim = concatenated). Concatenated shards and
replicated copies that disagree are kept per rank (``<site>#<rank>``), so each rank is judged on its own too."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from fidelity.decoders.engine_dump.align import Aligner, PassRows
from fidelity.decoders.engine_dump.dims import REPLICATED, DimsError, Join, parse_dims
from fidelity.decoders.engine_dump.names import NameMap, NameMapError
from fidelity.decoders.engine_dump.read import Dump, DumpError, Entry
from fidelity.decoders.trace_file import FORMAT, MANIFEST, VERSION
from fidelity.model.config import ModelConfig
from fidelity.model.sites import site_template, trailing_shape

PRECISIONS = ("exact", "bf16", "quantized")


def convert(dump: Dump, names: NameMap, cfg: ModelConfig, out: Path, precision: str = "quantized") -> dict:
    """Write ``dump`` as a trace in ``out`` (an empty folder); returns what the conversion saw (the run manifest's
    ``dump``: format, ranks, passes, padded rows, unmapped names)."""
    by_pass: dict[int, dict[int, list[Entry]]] = defaultdict(lambda: defaultdict(list))
    for e in dump.entries:
        by_pass[e.step][e.rank].append(e)
    _check_ranks(dump, by_pass)
    aligner, events, unmapped, padded, shard_dims = Aligner(str(dump.directory)), [], set(), 0, {}
    late_logits = _hook_logits(dump, by_pass, names)
    steps = sorted(by_pass)
    if late_logits and steps[-1] not in late_logits:
        steps = steps[:-1]  # its logits would be in the file of a pass that did not run
    for k, step in enumerate(steps):
        ranks = by_pass[step]
        rows = aligner.align(step, *_batch(dump, step, ranks, names))
        if not rows.rows:
            continue
        padded += rows.padded
        sites, dims = _sites(dump, step, ranks, names, cfg, rows, unmapped)
        shard_dims.update(dims)
        logits = sites.pop("logits", None)
        if logits is None:
            logits = _meta_logits(dump, step, ranks, names, rows, late_logits)
        name = f"call-{k:05d}.safetensors"
        _write(out / name, rows, logits, sites, cfg)
        events.append({"call": name, "rows": [[s, start, n] for s, start, n, _ in rows.rows],
                       "sites": sorted(k for k in sites if k != "logits")})
    if not events:
        raise DumpError(f"{dump.directory}: no forward pass with rows to judge")
    seen = {"format": f"{dump.kind} dump", "directory": str(dump.directory), "ranks": dump.world,
            "passes": len(events), "passes_without_logits": len(by_pass) - len(steps), "padded_rows": padded,
            "unmapped": sorted(unmapped), "name_map": names.sources}
    manifest = {"format": FORMAT, "version": VERSION, "decoder": f"{dump.kind} dump {dump.directory.name}",
                "profile": {"name": f"{dump.kind}-dump", "precision": precision},
                "config": cfg.to_official_dict(), "checkpoint": {}, "events": events, "dump": seen}
    if dump.world > 1 and shard_dims:
        manifest["shards"] = {"ranks": dump.world, "dims": shard_dims}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return seen


def _check_ranks(dump: Dump, by_pass: dict) -> None:
    for step, ranks in by_pass.items():
        if sorted(ranks) != list(range(dump.world)):
            missing = sorted(set(range(dump.world)) - set(ranks))
            raise DumpError(f"{dump.directory}: step {step}: ranks {sorted(ranks)} dumped, world size {dump.world}: "
                            f"rank {missing[0] if missing else max(ranks)} " + ("missing" if missing else "beyond it"))


def _meta(dump: Dump, ranks: dict[int, list[Entry]], names: NameMap, field: str, rank: int = 0):
    """The batch metadata ``field`` of one rank's pass: its first entry (outside the layers where it is also dumped
    per layer); None when the dump has none."""
    want = names.meta_name(field)
    hits = sorted((e for e in ranks[rank] if e.name == want), key=lambda e: (e.layer is not None, e.index))
    return hits[0] if hits else None


def _batch(dump: Dump, step: int, ranks, names: NameMap):
    ids_e, pos_e = _meta(dump, ranks, names, "input_ids"), _meta(dump, ranks, names, "positions")
    for field, e in (("input_ids", ids_e), ("positions", pos_e)):
        if e is None:
            raise DumpError(f"{dump.directory}: step {step}: no {names.meta_name(field)!r} dumped (the batch metadata "
                            "token alignment reads: SGLang's dumper writes it in its default 'core' mode)")
    ids, positions = _tensor(ids_e).flatten(), _tensor(pos_e).flatten()
    for r in range(1, dump.world):
        other = _meta(dump, ranks, names, "input_ids", r)
        if other is not None and not torch.equal(_tensor(other).flatten(), ids):
            raise DumpError(f"{other.path}: rank {r} fed other tokens than rank 0 at step {step} (data-parallel "
                            "attention dumps, one batch per rank, are not read yet)")
    lens_e, rids_e, slots_e = (_meta(dump, ranks, names, f) for f in ("seq_lens", "rids", "req_pool_indices"))
    rids = list(rids_e.value) if rids_e is not None else None
    slots = _tensor(slots_e).flatten() if slots_e is not None else None
    return ids, positions, _tensor(lens_e).flatten() if lens_e is not None else None, rids, slots


def _tensor(e: Entry) -> torch.Tensor:
    v = e.value
    if isinstance(v, list | tuple) and len(v) == 1:
        v = v[0]
    if not isinstance(v, torch.Tensor):
        raise DumpError(f"{e.path}: {e.name}: expected a tensor, found {type(v).__name__}")
    return v


def _sites(dump: Dump, step: int, ranks, names: NameMap, cfg: ModelConfig, rows: PassRows,
           unmapped: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, int | str]]:
    found: dict[str, dict[int, tuple[Entry, object]]] = defaultdict(dict)
    meta = set(names.meta.values())  # the batch metadata: read by the alignment, not a site
    for rank, entries in ranks.items():
        for e in sorted(entries, key=lambda e: e.index):
            if e.name in meta:
                continue
            try:
                hit = names.site_of(e.name, e.layer)
            except NameMapError as err:
                raise DumpError(f"{e.path}: {err}") from None
            if hit is None:
                unmapped.add(re.sub(r"\.\d+\.", ".{i}.", e.name))
                continue
            site, rule = hit
            if not site:
                continue
            have = found[site].get(rank)
            if have is not None and have[0].name != e.name:
                raise DumpError(f"{e.path}: the name map maps {have[0].name!r} and {e.name!r} to one site {site} "
                                f"(rules in {rule.source}): make one of them more specific (--site-map)")
            if have is None:
                found[site][rank] = (e, rule)
    out, dims = {}, {}
    n_rows = len(rows.ids)
    for site, per_rank in found.items():
        joined, parts, join = _join(dump, site, per_rank, cfg)
        first = per_rank[0][0]
        full = trailing_shape(site_template(site), cfg)
        if full is not None and tuple(joined.shape[1:]) != full:
            raise DumpError(f"{first.path}: {site} ({first.name}): rows of shape {list(joined.shape[1:])}"
                            f"{' joined over the ranks' if dump.world > 1 else ''}, the checkpoint's config gives "
                            f"{list(full)} (do the dump's model and --checkpoint agree?)")
        if joined.shape[0] != n_rows:
            raise DumpError(f"{first.path}: {site} ({first.name}): {joined.shape[0]} rows, the pass has {n_rows} "
                            "tokens (input_ids)")
        keep = n_rows - rows.padded
        out[site] = joined[:keep]
        if parts is not None:
            for r, t in enumerate(parts):
                out[f"{site}#{r}"] = t[:keep]
            del out[site]
            dims[site] = join.dim if join.kind == "concat" else "replicated"
    return out, dims


def _join(dump: Dump, site: str, per_rank: dict, cfg: ModelConfig):
    """(joined tensor, per-rank tensors to keep or None, the join) of one site's rank tensors."""
    tensors = []
    for r in range(dump.world):
        if r not in per_rank:
            e = per_rank[min(per_rank)][0]
            raise DumpError(f"{dump.directory}: {site} ({e.name}) at step {e.step}: rank {r} did not dump it")
        e, rule = per_rank[r]
        t = _tensor(e)
        tensors.append(t.reshape(-1, *t.shape[rule.lead:]) if rule.lead > 1 else t)
    e0, rule0 = per_rank[0]
    full = trailing_shape(site_template(site), cfg)
    try:
        join = parse_dims(e0.dims) if e0.dims else parse_dims(rule0.dims) if rule0.dims else _by_shape(tensors, full)
    except DimsError as err:
        raise DumpError(f"{e0.path}: {site} ({e0.name}): {err}") from None
    if dump.world == 1:
        return tensors[0], None, join
    if join.kind == "sum":
        return torch.stack([t.float() for t in tensors]).sum(0).to(tensors[0].dtype), None, join
    if join.kind == "concat":
        if join.dim == 0:
            raise DumpError(f"{e0.path}: {site} ({e0.name}): split over the ranks along its token dim; only other "
                            "dims are joined")
        return torch.cat(tensors, dim=join.dim), tensors, join
    same = all(t.shape == tensors[0].shape and torch.equal(t, tensors[0]) for t in tensors[1:])
    return tensors[0], None if same else tensors, join


def _by_shape(tensors: list[torch.Tensor], full: tuple | None) -> Join:
    """No dims given: the config's full trailing shape on every rank means replicated; a part of it along one dim,
    concatenated along that dim."""
    shapes = [tuple(t.shape[1:]) for t in tensors]
    if full is None or all(s == full for s in shapes) or len(tensors) == 1:
        return REPLICATED
    split = [d for d in range(len(full)) if any(len(s) != len(full) or s[d] != full[d] for s in shapes)]
    if len(split) == 1 and sum(s[split[0]] for s in shapes) == full[split[0]]:
        return Join("concat", split[0] + 1)
    raise DimsError(f"rank shapes {[list(s) for s in shapes]} are neither the config's {list(full)} nor its parts "
                    "along one dim (do the config and the dump's model agree? or annotate dims)")


def _hook_logits(dump: Dump, by_pass, names: NameMap) -> dict[int, dict[int, Entry]]:
    """Forward-hook dumps write a pass's logits into the next pass's file (the file is written when the model's
    forward returns, before the logits processor runs): {pass: {rank: entry}} moved back one pass."""
    if dump.kind != "hook":
        return {}
    want = names.meta_name("logits")
    late = {step - 1: {r: e for r, es in ranks.items() for e in es if e.name == want}
            for step, ranks in by_pass.items()}
    return {step: found for step, found in late.items() if found}


def _meta_logits(dump: Dump, step: int, ranks, names: NameMap, rows: PassRows, late: dict) -> torch.Tensor:
    """[rows or sequences, vocab]: the engine's logits of the pass (joined over ranks when split over the vocab)."""
    if dump.kind == "hook":
        per_rank = late.get(step, {})
    else:
        per_rank = {r: e for r in ranks if (e := _meta(dump, ranks, names, "logits", r)) is not None}
    if not per_rank:
        raise DumpError(f"{dump.directory}: step {step}: no logits dumped ({names.meta_name('logits')!r}); the "
                        "judgement needs each pass's logits")
    parts = [_tensor(per_rank[r]).reshape(-1, _tensor(per_rank[r]).shape[-1]) for r in sorted(per_rank)]
    e0 = per_rank[min(per_rank)]
    join = parse_dims(e0.dims) if e0.dims else REPLICATED
    logits = torch.cat(parts, dim=1) if join.kind == "concat" else parts[0]
    n_seq, n_rows = len(rows.rows), len(rows.ids) - rows.padded
    if logits.shape[0] not in (n_seq, n_rows, len(rows.ids)):
        raise DumpError(f"{e0.path}: logits: {logits.shape[0]} rows, expected one per request ({n_seq}) or per "
                        f"token ({n_rows})")
    return logits[:n_rows] if logits.shape[0] == len(rows.ids) and rows.padded else logits


def _write(path: Path, rows: PassRows, logits: torch.Tensor, sites: dict, cfg: ModelConfig) -> None:
    keep = len(rows.ids) - rows.padded
    seq = torch.cat([torch.full((n,), s) for s, _, n, _ in rows.rows])
    positions = torch.cat([torch.arange(start, start + n) for _, start, n, _ in rows.rows])
    if logits.shape[-1] != cfg.vocab_size:
        raise DumpError(f"{path.name}: logits: vocabulary {logits.shape[-1]}, the checkpoint's config has "
                        f"{cfg.vocab_size}")
    tensors = {"ids": rows.ids[:keep].long(), "positions": positions, "seq": seq, "logits": logits.float(),
               **{k: v.contiguous() for k, v in sites.items()}}
    save_file(tensors, str(path), metadata={"format": "pt"})
