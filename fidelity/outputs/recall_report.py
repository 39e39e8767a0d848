"""The indexer recall study's report (``fidelity recall``, docs/recall.md): report.md and report.html read like a
run's report (the headline numbers first, then what ran, the plots, the tables), with recall.json, the summaries as
CSV, the per-query rows and the plots beside them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fidelity.outputs.report import Section, md_table, render_html, render_markdown

CAPTIONS = {"recall.png": "Recall (solid) and attention mass kept (dotted) against top-k, per context and precision",
            "misses.png": "Where the reference precision's misses fall: margin to the k-th exact score, distance "
                          "from the query, phase in the compression block"}


class RecallOutcome(Protocol):
    """What the report reads of the study's result (``fidelity.studies.recall.StudyResult``)."""

    queries: pd.DataFrame  # one row per (context, layer, precision, k, query)
    misses: pd.DataFrame  # one row per missed exact pick
    meta: dict  # contexts, topks, precisions, device, index_topk, near_tie, ratio


def plot_recall(summary: pd.DataFrame) -> Figure:
    """Figure: recall (solid) and mass recall (dotted) against k, one panel per context, a colour per precision
    (all layers pooled: ``summarize(by_layer=False)``; recall against bf16 is in the tables)."""
    contexts = sorted(summary["context"].unique())
    fig = Figure(figsize=(4.6 * len(contexts) + 1.8, 4.2), layout="constrained")
    axes = fig.subplots(1, len(contexts), squeeze=False, sharey=True)[0]
    precisions = sorted(summary["precision"].unique())
    same = {"fp4", "fp4-packed"} <= set(precisions) and np.array_equal(
        summary[summary["precision"] == "fp4"]["recall"].to_numpy(),
        summary[summary["precision"] == "fp4-packed"]["recall"].to_numpy(), equal_nan=True)
    if same:  # bit-equal scores: one line, named for both
        precisions.remove("fp4-packed")
    for ax, c in zip(axes, contexts, strict=True):
        d = summary[summary["context"] == c]
        for i, p in enumerate(precisions):
            g = d[d["precision"] == p].sort_values("k")
            name = "fp4 = fp4-packed" if same and p == "fp4" else p
            ax.plot(g["k"], g["recall"], "-o", color=f"C{i}", ms=4, label=f"{name} recall")
            ax.plot(g["k"], g["mass_recall"], ":^", color=f"C{i}", ms=4, label=f"{name} mass kept")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("top-k")
        ax.set_title(f"context {c // 1024}K" if c % 1024 == 0 else f"context {c}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean over selective queries, CSA layers pooled")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center", fontsize=7)
    return fig


def plot_misses(misses: pd.DataFrame, precision: str, near_tie: float, ratio: int) -> Figure:
    """Figure: where ``precision``'s misses fall, per k (contexts and layers pooled; each histogram sums to 1):
    margin to the k-th exact score (dashed: ``near_tie``), distance from the query, and the query's phase in its
    compression block of ``ratio`` tokens."""

    d = misses[misses["precision"] == precision]
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    ax = fig.subplots(1, 3)
    for i, k in enumerate(sorted(d["k"].unique())):
        g = d[d["k"] == k]
        share = np.full(len(g), 1 / max(1, len(g)))
        style = {"histtype": "step", "color": f"C{i}", "label": f"k={k} ({len(g)} misses)", "weights": share}
        ax[0].hist(g["margin"].clip(lower=1e-6, upper=1), bins=np.logspace(-6, 0, 25), **style)
        ax[1].hist(g["distance"].clip(lower=1), bins=np.logspace(0, 6, 25), **style)
        ax[2].hist(g["phase"], bins=np.arange(ratio + 1) - 0.5, **style)
    ax[0].axvline(near_tie, color="k", lw=0.8, ls="--")
    ax[0].set_xlabel("(s_miss - s_k) / max|s|, exact fp32 scores (first bin: <= 1e-6)")
    ax[1].axvline(128, color="k", lw=0.8, ls="--")
    ax[1].set_xlabel("tokens from the query to the missed block's last token (dashed: the window)")
    ax[2].set_xlabel("query position in its compression block (t % 4)")
    for a in ax[:2]:
        a.set_xscale("log")
    for a in ax:
        a.set_ylabel("share of misses")
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.suptitle(f"{precision} indexer: the entries of the exact fp32 top-k it misses")
    return fig


def save_figure(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)


TABLE_COLUMNS = {"context": "context", "precision": "precision", "k": "k", "selective": "queries",
                 "recall": "recall", "recall_min": "worst", "recall_tie": "tie-aware", "recall_bf16": "vs bf16",
                 "mass_recall": "mass kept", "mass_recall_min": "worst mass", "dense_share": "top-k mass share"}


