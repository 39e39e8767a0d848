"""Indexer recall study: the lightning indexer's top-k at each precision against the exact fp32 selection.

One FP32 oracle prefill over a long context gives each CSA layer's indexer inputs (queries, head weights,
compressed keys) and attention inputs (queries, window KV, compressed KV) at sampled query positions. Each
precision then scores the SAME inputs through the production decoder's indexer under that precision's profile
(``fidelity.decoders.indexer_scores``: its rounding, Hadamard, packed key store and score dtype), so only the
indexer's number format differs; top-k is a run-time choice, so every k reuses the same scores.

Definitions, per query at position t (causality: compressed entry j is visible iff j < (t+1) // 4):
  k_eff        = min(k, visible entries); recall is over k_eff entries (a query with visible <= k selects every
                 visible entry, recall 1 trivially: ``selective`` is False for it and the summary excludes it).
  E, A         = the exact fp32 top-k_eff (``oracles.indexer.select_topk``) and a precision's top-k_eff
                 (``fidelity.decoders.indexer_topk``), both ties to the lower entry id.
  recall       = |A ∩ E| / k_eff.
  tie recall   = |{a in A : s(a) >= s_k}| / k_eff, s the exact fp32 score and s_k the k_eff-th largest: a pick
                 whose exact score equals the k-th score (in fp32) counts as a hit, since swapping tied entries
                 changes no score. Entries scoring above s_k are in E, so this is recall with ties forgiven.
  recall_bf16  = |A ∩ B| / k_eff with B the bf16 path's selection (the published FP4-vs-bf16 comparison);
                 ``recall_bf16_tie`` forgives ties in the bf16 path's own scores the same way.
  mass         = the layer's attention as the model runs it with the exact selection: per head, softmax with
                 the sink over the query's window rows (t-127 .. t) and the compressed entries of E; the mass of
                 entry j is the mean over heads of its probability.
  mass recall  = sum of the mass of A ∩ E / sum of the mass of E: the share of the exact selection's attention
                 mass the approximate selection keeps (1 - mass recall is the mass its misses carry).
  dense share  = the share E holds of the attention mass over every visible compressed entry (softmax with the
                 sink over the window and all visible entries): how much of the compressed attention top-k covers.
  miss margin  = (s(miss) - s_k) / max |s| over the query's visible entries (>= 0: a miss scores >= s_k).
  miss distance= t - (4j + 3) tokens from the query to the last token of the missed entry's block.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from fidelity.decoders import indexer_scores, indexer_topk
from fidelity.decoders.profiles import get_profile
from fidelity.model.sites import SITE, site_name
from oracles.indexer import index_scores, select_topk
from oracles.model import OracleModel
from probes.sets import gather_or

RATIO = 4  # CSA compress ratio: the indexer scores ratio-4 entries
# name -> the built-in profile whose indexer fields it takes (``fp32``: the exact scores themselves)
PRECISIONS: dict[str, str | None] = {
    "bf16": "bf16", "fp8": "fp8-indexer", "fp4": "reference", "fp4-no-hadamard": "no-hadamard",
    "fp4-packed": "fp4-indexer-packed", "fp32": None,
}
DEFAULT_PRECISIONS = ("bf16", "fp8", "fp4", "fp4-no-hadamard", "fp4-packed")
DEFAULT_TOPKS = (32, 128, 512, 1024)
NEAR_TIE = 1e-2  # a miss within this margin (units of the query's largest score, ~2.5 bf16 ulps) is a near-tie
QUERY_CHUNK = 64  # sampled queries scored at once
DISTANCE_BINS = (0, 128, 512, 2048, 8192, 32768, 1 << 30)


class RecallError(ValueError):
    """A study request that cannot run; the message names the field, expected and found."""


def max_context(cfg) -> int:
    """Longest context the checkpoint's RoPE covers: the YaRN-extended range (original_seq_len * rope_factor) where
    the config has one, else max_seq_len."""
    if cfg.original_seq_len:
        return int(cfg.original_seq_len * cfg.rope_factor)
    return int(cfg.max_seq_len)


def csa_layers(cfg) -> list[int]:
    """The layers with an indexer (compress ratio 4)."""
    return [i for i in range(cfg.n_layers) if cfg.ratio(i) == RATIO]


def check_request(cfg, contexts: Sequence[int], topks: Sequence[int], precisions: Sequence[str],
                  queries: int) -> None:
    """RecallError naming the first bad field: contexts in [8, max_context], k > 0, known precisions, queries > 0,
    and a checkpoint with CSA layers."""
    limit = max_context(cfg)
    for c in contexts:
        if not isinstance(c, int) or not 8 <= c <= limit:
            raise RecallError(f"context: expected an integer in [8, {limit}] (the checkpoint's RoPE range), "
                              f"found {c!r}")
    for k in topks:
        if not isinstance(k, int) or k <= 0:
            raise RecallError(f"topk: expected positive integers, found {k!r}")
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise RecallError(f"precision: expected some of {list(PRECISIONS)}, found {unknown}")
    if not precisions:
        raise RecallError("precision: expected at least one, found none")
    if not isinstance(queries, int) or queries <= 0:
        raise RecallError(f"queries: expected a positive integer, found {queries!r}")
    if not csa_layers(cfg):
        raise RecallError(f"compress_ratios: expected at least one CSA layer (ratio 4), found {cfg.compress_ratios}")


def context_ids(ckpt, length: int) -> tuple[torch.Tensor, str]:
    """Token ids [length] int64 and what they are. With a tokenizer beside the checkpoint (the trained default):
    the corpus's held-out standard-library files (``BOS text EOS`` each, sorted by path), then its training files,
    until ``length`` ids; otherwise deterministic random ids (``default_prompt``)."""
    from fidelity.model import text
    from fidelity.model.default import default_prompt

    tok_path = text.tokenizer_path(getattr(ckpt, "path", None))
    if tok_path is None:
        return default_prompt(ckpt.config.vocab_size, length), "random ids (default_prompt, seed 0)"
    from fidelity.train import corpus
    from fidelity.train.tokenizer import encode_document

    tok = text.load(tok_path)
    train, held = corpus.split(corpus.corpus_files())
    ids: list[int] = []
    used = 0
    for f in [*held, *train]:
        if len(ids) >= length:
            break
        ids += encode_document(tok, f.path.read_text(encoding="utf-8"))
        used += 1
    ids = [i if i < ckpt.config.vocab_size else 0 for i in ids]
    what = (f"{used} standard-library files from {corpus.stdlib_root()}, held-out files first "
            f"({len(held)} held out), BOS text EOS each")
    return torch.tensor(ids[:length], dtype=torch.long), what


def query_positions(length: int, n: int) -> torch.Tensor:
    """[<= n] int64 sorted positions spread evenly over the context, the i-th moved back by i % 4 tokens so that
    every phase t % 4 in the compression block is sampled alike (the last one at length - 4)."""
    n = min(n, length)
    return torch.tensor(sorted({max(0, (i + 1) * length // n - 1 - i % RATIO) for i in range(n)}), dtype=torch.long)


@dataclass
class LayerInputs:
    """One CSA layer's exact (fp32) inputs at the sampled queries: n queries, e compressed entries, T tokens."""

    layer: int
    positions: torch.Tensor  # [n] int64 query positions
    index_q: torch.Tensor  # [n, index_heads, index_dim] indexer queries after RoPE (no Hadamard)
    index_w: torch.Tensor  # [n, index_heads] head weights (scale included)
    keys: torch.Tensor  # [e, index_dim] indexer-compressor entries after norm and RoPE
    attn_q: torch.Tensor  # [n, heads, head_dim] attention queries after RoPE
    kv: torch.Tensor  # [T, head_dim] window KV rows of every token
    entries: torch.Tensor  # [e, head_dim] compressed KV entries
    sink: torch.Tensor  # [heads] attention sink logits
    window: int = 128  # window rows per query, self included


