"""Turn one step's pair of site recordings (oracle = reference, production = test) into pending probe rows.

Which probe a site gets, and when, is the site table's (``fidelity.model.sites.SITE_TABLE``): Sinkhorn matrices
-> ``sinkhorn`` (with orientation); indexer picks -> tie-aware ``indexer_recall``; visible sets ->
``visible_range``; routed experts -> routing agreement; logits -> also ``token_agreement``; residual streams ->
also ``residual_norms`` of both models (every row both recorded); every other float site -> ``similarity``. A
decoder's stored KV cache rows (``L{i}.attn.kv_cache``) have no oracle record: they are judged against the decoder's
own ``attn.kv`` and its profile's FP8 scale rule (``kv_storage``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache, partial

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import (
    LAYER_SITE_ORDER,
    SITE,
    Recorder,
    same_layer,
    site_name,
    site_of,
    site_template,
    trailing_shape,
)
from probes import (
    PairRows,
    expected_visible,
    gate_range,
    indexer_recall,
    kv_storage,
    residual_norms,
    routing_agreement,
    similarity_batch,
    similarity_per_position,
    sinkhorn_batch,
    to_rows,
    token_agreement,
    visible_range,
)

NEAR_TIE_MARGIN = 1e-2  # relative gap to the k-th oracle score under which a top-k miss is a near-tie
# sites that no oracle mode reads from the decoder's records and no other site's comparison reads: with sampled
# query rows (layer and op modes) they are compared at those rows alone, so the decoder's are recorded at those rows
# (``Recorder.rows_only``); wide per-query tensors, the index scores growing with the context
SAMPLED_ROWS_ONLY = frozenset({SITE.attn_q, SITE.attn_core, SITE.indexer_scores})
# the same for the logits where no free-mode comparison (every row) runs; the decoder may then multiply the head on
# those rows and the last alone (a 16K-token chunk's logits at V4's vocabulary: 8.5 GB of fp32)
SAMPLED_LOGITS = frozenset({SITE.logits.name})
# a selection's site -> the site of the scores it selects from (templates)
SELECTION_SCORES = {SITE.indexer_topk: SITE.indexer_scores,
                    SITE.moe_experts: SITE.moe_scores}


@lru_cache(maxsize=1 << 14)
def _layer(site: str) -> int:
    return int(site[1 : site.index(".")]) if site.startswith("L") and "." in site else -1


def _align(ref: torch.Tensor, test: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Production rows matching the oracle's sampled query rows (sites computed per query only)."""
    if rows is not None and ref.shape[0] == len(rows) and test.shape[0] != len(rows):
        return test[rows]
    return test


