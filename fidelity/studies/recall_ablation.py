"""Indexer recall ablation: which property of the default keeps its FP4 recall below the published ~99.7%.

The recall study (``fidelity.studies.recall``) is run, unchanged, on several checkpoints ("variants") over the
SAME token ids (the trained default's corpus text), so that one property changes at a time:

- ``trained-4x64``: the trained default (4 index heads of 64 dims, index_topk 32).
- ``random-4x64``: the default's config with random weights (``synthesize(config, seed)``): trained vs random.
- ``random-4x128`` / ``random-64x64``: one of head count and head width changed to DeepSeek-V4's.
- ``random-64x128``: DeepSeek-V4's indexer shape (64 heads x 128 dims, index_topk 512 as V4-Flash) on the
  default's model (6 layers, dim 256, CSA layers 2 and 4): the smallest model holding a V4-shaped indexer.

Random variants share the init recipe (``fidelity.model.synthesize``) and seed, so between two of them only the
indexer's shape differs (and the weight tensors drawn for it). ``index_topk`` is the oracle's own selection, so
it changes layer 4's inputs (through layer 2's attention) and not layer 2's: the per-layer rows keep layer 2 as
the comparison that only the indexer's shape can move. Hadamard on / off is the ``fp4`` / ``fp4-no-hadamard``
precision pair of every variant; context is a column.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from fidelity.model.synthesize import synthesize
from fidelity.studies import recall
from oracles.model import OracleModel


@dataclass(frozen=True)
class Variant:
    name: str
    weights: str  # "trained" (the checkpoint as given) or "random" (synthesize(config, seed))
    changes: tuple[tuple[str, int], ...] = ()  # config fields changed from the trained checkpoint's
    about: str = ""


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("trained-4x64", "trained", (), "the trained default: 4 index heads x 64 dims, index_topk 32"),
    Variant("random-4x64", "random", (), "the default's config, random weights"),
    Variant("random-4x128", "random", (("index_head_dim", 128),), "random, 4 heads x 128 dims (V4's width)"),
    Variant("random-64x64", "random", (("index_n_heads", 64),), "random, 64 heads (V4's count) x 64 dims"),
    Variant("random-64x128", "random", (("index_n_heads", 64), ("index_head_dim", 128), ("index_topk", 512)),
            "random, V4's indexer: 64 heads x 128 dims, index_topk 512"),
)}
DEFAULT_VARIANTS = tuple(VARIANTS)
DEFAULT_PRECISIONS = ("bf16", "fp8", "fp4", "fp4-no-hadamard")


def variant_checkpoint(variant: Variant, trained, seed: int = 0):
    """The checkpoint of ``variant``: ``trained`` itself, or random weights for its config with the changes."""
    if variant.weights == "trained":
        if variant.changes:
            raise recall.RecallError(f"variant {variant.name}: a trained checkpoint cannot change its config")
        return trained
    if variant.weights != "random":
        raise recall.RecallError(f"variant {variant.name}: weights expected trained or random, found "
                                 f"{variant.weights!r}")
    return synthesize(trained.config.replace(**dict(variant.changes)), seed)


def indexer_shape(cfg) -> str:
    return f"{cfg.index_n_heads}x{cfg.index_head_dim}"


@dataclass
class AblationResult:
    queries: pd.DataFrame  # recall.StudyResult.queries with a leading ``variant`` column
    misses: pd.DataFrame
    meta: dict


def run_ablation(trained, plan: Sequence[tuple[str, Sequence[int]]], topks: Sequence[int],
                 precisions: Sequence[str], queries: int = 256, chunk: int = 4096, seed: int = 0,
                 ids_for: Callable[[int], torch.Tensor] | None = None,
                 progress: Callable[[str], None] | None = None) -> AblationResult:
    """The recall study for each (variant name, contexts) of ``plan`` on the same token ids per context
    (``ids_for(length)``; default: ``recall.context_ids(trained, length)``, the corpus text)."""
    unknown = [v for v, _ in plan if v not in VARIANTS]
    if unknown:
        raise recall.RecallError(f"variant: expected some of {list(VARIANTS)}, found {unknown}")
    texts: dict[int, tuple[torch.Tensor, str]] = {}

    def ids(length: int) -> tuple[torch.Tensor, str]:
        if length not in texts:
            texts[length] = (ids_for(length), "given ids") if ids_for else recall.context_ids(trained, length)
        return texts[length]

    qs, ms, metas = [], [], []
    for name, contexts in plan:
        v = VARIANTS[name]
        t0 = time.perf_counter()
        ckpt = variant_checkpoint(v, trained, seed)
        recall.check_request(ckpt.config, list(contexts), list(topks), list(precisions), queries)
        oracle = OracleModel(ckpt)
        build_s = time.perf_counter() - t0
        for c in contexts:
            tok, what = ids(c)
            say = None if progress is None else (lambda s, n=name, c=c: progress(f"{n} {c}: {s}"))
            res = recall.study_context(oracle, tok, topks, precisions, queries, chunk, say)
            res.queries.insert(0, "variant", name)
            res.misses.insert(0, "variant", name)
            qs.append(res.queries)
            ms.append(res.misses)
            metas.append({"variant": name, "weights": v.weights, "indexer": indexer_shape(ckpt.config),
                          "index_topk": ckpt.config.index_topk, "changes": dict(v.changes), "about": v.about,
                          "build_s": round(build_s, 2), "text": what, **res.meta})
    return AblationResult(pd.concat(qs, ignore_index=True), pd.concat(ms, ignore_index=True),
                          {"runs": metas, "topks": list(topks), "precisions": list(precisions), "seed": seed,
                           "queries": queries, "near_tie": recall.NEAR_TIE})


def tables(result: AblationResult) -> dict[str, pd.DataFrame]:
    """``pooled`` (per variant, context, precision, k: layers pooled), ``per_layer`` and ``misses``
    (``recall.summarize`` / ``recall.miss_summary`` per variant, a leading ``variant`` column)."""
    out: dict[str, list[pd.DataFrame]] = {"pooled": [], "per_layer": [], "misses": []}
    for name, q in result.queries.groupby("variant", sort=False):
        m = result.misses[result.misses["variant"] == name]
        q = q.drop(columns="variant")
        for key, df in (("pooled", recall.summarize(q, by_layer=False)),
                        ("per_layer", recall.summarize(q, by_layer=True)),
                        ("misses", recall.miss_summary(m.drop(columns="variant"), q))):
            df.insert(0, "variant", name)
            out[key].append(df)
    return {k: pd.concat(v, ignore_index=True) for k, v in out.items()}


def ablation_table(pooled: pd.DataFrame, misses: pd.DataFrame, ks: Sequence[int] = (512, 1024)) -> pd.DataFrame:
    """One row per (variant, context, k in ``ks``): recall of each precision against the exact scores, FP4 against
    bf16 (the published comparison), FP4's worst query and mass kept, the top-k's share of compressed attention,
    and the share of FP4's misses that are near-ties and their median margin."""
    rows = []
    order = {v: i for i, v in enumerate(dict.fromkeys(pooled["variant"]))}
    for (v, c, k), g in pooled[pooled["k"].isin(ks)].groupby(["variant", "context", "k"], sort=False):
        by = g.set_index("precision")
        row = {"variant": v, "context": c, "k": k, "queries": int(by["selective"].iloc[0])}
        if row["queries"] == 0:
            continue
        for p in by.index:
            row[f"{p}"] = by.loc[p, "recall"]
        if "fp4" in by.index:
            row["fp4 vs bf16"] = by.loc["fp4", "recall_bf16"]
            row["fp4 worst"] = by.loc["fp4", "recall_min"]
            row["fp4 mass kept"] = by.loc["fp4", "mass_recall"]
            mm = misses[(misses["variant"] == v) & (misses["context"] == c) & (misses["k"] == k)
                        & (misses["precision"] == "fp4")]
            if len(mm):
                row["fp4 near-tie share"] = float(mm["near_tie_share"].iloc[0])
                row["fp4 median margin"] = float(mm["median_margin"].iloc[0])
        row["top-k mass share"] = by["dense_share"].iloc[0]
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=["variant", "context", "k", "queries"])
    return df.sort_values(["variant", "context", "k"], key=lambda s: s.map(order) if s.name == "variant" else s,
                          kind="stable", ignore_index=True)