_QUERY_SITES = ("indexer.q", "indexer.weights", "attn.q")
_ALL_SITES = ("indexer.keys", "attn.kv", "attn.compressed_kv")


class _SampledRecorder:
    """A recorder (``fidelity.model.sites.record``'s protocol) that keeps the per-query sites of the CSA layers at
    the sampled positions only and their per-token / per-entry sites whole; ``offset`` is the first position of the
    chunk being fed."""

    def __init__(self, layers: Sequence[int], positions: torch.Tensor):
        self.step, self.offset = 0, 0
        self.positions = positions.cpu()
        self.query = {site_name("L{i}." + s, i) for i in layers for s in _QUERY_SITES}
        self.whole = {site_name("L{i}." + s, i) for i in layers for s in _ALL_SITES}
        self.parts: dict[str, list[torch.Tensor]] = {}

    def wants(self, site: str) -> bool:
        return site in self.query or site in self.whole

    def __call__(self, site: str, tensor: torch.Tensor) -> None:
        if site in self.query:
            rows = self.positions[(self.positions >= self.offset) & (self.positions < self.offset + len(tensor))]
            tensor = tensor[(rows - self.offset).to(tensor.device)]
        self.parts.setdefault(site, []).append(tensor.detach().clone())

    def get(self, template: str, layer: int) -> torch.Tensor:
        return torch.cat(self.parts[site_name(template, layer)])