def pooled_table(pooled: pd.DataFrame) -> pd.DataFrame:
    """The pooled summary (``summarize(by_layer=False)``) as shown: one row per (context, precision, k), the
    context in K, the recalls to 4 decimals ('n/a' where no query is selective)."""
    d = pooled[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    d["context"] = [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in d["context"]]
    for c in ("recall", "worst", "tie-aware", "vs bf16", "mass kept", "worst mass", "top-k mass share"):
        d[c] = [("n/a" if math.isnan(v) else f"{v:.4f}") for v in d[c]]
    return d


def format_table(pooled: pd.DataFrame) -> str:
    """Markdown table of the pooled summary (``pooled_table``)."""
    return md_table(pooled_table(pooled))


def write_study(result: RecallOutcome, tables: dict[str, pd.DataFrame], definitions: str,
                out: Path) -> dict[str, Path]:
    """Write the study to ``out``: report.md and report.html, recall.json (meta, definitions and every summary),
    summary.csv (per layer), summary_pooled.csv, misses.csv (miss summary), queries.csv.gz (one row per query),
    recall.png and misses.png (the misses of fp4, the reference precision, where it ran, else of the first
    precision with misses). ``tables``: ``per_layer``, ``pooled`` and ``misses`` (``fidelity.studies.recall.
    summaries``)."""
    out.mkdir(parents=True, exist_ok=True)
    per_layer, pooled, missed = tables["per_layer"], tables["pooled"], tables["misses"]
    paths = {"json": out / "recall.json", "summary": out / "summary.csv", "pooled": out / "summary_pooled.csv",
             "misses": out / "misses.csv", "queries": out / "queries.csv.gz", "recall_plot": out / "recall.png"}
    per_layer.to_csv(paths["summary"], index=False, float_format="%.6g")
    pooled.to_csv(paths["pooled"], index=False, float_format="%.6g")
    missed.to_csv(paths["misses"], index=False, float_format="%.6g")
    result.queries.to_csv(paths["queries"], index=False, float_format="%.6g")
    doc = {"meta": result.meta, "definitions": definitions, "summary_pooled": pooled.to_dict("records"),
           "summary_per_layer": per_layer.to_dict("records"), "misses": missed.to_dict("records")}
    paths["json"].write_text(json.dumps(doc, indent=1, default=float, allow_nan=True) + "\n")
    save_figure(plot_recall(pooled), paths["recall_plot"])
    precision = "fp4" if "fp4" in set(result.misses["precision"]) else None
    if precision is None and len(result.misses):
        precision = str(result.misses["precision"].iloc[0])
    if precision is not None:
        paths["misses_plot"] = out / "misses.png"
        save_figure(plot_misses(result.misses, precision, result.meta["near_tie"], result.meta["ratio"]),
                    paths["misses_plot"])
    sections = report_sections(result, pooled, missed, definitions,
                               [paths[k] for k in ("recall_plot", "misses_plot") if k in paths])
    title = "dsv4-fidelity indexer recall study"
    paths["report"], paths["report_html"] = out / "report.md", out / "report.html"
    paths["report"].write_text(render_markdown(title, sections, out), encoding="utf-8")
    paths["report_html"].write_text(render_html(title, sections), encoding="utf-8")
    return paths


def headline(pooled: pd.DataFrame, index_topk: int) -> list[str]:
    """One line per context: the reference precision's (fp4, else the first) mean recall, tie-aware recall and mass
    kept at the checkpoint's top-k (else the smallest k studied) over the selective queries."""
    if pooled.empty:
        return ["No query was scored."]
    precision = "fp4" if "fp4" in set(pooled["precision"]) else str(pooled["precision"].iloc[0])
    rows = pooled[pooled["precision"] == precision]
    k = index_topk if index_topk in set(rows["k"]) else int(rows["k"].min())
    lines = []
    for r in rows[rows["k"] == k].itertuples():
        if not r.selective:
            lines.append(f"{precision} at k {k}, context {r.context}: no query sees more than {k} entries (recall 1 "
                         "trivially).")
            continue
        lines.append(f"{precision} at k {k}, context {r.context}: recall {r.recall:.4f} (worst query "
                     f"{r.recall_min:.4f}), tie-aware {r.recall_tie:.4f}, attention mass kept {r.mass_recall:.4f}, "
                     f"over {r.selective} selective queries.")
    return lines


def report_sections(result: RecallOutcome, pooled: pd.DataFrame, missed: pd.DataFrame, definitions: str,
                    images: list[Path]) -> list[Section]:
    """The report in reading order: the headline numbers, what ran, the plots, recall per (context, precision,
    k), the misses, the definitions (collapsed in HTML)."""
    meta = result.meta
    contexts = ", ".join(f"{c['context']} ({c['queries']} queries, prefill {c['prefill_s']} s, {c['text']})"
                         for c in meta["contexts"])
    run = [f"Contexts: {contexts}.", f"Precisions {', '.join(meta['precisions'])}; top-k "
           f"{', '.join(map(str, meta['topks']))}; the checkpoint's index_topk {meta['index_topk']}; device "
           f"{meta['device']}."]
    return [Section("Headline", headline(pooled, meta["index_topk"])),
            Section("Run", run),
            Section("Plots", [] if images else ["No plot had data."], images=images, captions=CAPTIONS),
            Section("Recall per context, precision and k", ["Means over the selective queries (more visible entries "
                    "than k), CSA layers pooled; worst: the worst query."], pooled_table(pooled), na="-"),
            Section("Misses", [f"Per (context, precision, k): a miss within {meta['near_tie']} of the k-th exact "
                               "score is a near-tie."], missed if len(missed) else None, na="-"),
            Section("Definitions", ["Each number's definition is in recall.json and docs/recall.md."],
                    details=definitions, details_title="how each number is defined")]
