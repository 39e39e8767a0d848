"""Turn one step's pair of site recordings (oracle = reference, production = test) into pending probe rows.

Which probe a site gets, and when, is the site table's (``fidelity.model.sites.SITE_TABLE``): Sinkhorn matrices
-> ``sinkhorn`` (with orientation); indexer picks -> tie-aware ``indexer_recall``; visible sets ->
``visible_range``; routed experts -> routing agreement; logits -> also ``token_agreement``; residual streams ->
also ``residual_norms``; every other float site -> ``similarity``.
"""

from __future__ import annotations

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder, site_of
from probes import (
    expected_visible,
    indexer_recall,
    residual_norms,
    similarity,
    similarity_per_position,
    sinkhorn,
    to_rows,
    token_agreement,
    visible_range,
)

NEAR_TIE_MARGIN = 1e-2  # relative gap to the k-th oracle score under which a top-k miss is a near-tie


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
    picks = ctx["test"].get(site.replace("attn.visible", "indexer.topk"))
    picks = picks[ctx["rows"]] if ctx["rows"] is not None and len(picks) != len(ctx["positions"]) else picks
    limit = ((ctx["positions"] + 1) // 4)[:, None]
    picks = torch.where((picks >= 0) & (picks < limit), picks, -1)
    return expected_visible(ctx["positions"], ctx["window"], 4, picks, 0)


def _same_routing(site: str, r: torch.Tensor, t: torch.Tensor, ref: Recorder, test: Recorder,
                  rows: torch.Tensor | None) -> torch.Tensor:
    """bool [n]: tokens both models routed to the same experts at this layer. MoE outputs (and the streams
    after them) are compared on those: a near-tied routing flip is a discrete event counted by
    ``moe.experts``, not a numeric error of the experts."""
    experts = site.split(".")[0] + ".moe.experts"
    if experts not in ref.records or experts not in test.records:
        return torch.ones(len(r), dtype=torch.bool)
    re_ = ref.get(experts)
    te = _align(re_, test.get(experts), rows)
    return (re_.sort(-1).values == te.sort(-1).values).all(-1)


def _routing_weights(site: str, ref: torch.Tensor, test: torch.Tensor, ctx: dict) -> dict:
    """Routing weights compared per expert id on the tokens whose expert sets agree (flips are counted by
    ``moe.experts``): weight_max_err = max |w_test - w_ref|."""
    experts = site.replace("weights", "experts")
    re_, te = ctx["ref"].get(experts), ctx["test"].get(experts)
    te = _align(re_, te, ctx["rows"])
    ro, to = re_.sort(-1), te.sort(-1)
    same = (ro.values == to.values).all(-1, keepdim=True)
    rw, tw = ref.gather(-1, ro.indices).double(), test.gather(-1, to.indices).double()
    err = torch.where(same, (rw - tw).abs(), 0.0)
    return {"weight_max_err": err.amax() if err.numel() else torch.zeros((), dtype=torch.float64)}


def compare_site(site: str, ref: torch.Tensor, test: torch.Tensor, ctx: dict, per_position: bool) -> list[dict]:
    """Pending rows for one site. ``ctx``: positions, window, ref recorder (for index scores)."""
    layer, out, entry = _layer(site), [], site_of(site)
    if entry.probe == "sinkhorn":
        out += to_rows(site, layer, sinkhorn(test.double(), ref.double()))
    elif entry.probe == "indexer_recall":
        scores = ctx["ref"].get(site.replace("topk", "scores"))
        out += to_rows(site, layer, indexer_recall(test, ref, scores, NEAR_TIE_MARGIN))
    elif entry.probe == "visible_range":
        out += to_rows(site, layer, visible_range(test, _visible_reference(site, ref, ctx), ctx["positions"],
                                                  ctx["window"]))
    elif entry.probe == "routing_weights":
        out += to_rows(site, layer, _routing_weights(site, ref, test, ctx))
    elif entry.probe == "routing":
        agree = (test.sort(-1).values == ref.sort(-1).values).all(-1).double()
        out += to_rows(site, layer, {"routing_agree": agree.mean(), "routing_flips": (1 - agree).sum()})
    elif ref.is_floating_point():
        out += to_rows(site, layer, similarity(ref, test))
        if entry.probe == "residual":
            out += to_rows(site, layer, residual_norms(test.float()))
        if per_position and entry.per_position and ref.shape[0] > 1:
            pp = similarity_per_position(ref, test)
            out += to_rows(site, layer, {"cos": pp["cos"]}, positions=ctx["positions"])
        if entry.probe == "logits":
            out += to_rows("tokens", -1, token_agreement(test[-1], ref[-1]))
    return out


def compare_recordings(ref: Recorder, test: Recorder, positions: torch.Tensor, cfg: ModelConfig,
                       rows: torch.Tensor | None = None, per_position: bool = False) -> list[dict]:
    """Every site recorded by both: pending probe rows (no host transfer yet)."""
    pending: list[dict] = []
    device = next((recs[0][1].device for recs in test.records.values() if recs), positions.device)
    positions, rows = positions.to(device), rows.to(device) if rows is not None else None  # the decoder's device
    sel = positions if rows is None else positions[rows]
    ctx = {"positions": sel, "window": cfg.window_size, "ref": ref, "test": test, "rows": rows,
           "ratios": cfg.compress_ratios}
    for site in ref.records:
        if site not in test.records or (not per_position and not site_of(site).every_step):
            continue
        r = ref.get(site)
        t = _align(r, test.get(site), rows)
        site_ctx = ctx
        if site_of(site).after_routing:
            same = _same_routing(site, r, t, ref, test, rows)
            r, t, site_ctx = r[same], t[same], {**ctx, "positions": ctx["positions"][same]}
        if r.shape != t.shape and not site.endswith((".topk", ".visible", ".scores")):
            raise ValueError(f"site {site}: oracle shape {tuple(r.shape)} != production shape {tuple(t.shape)}")
        if site.endswith(".scores") and r.shape != t.shape:
            continue  # compared through indexer recall; widths differ when the oracle pads
        pending += compare_site(site, r.to(t.device), t, site_ctx, per_position)
    return pending