@torch.no_grad()
def collect_inputs(oracle: OracleModel, ids: torch.Tensor, positions: torch.Tensor, chunk: int = 4096,
                   progress: Callable[[str], None] | None = None) -> dict[int, LayerInputs]:
    """One chunked oracle prefill of ``ids`` [T] (chunks of ``chunk`` tokens: the oracle's incremental forward gives
    the same values as one call) -> each CSA layer's exact inputs at ``positions`` [n] (sorted, < T)."""
    cfg, layers = oracle.cfg, csa_layers(oracle.cfg)
    rec = _SampledRecorder(layers, positions)
    session = oracle.session(rec)
    last_is_csa = cfg.ratio(cfg.n_layers - 1) == RATIO
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        rec.offset = s
        last = None if last_is_csa else torch.tensor([len(part) - 1])  # the last layer only for one row
        session.forward(part, last)
        if progress is not None:
            progress(f"oracle prefill {s + len(part)}/{len(ids)} tokens")
    dev = oracle.device
    return {i: LayerInputs(i, positions.to(dev), rec.get(SITE.indexer_q, i), rec.get(SITE.indexer_weights, i),
                           rec.get(SITE.indexer_keys, i), rec.get(SITE.attn_q, i), rec.get(SITE.attn_kv, i),
                           rec.get(SITE.attn_compressed_kv, i), oracle.w(f"layers.{i}.attn.attn_sink"),
                           cfg.window_size)
            for i in layers}