def _visible_reference(site: str, ref: torch.Tensor, ctx: dict) -> torch.Tensor:
    """What the test model may see. SWA/HCA: the oracle's set. CSA: the window plus the test model's OWN
    top-k picks that pass the causal rule, so selection differences (judged by indexer recall) are not
    counted twice and a window or causality bug still is."""
    if ctx["ratios"][_layer(site)] != 4:
        return ref
    picks = ctx["test"].get(same_layer(SITE.indexer_topk, site))
    picks = picks[ctx["rows"]] if ctx["rows"] is not None and len(picks) != len(ctx["positions"]) else picks
    limit = ((ctx["positions"] + 1) // 4)[:, None]
    picks = torch.where((picks >= 0) & (picks < limit), picks, -1)
    return expected_visible(ctx["positions"], ctx["window"], 4, picks, 0)


def _same_routing(site: str, r: torch.Tensor, t: torch.Tensor, ref: Recorder, test: Recorder,
                  rows: torch.Tensor | None) -> torch.Tensor:
    """bool [n]: tokens both models routed to the same experts at this layer. MoE outputs (and the streams
    after them) are compared on those: a near-tied routing flip is a discrete event counted by
    ``moe.experts``, not a numeric error of the experts."""
    experts = same_layer(SITE.moe_experts, site)
    if experts not in ref.records or experts not in test.records:
        return torch.ones(len(r), dtype=torch.bool, device=r.device)
    re_ = ref.get(experts).to(r.device)  # the oracle's recorder may sit on another device than the pair's rows
    te = _align(re_, test.get(experts), rows).to(r.device)
    n, width = min(len(re_), len(te)), max(re_.shape[-1], te.shape[-1])
    same = (_pad_ids(re_[:n], width).sort(-1).values == _pad_ids(te[:n], width).sort(-1).values).all(-1)
    return torch.cat((same, same.new_zeros(len(r) - n))) if n < len(r) else same[: len(r)]


def _routing_weights(site: str, ref: torch.Tensor, test: torch.Tensor, ctx: dict) -> dict:
    """Routing weights compared per expert id on the tokens whose expert sets agree (flips are counted by
    ``moe.experts``): weight_max_err = max |w_test - w_ref|."""
    experts = same_layer(SITE.moe_experts, site)
    re_ = ctx["ref"].get(experts).to(ref.device)  # the oracle's recorder may sit on another device
    te = _align(re_, ctx["test"].get(experts), ctx["rows"]).to(ref.device)
    n = min(len(re_), len(te))
    re_, te = re_[:n], te[:n]
    if ctx.get("keep") is not None:
        re_, te = re_[ctx["keep"]], te[ctx["keep"]]
    if re_.shape != ref.shape or te.shape != test.shape:
        return {}
    ro, to = re_.sort(-1), te.sort(-1)
    same = (ro.values == to.values).all(-1, keepdim=True)
    rw, tw = ref.gather(-1, ro.indices).double(), test.gather(-1, to.indices).double()
    err = torch.where(same, (rw - tw).abs(), 0.0)
    return {"weight_max_err": err.amax() if err.numel() else torch.zeros((), dtype=torch.float64)}


def _routing_scores(site: str, ref: torch.Tensor, ctx: dict) -> torch.Tensor | None:
    """The oracle's selection scores of these tokens for ``routing_agreement`` (None on hash layers)."""
    scores_site = same_layer(SITE.moe_scores, site)
    if scores_site not in ctx["ref"].records:
        return None
    scores = ctx["ref"].get(scores_site).to(ref.device)
    return scores[ctx["keep"]] if ctx.get("keep") is not None else scores


def _pad_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(ids.long(), (0, width - ids.shape[-1]), value=-1)


def compare_site(site: str, ref: torch.Tensor, test: torch.Tensor, ctx: dict, per_position: bool,
                 batches: PairBatches) -> list[dict]:
    """Pending rows for one site. ``ctx``: positions, window, ref recorder (for index scores); the site's
    ``similarity`` or ``sinkhorn`` goes to ``batches`` (computed with the same template's other layers)."""
    layer, out, entry = _layer(site), [], site_of(site)
    if entry.probe == "sinkhorn":
        batches.add("sinkhorn", site, (ref, test))
    elif entry.probe == "indexer_recall":
        scores = ctx["ref"].get(same_layer(SITE.indexer_scores, site))
        batches.add("indexer_recall", site, (test, ref, scores.to(ref.device)))
    elif entry.probe == "visible_range":
        batches.add("visible_range", site, (test, _visible_reference(site, ref, ctx), ctx["positions"]),
                    static=(ctx["window"],))
    elif entry.probe == "routing_weights":
        out += to_rows(site, layer, _routing_weights(site, ref, test, ctx))
    elif entry.probe == "routing":
        scores = _routing_scores(site, ref, ctx)
        batches.add("routing", site, (test, ref) if scores is None else (test, ref, scores))
    elif ref.is_floating_point():
        batches.add("similarity", site, (ref, test))
        if per_position and entry.per_position and ref.shape[0] > 1:
            pp = similarity_per_position(ref, test)
            out += to_rows(site, layer, {"cos": pp["cos"]}, positions=ctx["positions"])
        if entry.probe == "logits":
            out += to_rows("tokens", -1, token_agreement(test[-1], ref[-1]))
    return out


def _rows_matched(site: str, r: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A different number of rows (tokens, entries) or of trailing elements (experts) at a site is counted, not
    raised: rows_missing / rows_extra (and shape_mismatch for other trailing dims); the common leading rows are
    compared."""
    counts = {}
    if r.shape[0] != t.shape[0]:
        counts = {"rows_missing": torch.tensor(max(0, r.shape[0] - t.shape[0])),
                  "rows_extra": torch.tensor(max(0, t.shape[0] - r.shape[0]))}
        n = min(r.shape[0], t.shape[0])
        r, t = r[:n], t[:n]
    if r.shape[1:] != t.shape[1:] and not site.endswith(RAGGED) and site_of(site).probe != "routing":
        counts["shape_mismatch"] = torch.tensor(1)
    return r, t, counts


RAGGED = (".topk", ".visible", ".scores")  # widths that vary with the call (compared through their probes)


def _unambiguous(picks: torch.Tensor, scores: torch.Tensor, margin: float) -> torch.Tensor:
    """picks [n, k] (-1 = none), scores [n, e] (-inf = not visible) -> bool [n]: the selection cannot flip under
    a score error below ``margin`` times the row's largest |score|: no more candidates than picks, or the k-th
    and the next score apart by more than that."""
    s = scores.double()
    k = (picks >= 0).sum(-1)
    ordered = s.sort(-1, descending=True).values
    kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
    nxt = ordered.gather(1, k.clamp(max=s.shape[1] - 1)[:, None]).squeeze(1)
    unit = torch.where(s.isfinite(), s.abs(), 0.0).amax(-1)
    return (s.isfinite().sum(-1) <= k) | (k == 0) | ((kth - nxt) > margin * unit)


def _decided_rows(layer: int, selection: str, ref: Recorder, test: Recorder, margin: float | None, n: int,
                  device: torch.device) -> torch.Tensor | None:
    """bool [n] rows of ``layer`` whose oracle selection (the template ``selection``: ``L{i}.indexer.topk`` or
    ``L{i}.moe.experts``, over its ``SELECTION_SCORES``) is unambiguous at ``margin`` (``_unambiguous``); None where
    the decoder reports that selection itself (it is then compared directly, or attended as the decoder's), where
    the oracle recorded no scores (a hash layer: its lookup is exact) or no margin applies."""
    picks, scores = site_name(selection, layer), site_name(SELECTION_SCORES[selection], layer)
    if margin is None or picks in test.records or picks not in ref.records or scores not in ref.records:
        return None
    agree = _unambiguous(ref.get(picks).to(device), ref.get(scores).to(device), margin)
    return agree if len(agree) == n else None


BATCH_ELEMENTS = 1 << 24  # elements of one template's pairs compared in one batch (bounds the float64 copies)
# probes written for a batch of same-shaped pairs: their tensors stacked ([B, ...] each) -> [B] metrics
BATCHED_PROBES = {"similarity": similarity_batch, "sinkhorn": lambda ref, test: sinkhorn_batch(test, ref)}
# probes of one pair (its tensors, then the batch's static arguments -> 0-d metrics), batched under ``torch.vmap``:
# the same ops, each over the batch, give the same metrics as pair by pair (tests/test_probe_batches.py)
VMAP_MIN_PAIRS = 2  # a pair probe's batch of fewer pairs is probed pair by pair
PAIR_PROBES = {"indexer_recall": partial(indexer_recall, margin=NEAR_TIE_MARGIN), "routing": routing_agreement,
               "visible_range": visible_range, "residual": residual_norms,
               "residual ref": partial(residual_norms, prefix="ref_")}


class PairBatches:
    """The pairs of the batched probes (``BATCHED_PROBES``, ``PAIR_PROBES``) of one or more calls, compared a batch
    at a time: a site template's pairs of one probe, static arguments, shapes, dtypes and devices go through the
    probe together, in the ops of one pair (each op a few microseconds from Python on the CPU, a launch on a GPU: a
    probe per pair made a step's judgement host-bound). A pair probe's pairs without rows are probed one by one."""

    def __init__(self) -> None:
        self.groups: dict[tuple, list[tuple[str, tuple[torch.Tensor, ...], dict | None]]] = {}

    def add(self, probe: str, site: str, tensors: tuple[torch.Tensor, ...], tags: dict | None = None,
            static: tuple = ()) -> None:
        """``tensors``: the probe's tensor arguments, ``static`` the others (shared by the batch); ``tags``: fields
        the pair's rows carry (``extra``: a run's step, phase and mode when the pairs of several calls share the
        batches)."""
        key = (probe, static, site_template(site), *((t.shape, t.dtype, t.device) for t in tensors))
        self.groups.setdefault(key, []).append((site, tensors, tags))

    def rows(self) -> list[dict | PairRows]:
        """Pending rows of every pair added, in the order added within a template."""
        out: list[dict | PairRows] = []
        for (probe, static, *_), pairs in self.groups.items():
            per_batch = max(1, BATCH_ELEMENTS // max(1, pairs[0][1][0].numel()))
            for s in range(0, len(pairs), per_batch):
                out += _batch_rows(probe, static, pairs[s : s + per_batch])
        return out


def _batch_rows(probe: str, static: tuple, batch: list[tuple[str, tuple[torch.Tensor, ...], dict | None]]
                ) -> list[dict | PairRows]:
    """Pending rows of one batch of same-shaped pairs of ``probe``: a ``PairRows`` per metric of a batch probed
    together, rows per pair otherwise."""
    if probe in BATCHED_PROBES or (len(batch) >= VMAP_MIN_PAIRS and batch[0][1][0].shape[0] > 0):
        fn = BATCHED_PROBES.get(probe) or torch.vmap(lambda *ts: PAIR_PROBES[probe](*ts, *static))
        with warnings.catch_warnings():  # vmap hands searchsorted a strided view of the batch: a copy, not an error
            warnings.filterwarnings("ignore", message=r"torch\.searchsorted\(\): input value tensor is non-contig")
            metrics = fn(*(torch.stack(ts) for ts in zip(*(p[1] for p in batch), strict=True)))
        if all(v.ndim == 1 for v in metrics.values()):  # a value per pair: the batch's rows stay columns
            sites, extras = [p[0] for p in batch], [p[2] for p in batch]
            layers = [_layer(s) for s in sites]
            return [PairRows(sites, layers, k, v, extras) for k, v in metrics.items()]
        unbound = {k: v.unbind(0) for k, v in metrics.items()}  # B views in one call
        per_pair = [{k: v[b] for k, v in unbound.items()} for b in range(len(batch))]
    else:  # nothing to share, or no rows to map over
        per_pair = [PAIR_PROBES[probe](*tensors, *static) for _, tensors, _ in batch]
    out: list[dict | PairRows] = []
    for (site, _, tags), metrics in zip(batch, per_pair, strict=True):
        rows = to_rows(site, _layer(site), metrics)
        out += rows if tags is None else tag_in_place(rows, tags)
    return out


def tagged(rows: list[dict], tags: dict) -> list[dict]:
    """Copies of pending rows carrying ``tags`` as ``extra`` fields (after any they carry)."""
    return [{**r, "extra": {**r.get("extra", {}), **tags}} for r in rows]


def tag_in_place(rows: list[dict], tags: dict) -> list[dict]:
    """``tagged`` for rows no one else holds: each row gains the fields (rows without their own share ``tags``)."""
    for r in rows:
        r["extra"] = {**r["extra"], **tags} if "extra" in r else tags
    return rows


@dataclass(frozen=True)
class Margins:
    """Score margins under which a selection the decoder does not report counts as its own (``_unambiguous``):
    ``selection`` for a CSA layer's top-k (layer mode), ``routing`` for the experts."""

    selection: float | None = None
    routing: float | None = None


def compare_recordings(ref: Recorder, test: Recorder, positions: torch.Tensor, cfg: ModelConfig,
                       rows: torch.Tensor | None = None, per_position: bool = False,
                       margins: Margins = Margins(), kv_scale_floor: str = "amax",
                       batches: PairBatches | None = None, tags: dict | None = None,
                       own: list[dict] | None = None) -> list[dict]:
    """Every site recorded by both: pending probe rows (no host transfer yet). Where the decoder does not report
    a layer's top-k (or its experts), the sites after that selection are compared on the rows whose oracle
    selection is unambiguous at ``margins`` (``_decided_rows``); the others are counted as ``ambiguous_queries``
    at ``indexer.topk`` (``ambiguous_tokens`` at ``moe.experts``). The decoder's stored KV rows are judged on their
    own (``stored_kv_rows``, with the profile's ``kv_scale_floor``). ``batches``: where the ``BATCHED_PROBES`` pairs
    go, to be computed by the caller with other calls' (``PairBatches.rows``), their rows carrying ``tags``, as the
    rows returned do; None: computed here. ``own``: the decoder's rows judged on its own (``decoder_rows``), where the
    caller computed them once for every mode."""
    if own is None:
        own = decoder_rows(test, cfg, kv_scale_floor)
        own = tag_in_place(own, tags) if tags else own
    else:  # shared by every mode's call: copied to carry this one's tags
        own = tagged(own, tags) if tags else list(own)
    pending: list[dict] = []
    device = next((recs[0][1].device for recs in test.records.values() if recs), positions.device)
    positions, rows = positions.to(device), rows.to(device) if rows is not None else None  # the decoder's device
    sel = positions if rows is None else positions[rows]
    ctx = {"positions": sel, "window": cfg.window_size, "ref": ref, "test": test, "rows": rows,
           "ratios": cfg.compress_ratios}
    own_batches = batches is None
    selections, routings, agreements, ranked = {}, {}, {}, []
    batches = PairBatches() if own_batches else _TaggedBatches(batches, tags)
    for i in range(cfg.n_layers):
        agree = _decided_rows(i, SITE.indexer_topk, ref, test, margins.selection, len(sel), device)
        if agree is not None:
            selections[i] = agree
            pending += to_rows(SITE.indexer_topk.at(i), i, {"ambiguous_queries": (~agree).sum()})
        routed = _decided_rows(i, SITE.moe_experts, ref, test, margins.routing, len(sel), device)
        if routed is not None:
            routings[i] = routed
            pending += to_rows(SITE.moe_experts.at(i), i, {"ambiguous_tokens": (~routed).sum()})
    for site in ref.records:
        if site not in test.records or (not per_position and not site_of(site).every_step):
            continue
        r = _at_rows(site, ref.get(site), test, len(positions))
        t = _align(r, test.get(site), rows)
        r, t, counts = _rows_matched(site, r.to(t.device), t)
        pending += to_rows(site, _layer(site), counts)
        if site_of(site).probe == "residual" and "shape_mismatch" not in counts:
            batches.add("residual", site, (t,))
            batches.add("residual ref", site, (r,))
        site_ctx, n_common = ctx, len(t)
        keep = _comparable_rows(site, r, t, ref, test, rows, selections, routings, agreements)
        if keep is not None:
            r, t, site_ctx = r[keep], t[keep], {**ctx, "positions": ctx["positions"][keep], "keep": keep}
        if counts.get("shape_mismatch") is not None or (site.endswith(".scores") and r.shape != t.shape):
            continue  # scores are compared through indexer recall (widths differ when the oracle pads)
        pending += compare_site(site, r, t, site_ctx, per_position, batches)
        if site in test.parts and r.is_floating_point() and site_of(site).probe != "sinkhorn":
            ranked += rank_rows(site, r, test.parts[site], rows, n_common, keep)
    pending += ranked
    if own_batches:
        return own + pending + batches.rows()
    return own + (pending if tags is None else tag_in_place(pending, tags))


class _TaggedBatches:
    """A ``PairBatches`` seen through one call's ``tags``: what ``compare_site`` adds is tagged."""

    def __init__(self, batches: PairBatches, tags: dict | None):
        self.batches, self.tags = batches, tags

    def add(self, probe: str, site: str, tensors: tuple[torch.Tensor, ...], static: tuple = ()) -> None:
        self.batches.add(probe, site, tensors, self.tags, static)


def decoder_rows(test: Recorder, cfg: ModelConfig, kv_scale_floor: str) -> list[dict]:
    """Pending rows of what the decoder's records are judged on alone, whatever the mode: its stored KV rows
    (``stored_kv_rows``) and its mHC weights' ranges (``gate_rows``)."""
    return stored_kv_rows(test, cfg, kv_scale_floor) + gate_rows(test, cfg)


def gate_rows(test: Recorder, cfg: ModelConfig) -> list[dict]:
    """``range_excess`` of every mHC ``pre`` / ``post`` record of the decoder, judged on its own (no oracle): the
    weights of each layer's streams at every call that reports them must stay in their sigmoids' ranges."""
    pre, post = (0.0, 1.0 + cfg.hc_eps), (0.0, 2.0)
    bounds = {SITE.mhc_attn_pre: pre, SITE.mhc_ffn_pre: pre, SITE.mhc_attn_post: post, SITE.mhc_ffn_post: post}
    out = []
    for site in test.records:
        if (bound := bounds.get(site_template(site))) is not None:
            out += to_rows(site, _layer(site), gate_range(test.get(site), *bound))
    return out


def _at_rows(site: str, ref: torch.Tensor, test: Recorder, n_call: int) -> torch.Tensor:
    """The oracle's rows of ``site`` that the decoder recorded it at (``Recorder.at_rows``: an engine's logits at
    each sequence's last row), where the oracle has every row of the call."""
    at = test.at_rows.get(site)
    return ref[at.to(ref.device)] if at is not None and ref.shape[0] == n_call else ref


def rank_rows(site: str, ref: torch.Tensor, parts: list, rows: torch.Tensor | None, n: int,
              keep: torch.Tensor | None) -> list[dict]:
    """Pending ``similarity`` rows of each rank's own tensor of ``site`` (``Recorder.parts``) against its part of
    the oracle's ``ref`` (the rows compared at the site: ``n`` common rows, then ``keep``): a concatenated shard
    against its slice along the split dim, a replicated copy against the whole. Rows carry ``rank`` and ``ranks``."""
    out, offset = [], 0
    for rank, ranks, dim, t in sorted(parts, key=lambda p: p[0]):
        t = _align(ref, t, rows)[:n].to(ref.device)
        t = t[keep] if keep is not None and len(keep) == len(t) else t
        if dim is None:
            want = ref
        else:
            want = ref.narrow(dim, offset, min(t.shape[dim], max(0, ref.shape[dim] - offset)))
            offset += t.shape[dim]
        if want.shape != t.shape:
            continue
        metrics = similarity_batch(want[None], t[None])
        for row in to_rows(site, _layer(site), {k: v[0] for k, v in metrics.items()}):
            row["extra"] = {"rank": rank, "ranks": ranks}
            out.append(row)
    return out


def stored_kv_rows(test: Recorder, cfg: ModelConfig, kv_scale_floor: str) -> list[dict]:
    """Pending rows of every ``kv_storage`` site the decoder reported (``L{i}.attn.kv_cache``: uint8 [n,
    row_bytes]): ``probes.kv_storage`` against the same layer's ``attn.kv`` where reported (its rows; a
    different count is ``rows_missing`` / ``rows_extra``, a row width other than the layout's ``shape_mismatch``,
    and the site is then not decoded) and the profile's scale rule."""
    out: list[dict] = []
    for site in test.records:
        if site_of(site).probe != "kv_storage":
            continue
        cache, layer = test.get(site), _layer(site)
        if cache.dim() != 2 or (cache.shape[1],) != trailing_shape(site_template(site), cfg):
            out += to_rows(site, layer, {"shape_mismatch": torch.tensor(1)})
            continue
        kv_site = same_layer(SITE.attn_kv, site)
        kv = test.get(kv_site) if kv_site in test.records else None
        if kv is not None and len(kv) != len(cache):
            out += to_rows(site, layer, {"rows_missing": torch.tensor(max(0, len(kv) - len(cache))),
                                         "rows_extra": torch.tensor(max(0, len(cache) - len(kv)))})
            n = min(len(kv), len(cache))
            kv, cache = kv[:n], cache[:n]
        out += to_rows(site, layer, kv_storage(cache, kv, cfg.head_dim, cfg.rope_head_dim, kv_scale_floor))
    return out


AFTER_SELECTION = LAYER_SITE_ORDER[LAYER_SITE_ORDER.index("attn.visible") + 1:]  # a CSA layer's sites after the top-k


def _comparable_rows(site: str, r: torch.Tensor, t: torch.Tensor, ref: Recorder, test: Recorder,
                     rows: torch.Tensor | None, selections: dict[int, torch.Tensor],
                     routings: dict[int, torch.Tensor], agreements: dict[tuple, torch.Tensor]) -> torch.Tensor | None:
    """bool [n] rows compared at ``site`` (None: all): those with an unambiguous CSA selection for the sites after
    it, and, for the sites after the routing, those both models routed alike (or, where the decoder reports no
    experts, whose oracle routing is unambiguous). ``agreements`` keeps the routing agreement of each (layer, row
    count, device) computed here, for the call's other sites after the same routing."""
    layer, keep = _layer(site), None
    if layer in selections and site.split(".", 1)[1] in AFTER_SELECTION and len(selections[layer]) == len(r):
        keep = selections[layer]
    if site_of(site).after_routing:
        same = routings.get(layer)
        if same is None:
            key = (layer, len(r), r.device)
            if key not in agreements:
                agreements[key] = _same_routing(site, r, t, ref, test, rows)
            same = agreements[key]
        if len(same) == len(r):
            keep = same if keep is None else keep & same
    return keep