def _limit(positions: torch.Tensor) -> torch.Tensor:
    """[n] -> [n, 1] the number of visible compressed entries, (t+1) // 4."""
    return ((positions + 1) // RATIO)[:, None]


def exact_scores(inp: LayerInputs, rows: slice = slice(None)) -> torch.Tensor:
    """The oracle's fp32 index scores [n, e] of the queries ``rows`` (-inf where j >= (t+1) // 4)."""
    return index_scores(inp.index_q[rows], inp.keys, inp.index_w[rows], inp.positions[rows], RATIO)


def precision_scores(inp: LayerInputs, precision: str, rows: slice = slice(None)) -> torch.Tensor:
    """The index scores [n, e] of ``precision`` on the same inputs, as the production decoder computes them under
    the precision's profile (``fidelity.decoders.indexer_scores``: bf16 inputs, Hadamard and the profile's format,
    packed keys where it packs them, scores in its dtype). -inf where j >= (t+1) // 4."""
    name = PRECISIONS.get(precision, "?")
    if name == "?":
        raise RecallError(f"precision: expected one of {list(PRECISIONS)}, found {precision!r}")
    if name is None:
        return exact_scores(inp, rows)
    scores = indexer_scores(get_profile(name), inp.index_q[rows], inp.keys, inp.index_w[rows])
    j = torch.arange(scores.shape[1], device=scores.device)[None]
    return scores.masked_fill(j >= _limit(inp.positions[rows]), float("-inf"))


def select(scores: torch.Tensor, positions: torch.Tensor, k: int, exact: bool) -> torch.Tensor:
    """Top-k picks [n, k] int64 of ``scores`` [n, e], -1 past each query's visible entries: the oracle's rule for
    the exact scores, the production decoder's (``fidelity.decoders.indexer_topk``) for a precision's (the same tie
    order)."""
    if exact:
        return select_topk(scores, positions, RATIO, k)
    kk = min(k, scores.shape[1])
    picks = indexer_topk(scores, kk)
    picks = torch.where(picks >= _limit(positions), -1, picks)
    return torch.nn.functional.pad(picks, (0, k - kk), value=-1)


def _member(picks: torch.Tensor, e: int) -> torch.Tensor:
    """picks [n, k] (-1 = none) -> bool [n, e] membership."""
    out = torch.zeros(picks.shape[0], e + 1, dtype=torch.bool, device=picks.device)
    out.scatter_(1, torch.where(picks >= 0, picks, e), True)
    return out[:, :e]


def set_recall(test: torch.Tensor, ref: torch.Tensor, e: int) -> torch.Tensor:
    """|test ∩ ref| / |ref| per query [n] float64 (picks [n, k], -1 ignored; 1 where ref is empty)."""
    count = (ref >= 0).sum(1)
    hits = (_member(ref, e) & _member(test, e)).sum(1)
    return torch.where(count > 0, hits.double() / count.clamp(min=1), 1.0)


def tie_recall(test: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor) -> torch.Tensor:
    """Tie-aware recall [n] float64: the share of the test picks whose reference score is >= the reference's k-th
    score (its lowest-scoring pick), over |ref| picks. A test pick that ties the k-th score counts as a hit."""
    count = (ref >= 0).sum(1)
    kth = gather_or(ref_scores.double(), ref, math.inf).amin(1, keepdim=True)
    s = gather_or(ref_scores.double(), test, -math.inf)
    hits = ((s >= kth) & (test >= 0)).sum(1)
    return torch.where(count > 0, hits.double() / count.clamp(min=1), 1.0)


def mass_recall(test: torch.Tensor, ref: torch.Tensor, mass: torch.Tensor, e: int) -> torch.Tensor:
    """[n] float64: the share of the reference picks' attention mass (``mass`` [n, k], aligned with ``ref`` [n, k])
    held by those of them the test picks [n, k'] contain (1 where the reference holds no mass)."""
    hit = _member(test, e).gather(1, ref.clamp(min=0)) & (ref >= 0)
    mass = torch.where(ref >= 0, mass.double(), 0.0)
    total = mass.sum(1)
    return torch.where(total > 0, (mass * hit).sum(1) / total.clamp(min=1e-300), 1.0)


def attention_logits(inp: LayerInputs, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(window logits [n, H, W] (-inf before position 0), entry logits [n, H, e] (-inf where not visible)) of the
    layer's scaled attention q . k / sqrt(head_dim), fp32."""
    q, pos = inp.attn_q[rows], inp.positions[rows]
    scale = q.shape[-1] ** -0.5
    win_pos = pos[:, None] - inp.window + 1 + torch.arange(inp.window, device=pos.device)[None]
    rows_kv = inp.kv[win_pos.clamp(min=0)]  # [n, W, hd]
    win = torch.einsum("nhd,nwd->nhw", q, rows_kv) * scale
    win = win.masked_fill((win_pos < 0)[:, None, :], float("-inf"))
    ent = torch.einsum("nhd,ed->nhe", q, inp.entries) * scale
    j = torch.arange(inp.entries.shape[0], device=q.device)[None]
    return win, ent.masked_fill((j >= _limit(pos))[:, None, :], float("-inf"))


def selection_mass(win: torch.Tensor, ent: torch.Tensor, sink: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """Attention mass [n, k] of each pick (0 for -1) in the attention over the window and the picks with the sink
    (per head softmax, then the mean over heads)."""
    logits = ent.gather(2, picks.clamp(min=0)[:, None, :].expand(-1, ent.shape[1], -1))
    logits = logits.masked_fill((picks < 0)[:, None, :], float("-inf"))
    s = sink.to(win.dtype)[None, :, None].expand(win.shape[0], -1, 1)
    top = torch.maximum(torch.maximum(win.amax(2, keepdim=True), logits.amax(2, keepdim=True)), s)
    z = (win - top).exp().sum(2, keepdim=True) + (logits - top).exp().sum(2, keepdim=True) + (s - top).exp()
    return ((logits - top).exp() / z).mean(1)


def dense_share(win: torch.Tensor, ent: torch.Tensor, sink: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """[n]: the share of the attention mass over every visible compressed entry (window, all visible entries and
    sink in the softmax) that ``picks`` hold, in float64 (a selection of every entry holds 1)."""
    win, ent = win.double(), ent.double()
    s = sink.to(win.dtype)[None, :, None].expand(win.shape[0], -1, 1)
    top = torch.maximum(torch.maximum(win.amax(2, keepdim=True), ent.amax(2, keepdim=True)), s)
    p = (ent - top).exp()  # [n, H, e] unnormalised; the window and sink only set each head's normaliser
    p = p / ((win - top).exp().sum(2, keepdim=True) + p.sum(2, keepdim=True) + (s - top).exp())
    p = p.mean(1)  # [n, e]
    mass = gather_or(p, picks, 0.0).sum(1)
    return (mass / p.sum(1).clamp(min=1e-300)).clamp(max=1.0)


@dataclass
class StudyResult:
    """Per-query rows, the missed entries, and what was run."""

    queries: pd.DataFrame  # one row per (context, layer, precision, k, query)
    misses: pd.DataFrame  # one row per missed exact pick
    meta: dict


def study_context(oracle: OracleModel, ids: torch.Tensor, topks: Sequence[int], precisions: Sequence[str],
                  queries: int, chunk: int = 4096, progress: Callable[[str], None] | None = None) -> StudyResult:
    """The study on one context ``ids`` [T]: one oracle prefill, then every layer, precision and k on the same
    inputs at ``queries`` positions spread over the context."""
    t0 = time.perf_counter()
    positions = query_positions(len(ids), queries)
    inputs = collect_inputs(oracle, ids, positions, chunk, progress)
    prefill_s = time.perf_counter() - t0
    rows, misses = [], []
    for layer, inp in inputs.items():
        for s in range(0, len(positions), QUERY_CHUNK):
            sl = slice(s, s + QUERY_CHUNK)
            r, m = _score_chunk(inp, sl, topks, precisions)
            rows += r
            misses += m
        if progress is not None:
            progress(f"layer {layer}: {len(precisions)} precisions x {len(topks)} k scored")
    meta = {"context": len(ids), "queries": len(positions), "layers": list(inputs), "prefill_s": round(prefill_s, 2),
            "study_s": round(time.perf_counter() - t0 - prefill_s, 2)}
    q = pd.concat(rows, ignore_index=True)
    q.insert(0, "context", len(ids))
    m = pd.concat(misses, ignore_index=True)
    m.insert(0, "context", len(ids))
    return StudyResult(q, m, meta)


def _score_chunk(inp: LayerInputs, sl: slice, topks: Sequence[int], precisions: Sequence[str]):
    """Rows and misses of the queries ``sl`` of one layer."""
    pos = inp.positions[sl]
    e = inp.keys.shape[0]
    exact = exact_scores(inp, sl)
    visible = _limit(pos)[:, 0].clamp(max=e)
    finite = torch.where(exact.isfinite(), exact.abs(), 0)
    scale = finite.amax(1).double().clamp(min=1e-30)
    win, ent = attention_logits(inp, sl)
    scores = {p: precision_scores(inp, p, sl) for p in dict.fromkeys(("bf16", *precisions))}
    rows, misses = [], []
    for k in topks:
        ref = select(exact, pos, k, exact=True)
        kth = gather_or(exact.double(), ref, math.inf).amin(1)
        mass = selection_mass(win, ent, inp.sink, ref).double()  # [n, k]
        total = mass.sum(1).clamp(min=1e-300)
        dense = dense_share(win, ent, inp.sink, ref)
        bf16 = select(scores["bf16"], pos, k, exact=False)
        for p in precisions:
            test = bf16 if p == "bf16" else select(scores[p], pos, k, exact=p == "fp32")
            miss = (ref >= 0) & ~(_member(test, e).gather(1, ref.clamp(min=0)))
            cols = {"recall": set_recall(test, ref, e), "recall_tie": tie_recall(test, ref, exact),
                    "recall_bf16": set_recall(test, bf16, e),
                    "recall_bf16_tie": tie_recall(test, bf16, scores["bf16"].float()),
                    "mass_recall": mass_recall(test, ref, mass, e), "dense_share": dense}
            n = len(pos)
            rows.append(pd.DataFrame({"layer": inp.layer, "precision": p, "k": k, "position": pos.cpu().numpy(),
                                      "visible": visible.cpu().numpy(), "k_eff": visible.clamp(max=k).cpu().numpy(),
                                      "selective": (visible > k).cpu().numpy(),
                                      **{c: v.cpu().numpy() for c, v in cols.items()}}, index=range(n)))
            qi, ci = miss.nonzero(as_tuple=True)
            j, t = ref[qi, ci], pos[qi]
            misses.append(pd.DataFrame({
                "layer": inp.layer, "precision": p, "k": k, "position": t.cpu().numpy(), "entry": j.cpu().numpy(),
                "margin": ((exact[qi, j].double() - kth[qi]) / scale[qi]).cpu().numpy(),
                "distance": (t - (RATIO * j + RATIO - 1)).cpu().numpy(), "phase": (t % RATIO).cpu().numpy(),
                "mass_share": (mass[qi, ci] / total[qi]).cpu().numpy(), "exact_rank": ci.cpu().numpy()}))
    return rows, misses


def run_study(ckpt, contexts: Sequence[int], topks: Sequence[int] = DEFAULT_TOPKS,
              precisions: Sequence[str] = DEFAULT_PRECISIONS, queries: int = 256, chunk: int = 4096,
              device: str = "cpu", progress: Callable[[str], None] | None = None) -> StudyResult:
    """The study over several contexts of the checkpoint ``ckpt`` (a ``Checkpoint``); see the module docstring."""
    topks, precisions = [int(k) if isinstance(k, int | np.integer) else k for k in topks], list(precisions)
    check_request(ckpt.config, list(contexts), topks, precisions, queries)
    oracle = OracleModel(ckpt, device=device)
    parts, metas = [], []
    for c in contexts:
        ids, what = context_ids(ckpt, c)
        res = study_context(oracle, ids, topks, precisions, queries, chunk, progress)
        res.meta["text"] = what
        parts.append(res)
        metas.append(res.meta)
    return StudyResult(pd.concat([p.queries for p in parts], ignore_index=True),
                       pd.concat([p.misses for p in parts], ignore_index=True),
                       {"contexts": metas, "topks": topks, "precisions": precisions, "device": device,
                        "index_topk": ckpt.config.index_topk, "near_tie": NEAR_TIE, "ratio": RATIO})


def summarize(queries: pd.DataFrame, by_layer: bool = True) -> pd.DataFrame:
    """One row per (context, [layer,] precision, k) over its selective queries (visible > k): means and the worst
    query of each recall, with ``selective`` and ``saturated`` query counts."""
    keys = ["context", *(["layer"] if by_layer else []), "precision", "k"]
    out = []
    for key, g in queries.groupby(keys, sort=True):
        sel = g[g["selective"]]
        row = dict(zip(keys, key, strict=True))
        row.update(selective=len(sel), saturated=int((~g["selective"]).sum()))
        for c in ("recall", "recall_tie", "recall_bf16", "mass_recall"):
            row[c] = float(sel[c].mean()) if len(sel) else math.nan
            row[f"{c}_min"] = float(sel[c].min()) if len(sel) else math.nan
        row["dense_share"] = float(sel["dense_share"].mean()) if len(sel) else math.nan
        out.append(row)
    return pd.DataFrame(out)


def miss_summary(misses: pd.DataFrame, queries: pd.DataFrame) -> pd.DataFrame:
    """Per (context, precision, k), over the selective queries: misses, the share of them within NEAR_TIE of the
    k-th score, the exact-selection mass the misses and the near-tie misses carry (mean per query), the share in
    the query's window (distance < 128), and the miss rate per query phase t % 4."""
    sel = queries[queries["selective"]]
    m = misses.merge(sel[["context", "layer", "precision", "k", "position"]],
                     on=["context", "layer", "precision", "k", "position"])
    out = []
    for (c, p, k), g in sel.groupby(["context", "precision", "k"], sort=True):
        mg = m[(m["context"] == c) & (m["precision"] == p) & (m["k"] == k)]
        n_q = len(g)
        near = mg["margin"] <= NEAR_TIE
        row = {"context": c, "precision": p, "k": k, "queries": n_q, "misses": len(mg),
               "misses_per_query": len(mg) / max(1, n_q),
               "near_tie_share": float(near.mean()) if len(mg) else math.nan,
               "miss_mass": float(mg["mass_share"].sum() / max(1, n_q)),
               "near_tie_mass": float(mg.loc[near, "mass_share"].sum() / max(1, n_q)),
               "median_margin": float(mg["margin"].median()) if len(mg) else math.nan,
               "in_window_share": float((mg["distance"] < 128).mean()) if len(mg) else math.nan}
        for ph in range(RATIO):
            slots = (g["position"] % RATIO == ph).sum() * k
            row[f"miss_rate_phase{ph}"] = float((mg["phase"] == ph).sum() / max(1, slots))
        out.append(row)
    return pd.DataFrame(out)


def summaries(result: StudyResult) -> dict[str, pd.DataFrame]:
    """The study's tables: ``per_layer`` and ``pooled`` (``summarize`` by layer and over the layers) and ``misses``
    (``miss_summary``)."""
    return {"per_layer": summarize(result.queries, by_layer=True),
            "pooled": summarize(result.queries, by_layer=False),
            "misses": miss_summary(result.misses, result.queries)}
