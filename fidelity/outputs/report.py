"""Run report: ``report.md`` and a self-contained ``report.html`` (inline CSS, plots as base64 PNG).

Sections: verdict and first divergence (the report's first lines), what ran, per-layer local (op/layer mode) vs
inherited (free mode) error, residual RMS (oracle beside decoder), Sinkhorn, indexer recall, visible range,
anomalies, token agreement, memory flatness, plots, the thresholds applied.
Tables are rendered here from pandas (no tabulate); every string taken from data is escaped for both formats.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path

import numpy as np
import pandas as pd

from fidelity.atomic_write import write_text_atomic
from fidelity.harness.judgement import Judgement, judge, run_rules
from fidelity.harness.thresholds import (
    COMB_SITES,
    EXPECTED_NONFINITE,
    MODES,
    TOKEN_FLIP_MARGIN,
    Threshold,
    fmt_num,
    profile_fields,
    profile_label,
    site_order_key,
    sort_divergence,
    token_flip_rows,
    wide,
)
from fidelity.model.sites import ROW, SITE, layer_sites_regex
from fidelity.outputs.plots import SINKHORN_METRICS, loop_onset_step, make_plots
from probes.memory import WARMUP_DECODE_CALLS
from probes.metrics import METRICS

FAILURE_ROWS = 25
PLOT_CAPTIONS = {
    "cos_over_steps.png": "Per-layer worst 1 - cos over steps",
    "heatmap_1mcos.png": "Layer x step heatmap of 1 - cos (log colour scale)",
    "residual_norms.png": "Residual stream RMS per layer: production's streams; oracle vs decoder over every stream",
    "sinkhorn.png": "Sinkhorn deviations as judged (row excess over the oracle's, columns) per layer, with limits",
    "recall.png": "Indexer recall@k over steps",
}


@dataclass
class Section:
    """A report section: a title, paragraphs and an optional table; ``css`` tags the HTML section."""

    title: str
    text: list[str] = field(default_factory=list)
    table: pd.DataFrame | None = None
    css: str = ""
    images: list[Path] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)  # image file name -> caption (else PLOT_CAPTIONS')
    details: str = ""  # preformatted text shown collapsed in HTML only
    details_title: str = "details"
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (caption, preformatted text), side by side in HTML
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)  # (caption, table) after ``table``
    collapsed: str = ""  # HTML: ``table`` folded in a <details> with this summary
    na: str = "nan"  # how the tables show a missing value ('-': nothing ran there)
    links: tuple[str, ...] = ()  # columns whose cells are relative links (HTML)
    nowrap: tuple[str, ...] = ()  # columns kept on one line (HTML)


# ---- value formatting and tables -------------------------------------------------------------------------------

def fmt_value(v: object, na: str = "nan") -> str:
    """Table cell text: integers plainly, floats with 6 significant digits (more next to 1), NaN as ``na``."""
    if v is None or v is pd.NA:
        return ""
    if isinstance(v, bool | np.bool_):
        return "yes" if v else "no"
    if isinstance(v, Integral):
        return str(int(v))
    if isinstance(v, Real):
        f = float(v)
        if math.isnan(f):
            return na
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return str(int(f)) if f.is_integer() and abs(f) < 1e15 else fmt_num(f)
    return str(v)


_MD_SPECIAL = re.compile(r"([\\`*|\[\]]|<(?=[A-Za-z/!?]))")


def md_escape(text: str) -> str:
    """Escape what markdown would interpret (emphasis, code, tables, links, raw HTML tags); one line."""
    return _MD_SPECIAL.sub(r"\\\1", str(text)).replace("\n", " ")


def _numeric(df: pd.DataFrame) -> list[bool]:
    return [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]


def md_table(df: pd.DataFrame, na: str = "nan") -> str:
    """A GitHub-flavoured markdown table (numeric columns right-aligned; a missing value as ``na``)."""
    head = "| " + " | ".join(md_escape(c) for c in df.columns) + " |"
    sep = "|" + "|".join("---:" if n else "---" for n in _numeric(df)) + "|"
    rows = ["| " + " | ".join(md_escape(fmt_value(v, na)) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *rows])


def _cell(v: object, numeric: bool, na: str, link: bool, nowrap: bool) -> str:
    text = html.escape(fmt_value(v, na))
    classes = " ".join(c for c, on in (("num", numeric), ("nowrap", nowrap)) if on)
    attr = f' class="{classes}"' if classes else ""
    content = f'<a href="{text}">{text}</a>' if link and text not in ("", na) else text
    return f"<td{attr}>{content}</td>"


def html_table(df: pd.DataFrame, na: str = "nan", links: Sequence[str] = (), nowrap: Sequence[str] = ()) -> str:
    """An HTML table with escaped cells; a missing value as ``na``, the cells of ``links`` as links, those of
    ``nowrap`` on one line."""
    numeric = _numeric(df)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = []
    for row in df.itertuples(index=False):
        cells = "".join(_cell(v, n, na, c in links, c in nowrap)
                        for v, n, c in zip(row, numeric, df.columns, strict=True))
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


# ---- aggregation helpers ---------------------------------------------------------------------------------------

def worst(frame: pd.DataFrame, keys: list[str], how: str) -> pd.Series:
    """``value`` aggregated by ``keys`` with ``how`` (min/max/sum/mean); a NaN in a group makes min/max NaN."""
    out = getattr(frame.groupby(keys)["value"], how)()
    if how in ("min", "max"):
        out = out.where(~frame.assign(_nan=frame["value"].isna()).groupby(keys)["_nan"].any())
    return out


def _sites(df: pd.DataFrame, site_regex: str) -> pd.DataFrame:
    return df[df["site"].str.fullmatch(site_regex)]


def _sort_sites(table: pd.DataFrame) -> pd.DataFrame:
    sites = sorted(table["site"].unique(), key=site_order_key)
    key = table["site"].map({s: i for i, s in enumerate(sites)})
    if "mode" in table:
        key = key * len(MODES) + table["mode"].map({m: i for i, m in enumerate(MODES)}).fillna(0)
    return table.assign(_k=key).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)


def site_table(df: pd.DataFrame, site_regex: str, aggs: Sequence[tuple[str, str, str]]) -> pd.DataFrame | None:
    """Per (site[, mode]) aggregates: ``aggs`` holds (metric, how, column label). Mode is a key when > 1 mode."""
    sub = _sites(df, site_regex)
    sub = sub[sub["metric"].isin([a[0] for a in aggs])]
    if sub.empty:
        return None
    keys = ["site"] + (["mode"] if sub["mode"].nunique() > 1 else [])
    cols = {label: worst(sub[sub["metric"] == m], keys, how) for m, how, label in aggs if (sub["metric"] == m).any()}
    return _sort_sites(pd.DataFrame(cols).reset_index())


def first_location(df: pd.DataFrame, site_regex: str, trigger: Sequence[str], where: Sequence[str]) -> pd.Series:
    """Per site (and mode), 'step s, query q, ...' of the earliest row whose ``trigger`` metrics sum above 0."""
    sub = _sites(df, site_regex)
    sub = sub[sub["metric"].isin([*trigger, *where])]
    if sub.empty or not set(trigger) & set(sub["metric"]):
        return pd.Series(dtype=object)
    table = wide(sub)
    bad = table[table[[t for t in trigger if t in table]].sum(axis=1) > 0].sort_values(["step", "position"])
    group = ["site"] + (["mode"] if sub["mode"].nunique() > 1 else [])
    if bad.empty:
        return pd.Series(dtype=object)

    def describe(r: pd.Series) -> str:
        parts = [f"step {int(r['step'])}"] + [f"{w.removeprefix('first_')} {fmt_value(r[w])}" for w in where if w in r]
        return ", ".join(parts)

    return bad.groupby(group).head(1).set_index(group).apply(describe, axis=1)


# ---- sections --------------------------------------------------------------------------------------------------

def describe_checkpoint(info: dict | None) -> str:
    """One line naming what was tested: preset and seed or path, layout, content hash."""
    if not info:
        return "not recorded"
    if info.get("preset"):
        where = f" on {info['device']}" if info.get("device", "cpu") != "cpu" else ""
        what = f"preset '{info['preset']}' (synthetic{where}, seed {info.get('seed')})"
    elif info.get("path"):
        what = f"{info['path']} ({info.get('layout', '?')} layout)"
    else:
        what = f"in memory ({info.get('layout', '?')} layout" + (f", seed {info['seed']})" if "seed" in info else ")")
    digest = info.get("hash")
    scope = info.get("hash_scope", "")
    return what + (f", sha256 {digest}" + (f" ({scope})" if scope else "") if digest else "")


def decode_path(manifest: dict) -> str:
    """How the run's decoder decoded (the manifest's ``decode_graphs`` fields): CUDA graphs with their replays, the
    uncaptured graph step, eager (with the reason where graphs were asked for), or '-' where the manifest does not
    say (another decoder, an older run)."""
    if "decode_graphs" not in manifest:
        return "-"
    if not manifest["decode_graphs"]:
        off = manifest.get("decode_graphs_off")
        return f"eager ({off})" if off else "eager"
    if manifest.get("decode_graph_captured"):
        return f"CUDA graphs ({manifest.get('decode_graph_replays', 0)} replays)"
    return "graph step, uncaptured"


def header_section(df: pd.DataFrame, manifest: dict) -> Section:
    """Run identity: what was tested, the data extent, then the manifest's scalar entries."""
    steps = sorted(df["step"].unique())
    layers = sorted(v for v in df["layer"].unique() if v >= 0)
    profile = manifest.get("profile")
    present = set(df["mode"].unique())
    facts = {
        "checkpoint": describe_checkpoint(manifest.get("checkpoint")),
        "run_id": ", ".join(map(str, df["run_id"].unique())) or manifest.get("run_id", ""),
        "modes": ", ".join(m for m in MODES if m in present),
        "profile": profile_label(profile) if profile else ", ".join(map(str, df["profile"].unique())),
        "steps": _steps_text(df) if steps else "none",
        "layers": f"{len(layers)} (L{layers[0]}..L{layers[-1]})" if layers else "none",
        "metric rows": len(df),
    }
    facts.update(_kernel_facts(manifest))
    if "decode_graphs" in manifest:
        facts["decode"] = decode_path(manifest)
    for phase, peaks in (manifest.get("memory_peaks") or {}).items():
        facts[f"peak memory, {phase}"] = ", ".join(f"{k.removesuffix('_peak_bytes').replace('_', ' ')} "
                                                  f"{_gib(v)}" for k, v in peaks.items())
    parts = manifest.get("seconds_by_part") or {}
    if parts:
        facts["time by part"] = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    for key, v in manifest.items():
        if key == "generated" and isinstance(v, list):
            v = f"{len(v)} tokens (ids in manifest.json)"
        elif isinstance(v, list | tuple) and all(isinstance(x, str | int | float) for x in v):
            v = " ".join(map(str, v))  # e.g. the command line
        if isinstance(v, str | int | float | bool) and key not in facts:
            facts[key] = v
    if isinstance(profile, dict):
        facts["profile fields"] = _profile_fields_text(profile)
    table = pd.DataFrame({"field": list(facts), "value": [fmt_value(v) for v in facts.values()]})
    manifest_json = json.dumps(manifest, indent=2, sort_keys=True, default=str)
    tested = manifest.get("decoder", facts["profile"])
    text = [f"Tested: {tested} on {facts['checkpoint']}.", "The full manifest is in manifest.json."]
    return Section("Run", text, table, details=manifest_json, details_title="manifest.json",
                   collapsed=f"{len(table)} fields of this run")


def _profile_fields_text(profile: dict) -> str:
    """The production profile's fields that differ from ``reference``; for a decoder with no such fields (its own
    numerics, e.g. transformers' model), what its profile says instead."""
    fields = profile_fields(profile) or {}
    if not fields:
        precision = f", precision {profile['precision']}" if profile.get("precision") else ""
        return f"none: not a production profile (the decoder's own numerics{precision})"
    reference = profile_fields("reference") or {}
    changed = {k: v for k, v in fields.items() if reference.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "as reference"


def _steps_text(df: pd.DataFrame) -> str:
    """'65 (prefill + 64 decode)', or '20 (prefill in 16 chunks + 4 decode)'."""
    pre = df.loc[df["phase"] == "prefill", "step"].nunique()
    dec = df.loc[df["phase"] == "decode", "step"].nunique()
    prefill = "prefill" if pre <= 1 else f"prefill in {pre} chunks"
    return f"{pre + dec} ({prefill} + {dec} decode)"


def _kernel_facts(manifest: dict) -> dict[str, str]:
    """The ops that resolved to a GPU kernel, the calls where a kernel's wrapper ran the emulation instead, and the
    routes the indexer's top-k (``radix``: the Triton selection) and the sparse attention (``ws``: the warp-specialized
    kernel) took."""
    kernels = sorted(op for op, impl in (manifest.get("implementations") or {}).items() if impl != "cpu")
    facts = {"kernels": ", ".join(kernels)} if kernels else {}
    fallbacks = manifest.get("kernel_fallbacks") or {}
    if fallbacks:
        facts["kernel fallbacks (emulation ran)"] = "; ".join(
            f"{op}: " + ", ".join(f"{reason} ({n} calls)" for reason, n in sorted(by_reason.items()))
            for op, by_reason in sorted(fallbacks.items()))
    for key, label in (("topk_routes", "indexer top-k routes"), ("index_routes", "indexer scoring routes"),
                       ("attention_routes", "sparse attention routes")):
        if manifest.get(key):
            facts[label] = ", ".join(f"{r} ({n} calls)" for r, n in sorted(manifest[key].items()))
    return facts


def raised_in_call(ended: dict) -> str:
    """A manifest's ``decoder_raised`` in short: "IndexError: ... (call 3, decode)"."""
    return f"{ended['error']} (call {ended['step']}, {ended['phase']})"


def decoder_raised_line(manifest: dict) -> str | None:
    """What the decoder raised, at which call and after which site, when it ended the run (None: it did not)."""
    r = manifest.get("decoder_raised")
    if not r:
        return None
    after = f", after recording {r['after_site']}" if r.get("after_site") else ", before recording any site"
    return (f"the decoder raised {r['error']} in call {r['step']} ({r['phase']}){after}; the run ends there "
            "(the calls before it are judged)")


def verdict_section(judgement: Judgement, manifest: dict | None = None) -> Section:
    """PASS/FAIL with counts, the first divergence, what the decoder raised if it ended the run, and the failing
    rules in divergence order."""
    section = _verdict(judgement)
    line = decoder_raised_line(manifest or {})
    if line:
        section.text.insert(2, line[0].upper() + line[1:] + ".")
    return section


def _verdict(judgement: Judgement) -> Section:
    judged = judgement.judged
    failures = sort_divergence(judged[~judged["passed"]])
    n, bad = len(judged), len(failures)
    if n == 0:
        return Section("Verdict", ["NO CHECKS: no metric row has a threshold rule.", "first divergence: none"],
                       css="fail")
    if bad == 0:
        return Section("Verdict", [f"PASS: all {n} checked values are within their thresholds.",
                                   "first divergence: none"], css="pass")
    pairs = failures[["site", "metric"]].drop_duplicates()
    text = [f"FAIL: {bad} of {n} checked values fail ({len(pairs)} site/metric pairs at "
            f"{pairs['site'].nunique()} sites).", f"first divergence: {judgement.first_divergence}"]
    keys = ["site", "metric", "threshold"]
    groups = failures.groupby(keys, sort=False)
    sign = groups["op"].first().map({">=": -1.0, "<=": 1.0})
    signed = worst(failures.assign(value=failures["value"] * np.where(failures["op"] == ">=", -1.0, 1.0)), keys, "max")
    order = sign.index
    table = pd.DataFrame({
        "failures": groups.size().reindex(order),
        "worst": (signed.reindex(order) * sign),
        "first step": groups["step"].first().reindex(order),
        "modes": groups["mode"].agg(lambda s: ", ".join(m for m in MODES if m in set(s))).reindex(order),
    }).reset_index()
    if len(table) > FAILURE_ROWS:
        text.append(f"Showing the first {FAILURE_ROWS} of {len(table)} failing site/metric pairs.")
    return Section("Verdict", text, table.head(FAILURE_ROWS), css="fail")


MODE_TEXT = {"free": "the oracle runs its own model on the same tokens", "layer": "each oracle layer on the "
             "decoder's input to that layer", "op": "each oracle op on the decoder's exact op inputs"}


def modes_section(df: pd.DataFrame, manifest: dict) -> Section:
    """Which comparison modes ran, on how many sites, and why a requested mode was skipped."""
    skipped = manifest.get("modes_skipped") or {}
    rows = []
    for mode in (*MODES[::-1], *(m for m in skipped if m not in MODES)):
        sub = df[df["mode"] == mode]
        if not sub.empty:
            sites = sorted(sub["site"].unique(), key=site_order_key)
            rows.append({"mode": mode, "status": "ran", "sites compared": len(sites),
                         "what it compares": MODE_TEXT.get(mode, "")})
        elif mode in skipped:
            rows.append({"mode": mode, "status": f"skipped: {skipped[mode]}", "sites compared": 0,
                         "what it compares": MODE_TEXT.get(mode, "")})
    text = [f"Decoder under test: {manifest.get('decoder', 'production')}."]
    return Section("Modes", text, pd.DataFrame(rows))


LAYER_ERROR_SITES = layer_sites_regex(SITE.attn_out, SITE.moe_out, SITE.residual)
SCOPE = {"op": "local", "layer": "local", "free": "inherited"}


def layer_error_section(df: pd.DataFrame) -> Section:
    """Worst cos / calc_diff per layer output site, local (op/layer mode) next to inherited (free mode)."""
    sub = _sites(df, LAYER_ERROR_SITES)
    sub = sub[sub["metric"].isin(["cos", "calc_diff"])].assign(scope=lambda f: f["mode"].map(SCOPE))
    cols = {}
    for metric, how in (("cos", "min"), ("calc_diff", "max")):
        for scope in ("local", "inherited"):
            rows = sub[(sub["metric"] == metric) & (sub["scope"] == scope)]
            if not rows.empty:
                cols[f"{metric} {scope}"] = worst(rows, ["site"], how)
    title = "Per-layer error: local vs inherited"
    if not cols:
        return Section(title, ["No cos / calc_diff rows for attn.out, moe.out or residual in this run."])
    local = ", ".join(m for m in ("op", "layer") if m in set(sub["mode"])) or "none"
    text = [f"Worst over steps and positions. local = op/layer mode (present: {local}): what the layer's own kernels "
            "and cache precision add; inherited = free mode: everything upstream included."]
    return Section(title, text, _sort_sites(pd.DataFrame(cols).rename_axis("site").reset_index()))


RESIDUAL_SITE = SITE.residual.regex
RESIDUAL_MODES = {"free": "free mode: the oracle's own model on the same tokens (its growth is the model's)",
                  "layer": "layer mode: each oracle layer on the decoder's input to that layer",
                  "op": "op mode: the oracle's ops on the decoder's op inputs"}


def _by_step(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """``metric`` as a layer x step grid (empty without such rows)."""
    return rows[rows["metric"] == metric].pivot_table(index="layer", columns="step", values="value", aggfunc="max")


def _farthest_from_one(ratio: pd.DataFrame) -> pd.Series:
    """Per layer, the ratio whose log is largest in magnitude over the steps (NaN where it has none)."""
    if ratio.empty:
        return pd.Series(np.nan, index=ratio.index)
    dist = np.log(ratio.astype(float)).abs()
    return pd.Series([ratio.loc[i, dist.loc[i].idxmax()] if dist.loc[i].notna().any() else np.nan
                      for i in ratio.index], index=ratio.index)


def residual_rms_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per layer of one mode's ``L{i}.residual`` rows: the oracle's (``ref_rms``) and the decoder's (``rms``) RMS in
    the prefill (the largest chunk's) and over the decode steps (the oracle's first, last and largest, the
    decoder's largest), and decoder / oracle at the step where it is farthest from 1; a model's columns only where
    the rows hold its RMS."""
    oracle, decoder = _by_step(rows, "ref_rms"), _by_step(rows, "rms")
    layers = sorted(set(oracle.index) | set(decoder.index))
    oracle, decoder = oracle.reindex(layers), decoder.reindex(layers)
    phase = rows.groupby("step")["phase"].first()
    cols: dict[str, pd.Series] = {"layer": pd.Series([f"L{i}" for i in layers], index=layers, dtype=object)}
    for label in ("prefill", "decode"):
        steps = list(phase[phase == label].index)
        o, d = oracle[[s for s in steps if s in oracle]], decoder[[s for s in steps if s in decoder]]
        if label == "prefill":
            cols |= {"oracle prefill": o.max(axis=1)} if not o.empty else {}
            cols |= {"decoder prefill": d.max(axis=1)} if not d.empty else {}
        else:
            cols |= {"oracle decode first": o.iloc[:, 0], "oracle decode last": o.iloc[:, -1],
                     "oracle decode max": o.max(axis=1)} if not o.empty else {}
            cols |= {"decoder decode max": d.max(axis=1)} if not d.empty else {}
        both = [s for s in steps if s in oracle and s in decoder]
        if both:
            cols[f"ratio {label}"] = _farthest_from_one(decoder[both] / oracle[both])
    return pd.DataFrame(cols).reset_index(drop=True)


def _growth_text(table: pd.DataFrame, mode: str) -> str:
    """One line: the oracle's RMS at the first and the last layer in the prefill, and the last layer's over the
    decode steps."""
    first, last = table.iloc[0], table.iloc[-1]
    parts = []
    if "oracle prefill" in table:
        parts.append(f"prefill {first['layer']} {fmt_num(first['oracle prefill'])} -> {last['layer']} "
                     f"{fmt_num(last['oracle prefill'])} (x{last['oracle prefill'] / first['oracle prefill']:.3g})")
    if "oracle decode first" in table:
        parts.append(f"decode {last['layer']}: first step {fmt_num(last['oracle decode first'])}, last step "
                     f"{fmt_num(last['oracle decode last'])}, max {fmt_num(last['oracle decode max'])}")
    ratios = table[[c for c in ("ratio prefill", "ratio decode") if c in table]].to_numpy(dtype=float)
    if ratios.size and np.isfinite(ratios).any():
        parts.append(f"decoder / oracle {fmt_num(np.nanmin(ratios))} .. {fmt_num(np.nanmax(ratios))}")
    return f"Oracle residual RMS ({mode} mode): " + "; ".join(parts) + "." if parts else ""


def residual_section(df: pd.DataFrame) -> Section:
    """Residual growth: per layer, the oracle's RMS of the streams leaving the layer beside the decoder's (and their
    ratio), in the prefill and over the decode steps, a table per mode; says what the run's rows lack."""
    title = "Residual stream RMS"
    sub = _sites(df, RESIDUAL_SITE)
    if sub.empty:
        return Section(title, ["No L{i}.residual rows in this run: the decoder reports no residual streams."])
    text = ["RMS over every mHC stream of L{i}.residual (the streams leaving layer i), per model call: the "
            "prefill's over the prompt's tokens (the largest chunk's when chunked), a decode step's over its token. "
            "ratio = decoder / oracle at the same call, the call farthest from 1. Growth over layers reads down a "
            "column, growth over a long decode from 'decode first' to 'decode last'."]
    tables, lines = [], []
    for mode in ("free", "layer", "op"):
        rows = sub[(sub["mode"] == mode) & sub["metric"].isin(["rms", "ref_rms"])]
        if rows.empty:
            continue
        table = residual_rms_table(rows)
        tables.append((RESIDUAL_MODES[mode], table))
        lines.append(_growth_text(table, mode))
    missing = [f"{who} ({metric})" for metric, who in (("ref_rms", "the oracle's"), ("rms", "the decoder's"))
               if not (sub["metric"] == metric).any()]
    if missing:
        text.append("This run's table holds no RMS of " + " or ".join(missing) + " at L{i}.residual (a run "
                    "recorded before both were written); the decoder's per-stream RMS, where present, is in the "
                    "residual_norms plot.")
    return Section(title, [*text, *filter(None, lines)], tables=tables)


def _with_first(table: pd.DataFrame, loc: pd.Series, label: str) -> pd.DataFrame:
    if loc.empty:
        return table.assign(**{label: "-"})
    loc_df = loc.rename(label).reset_index()
    on = [c for c in loc_df.columns if c != label and c in table.columns]
    return table.merge(loc_df[[*on, label]], on=on, how="left").fillna({label: "-"})


def sinkhorn_section(df: pd.DataFrame, judgement: Judgement) -> Section:
    """mHC mixing matrices: doubly-stochastic deviation, non-negativity and orientation; the limits as the run's
    rules set them."""
    table = site_table(df, COMB_SITES, [
        ("row_dev", "max", "row_dev max"), ("row_dev_excess", "max", "row excess max"),
        ("col_dev", "max", "col_dev max"), ("min_value", "min", "min value"), ("negative_count", "sum", "negatives"),
        ("orientation_err", "max", "orientation_err max"), ("transposed_err", "max", "transposed_err max"),
        ("orientation_flip", "sum", "orientation flips")])
    if table is None:
        return Section("Sinkhorn (mHC comb)", ["No mHC comb rows in this run."])
    text = ["20 Sinkhorn iterations end on a column normalisation, so columns sum to 1 up to rounding, but rows of "
            "peaky matrices stay off in the oracle too (up to ~0.1 on a trained model): rows are judged by their "
            "deviation beyond the oracle's own (row excess), columns absolutely. A flip means production's matrix is "
            "closer to the oracle's transpose: still doubly stochastic, but mixing the streams the wrong way round.",
            "Judged in this run: " + (_judged_text(judgement, COMB_SITES, SINKHORN_METRICS) or "nothing") + "."]
    return Section("Sinkhorn (mHC comb)", text, table)


def _judged_text(judgement: Judgement, site_regex: str, metrics: Sequence[str]) -> str:
    """'row_dev_excess <= 0.01 (op, layer mode), col_dev <= 0.01 (op, layer, free mode)': the limits and modes
    that judged ``metrics`` at the sites matching ``site_regex`` in this run."""
    judged = judgement.judged
    rows = judged[judged["site"].str.fullmatch(site_regex) & judged["metric"].isin(list(metrics))]
    parts = []
    for metric in metrics:
        for threshold, g in rows[rows["metric"] == metric].groupby("threshold", sort=False):
            parts.append(f"{metric} {threshold} ({', '.join(m for m in MODES if m in set(g['mode']))} mode)")
    return ", ".join(parts)


def indexer_section(df: pd.DataFrame) -> Section:
    """Tie-aware recall@k of the lightning indexer's top-k."""
    site = SITE.indexer_topk.regex
    table = site_table(df, site, [
        ("recall", "min", "recall min"), ("recall", "mean", "recall mean"), ("near_tie_miss", "sum", "near-tie misses"),
        ("true_miss", "sum", "true misses"), ("rank_disp_mean", "mean", "rank disp mean"),
        ("rank_disp_max", "max", "rank disp max")])
    if table is None:
        return Section("Indexer recall", ["No indexer rows in this run."])
    table = _with_first(table, first_location(df, site, ["true_miss"], ["first_true_miss_query"]), "first true miss")
    text = ["A miss whose oracle score is within the tie margin of the k-th score is a near-tie; true misses are "
            "the rest."]
    return Section("Indexer recall", text, table)


def visible_section(df: pd.DataFrame) -> Section:
    """Exact set difference of the KV positions each query may attend to."""
    site = SITE.attn_visible.regex
    table = site_table(df, site, [("missing", "sum", "missing"), ("extra", "sum", "extra")])
    if table is None:
        return Section("Visible range", ["No visible-range rows in this run."])
    loc = first_location(df, site, ["missing", "extra"], ["first_query", "first_kv", "first_kind"])
    text = ["Window (128 incl. self) plus selected compressed entries, causal rule j < (t+1)//ratio; "
            "any missing or extra position is a failure."]
    return Section("Visible range", text, _with_first(table, loc, "first problem"))


SIMILARITY_VALUES = ("cos", "calc_diff", "rel_l2", "sqnr_db", "max_abs")


def anomaly_section(df: pd.DataFrame) -> Section:
    """Non-finite values: where NaN/Inf first appear in the decoder or differ from the oracle's, per site and
    mode, with the oracle's own non-finite count (both non-finite: the weights or inputs, not a kernel)."""
    pos = df["value"] > 0
    expected = df["site"].str.fullmatch(EXPECTED_NONFINITE)
    mismatch = df[(df["metric"] == "nonfinite_mismatch") & pos]
    unexpected = df[(df["metric"] == "test_nonfinite") & pos & ~expected]
    nan_metric = df[df["metric"].isin(SIMILARITY_VALUES) & df["value"].isna()]
    rows = pd.concat([mismatch, unexpected, nan_metric], ignore_index=True)
    if rows.empty:
        return Section("Anomalies", ["No non-finite values: NaN/Inf positions match everywhere, production emits no "
                                     "unexpected NaN/Inf and every similarity metric is finite."])
    r = sort_divergence(rows).iloc[0]
    at = (df["step"] == r["step"]) & (df["site"] == r["site"]) & (df["mode"] == r["mode"]) & (df["position"] == -1)
    counts = df[at].set_index("metric")["value"]
    oracle, test = counts.get("ref_nonfinite", 0.0), counts.get("test_nonfinite", 0.0)
    if oracle > 0:
        whose = ("the oracle has non-finite values there too: the weights or inputs, not a kernel" if test > 0 else
                 "production is finite there and the oracle is not: these weights or inputs overflow the oracle's "
                 "arithmetic")
    else:
        whose = "the oracle's values are finite there: the decoder made them"
    text = [f"first non-finite: step {int(r['step'])} ({r['phase']}), {r['site']} ({r['mode']} mode): "
            f"{fmt_value(counts.get('test_nonfinite', float('nan')))} non-finite values in production, "
            f"{fmt_value(counts.get('nonfinite_mismatch', float('nan')))} positions differing from the oracle; "
            f"{whose}.",
            f"Non-finite values in production are expected only at {EXPECTED_NONFINITE} (-inf = invisible)."]
    keys = ["site", "mode"]
    sites = rows[keys].drop_duplicates()
    scope = df.merge(sites, on=keys)
    table = pd.DataFrame({
        "first step": rows.groupby(keys)["step"].min(),
        "production non-finite (max)": unexpected.groupby(keys)["value"].max(),
        "oracle non-finite (max)": scope[scope["metric"] == "ref_nonfinite"].groupby(keys)["value"].max(),
        "mismatched positions (max)": mismatch.groupby(keys)["value"].max(),
        "NaN metric values": rows.assign(nan=rows["value"].isna()).groupby(keys)["nan"].sum(),
    }).rename_axis(keys).fillna(0).reset_index()
    table = _sort_sites(table)
    if len(table) > FAILURE_ROWS:
        text.append(f"Showing the first {FAILURE_ROWS} of {len(table)} sites (in data-flow order).")
    return Section("Anomalies", text, table.head(FAILURE_ROWS))


def token_section(df: pd.DataFrame, margin: float = TOKEN_FLIP_MARGIN) -> Section:
    """Greedy-token agreement per mode, with flips that beat the stated oracle margin."""
    tok = df[(df["site"] == ROW.tokens.name) & df["metric"].isin(["agree", "ref_margin"])]
    if not (tok["metric"] == "agree").any():
        return Section("Token agreement", ["No token rows in this run."])
    table = wide(tok)
    if "ref_margin" not in table:
        table["ref_margin"] = np.nan
    flips = token_flip_rows(df, margin)
    rows = []
    for mode, g in table.groupby("mode"):
        off = g[g["agree"] == 0]
        rows.append({"mode": mode, "tokens": len(g), "agree": int((g["agree"] != 0).sum()),
                     "rate": float((g["agree"] != 0).mean()),
                     f"flips with ref margin > {fmt_num(margin)}": int(flips.loc[flips["mode"] == mode, "value"].sum()),
                     "largest ref margin at a flip": off["ref_margin"].max() if len(off) else "-",
                     "first flip step": int(off["step"].min()) if len(off) else "-"})
    text = [f"Agreement is informational: a disagreement fails only when the oracle's top-1 logit beat its top-2 by "
            f"more than {fmt_num(margin)} (below that it is a near tie any rounding may flip)."]
    return Section("Token agreement", text, _sort_modes(pd.DataFrame(rows)))


def repetition_section(df: pd.DataFrame, manifest: dict) -> Section | None:
    """Whether the stream's decode tokens fall into a loop, and the free-mode logits cosine before and after it."""
    rep = df[(df["site"] == ROW.repetition.name) & (df["metric"] != "ngram_seen")]
    if rep.empty:
        return None
    v = rep.groupby("metric")["value"].last()
    onset, n = int(v["loop_onset"]), int(manifest.get("decode_steps", 0))
    row = {"stream": manifest.get("stream", "oracle"), "decode tokens": n, "4-gram repeat rate": v["repeat_rate"],
           "loop onset (decode step)": onset if onset >= 0 else "none",
           "loop period": int(v["loop_period"]) if onset >= 0 else "-",
           "longest repeated span": int(v["longest_repeat"])}
    text = ["Informational. The loop onset is the first decode step from which the stream repeats with one period "
            "(at most 64 tokens, at least 16 tokens and two periods) to its end."]
    cos = df[(df["site"] == SITE.logits.name) & (df["metric"] == "cos") & (df["mode"] == "free") & (df["position"] < 0)]
    call = loop_onset_step(df)
    if call is not None and not cos.empty:
        before, after = cos[cos["step"] < call]["value"], cos[cos["step"] >= call]["value"]
        row["free logits cos, worst before onset"] = before.min() if len(before) else "-"
        row["from onset"] = after.min() if len(after) else "-"
        text.append("Numerics drift that precedes a loop shows as a lower cosine before the onset than after it.")
    return Section("Repetition", text, pd.DataFrame([row]))


PART_MARK = ("⟦", "⟧")  # brackets the token where the decoder's pick parts from the oracle's


def continuation_section(manifest: dict) -> Section | None:
    """The prompt's end and both models' continuations as text (runs with a tokenizer), the parting token marked."""
    t = manifest.get("texts")
    if not t:
        return None
    a, b = PART_MARK
    if t["parted_at"] is None:
        text = [f"The decoder picked the oracle's token at every one of the {len(manifest['picks']['oracle'])} decode "
                "steps."]
        oracle, decoder = t["oracle"], t["decoder"]
    else:
        k = t["parted_at"]
        text = [f"The picks part at decode step {k}: oracle {t['oracle_token']!r}, decoder {t['decoder_token']!r} "
                f"(marked {a} {b}). The stream follows the {manifest.get('stream', 'oracle')}'s tokens, so the "
                "decoder's later picks answer a history it did not choose; its text stops at the parting token."]
        rest = t["oracle"][len(t["agreed_text"]) + len(t["oracle_token"]):]
        oracle = f"{t['agreed_text']}{a}{t['oracle_token']}{b}{rest}"
        decoder = f"{t['agreed_text']}{a}{t['decoder_token']}{b}"
        stream = manifest.get("stream", "oracle")
        if stream != "production":
            whose = f"its first pick already differs; the stream then follows the {stream}" if k == 0 else \
                f"its picks up to decode step {k}; the stream then follows the {stream}, so the rest is not its own"
            blocks = [("end of the prompt", t["prompt_tail"]), ("oracle", oracle), (f"decoder ({whose})", decoder)]
            return Section("Continuations", text, blocks=blocks)
    blocks = [("end of the prompt", t["prompt_tail"]), ("oracle", oracle), ("decoder", decoder)]
    return Section("Continuations", text, blocks=blocks)


def _sort_modes(table: pd.DataFrame) -> pd.DataFrame:
    key = table["mode"].map({m: i for i, m in enumerate(MODES)}).fillna(len(MODES))
    return table.assign(_k=key).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


MEMORY_METRICS = ("allocated_bytes", "reserved_bytes", "cache_bytes", "held_bytes")  # bytes over decode
UNJUDGED_GROWTH = "host_retained_growth"  # malloc's count, the CPU kernels' caches included
CALL_METRICS = ("alloc_calls", "free_calls", "device_mallocs")
CUDA_ONLY = ("retained_growth", "reserved_growth", "new_device_mallocs")  # the CUDA allocator's counters
BYTE_SUFFIXES = ("_bytes", "_growth", "_delta")  # memory metrics counted in bytes (the rest count calls)


def _memory_amount(metric: str, v: float) -> str:
    """Bytes in MiB (0 as '0'), counts as they are."""
    if math.isnan(v) or v == 0 or not metric.endswith(BYTE_SUFFIXES):
        return fmt_value(v)
    return _mib(v)


def _band(rule: Threshold) -> str:
    """'<= 50 MiB' for a byte metric's rule, '<= 0' for a count's or a zero band."""
    if rule.value and rule.metric.endswith(BYTE_SUFFIXES):
        return f"{rule.op} {fmt_num(rule.value / 2**20)} MiB"
    return f"{rule.op} {fmt_value(rule.value)}"


def _memory_rule_row(rule: Threshold, judged: pd.DataFrame) -> dict[str, object]:
    """One judged memory quantity: its band, the values the rule checked, the worst of them (NaN if any is) and
    whether they are all within the band."""
    row = {"quantity": rule.metric, "band": _band(rule), "values checked": len(judged)}
    if judged.empty:
        cuda = " (CUDA only)" if rule.metric in CUDA_ONLY else ""
        return {**row, "worst": "-", "flat": f"not measured{cuda}"}
    values = judged["value"]
    worst_value = math.nan if values.isna().any() else float(values.max() if rule.op == "<=" else values.min())
    return {**row, "worst": _memory_amount(rule.metric, worst_value), "flat": "yes" if judged["passed"].all() else "no"}


def memory_rule_table(judgement: Judgement) -> pd.DataFrame | None:
    """A row per memory quantity a rule judges (the last rule for its metric, unless off), in rule order."""
    last = {r.metric: k for k, r in enumerate(judgement.rules)
            if METRICS.get(r.metric, "").startswith("memory:") and re.fullmatch(r.site_regex, ROW.memory.name)}
    judged = judgement.judged[judgement.judged["site"] == ROW.memory.name]
    rows = [_memory_rule_row(judgement.rules[k], judged[judged["rule_index"] == k]) for k in last.values()
            if judgement.rules[k].op != "off"]
    return pd.DataFrame(rows) if rows else None


def memory_bytes_table(decode: pd.DataFrame) -> pd.DataFrame | None:
    """Informational byte counts over the decode steps: min, max and spread per metric."""
    rows = []
    for metric in (*MEMORY_METRICS, UNJUDGED_GROWTH):
        per_step = decode[decode["metric"] == metric].groupby("step")["value"].max()
        if len(per_step):
            rows.append({"metric": metric, "decode steps": len(per_step), "min": _mib(per_step.min()),
                         "max": _mib(per_step.max()), "max - min": _mib(per_step.max() - per_step.min())})
    return pd.DataFrame(rows) if rows else None


def _flatness_text(table: pd.DataFrame | None) -> str:
    """'Flat: yes (...)' or 'Flat: no: <quantity> reaches <worst> against <band>'; the memory rules' verdict."""
    if table is None:
        return "Flat: not judged (no memory rule applies to this run)."
    measured = table[table["values checked"] > 0]
    if measured.empty:
        return "Flat: not judged (no value of a memory rule's quantity in this run)."
    bad = measured[measured["flat"] == "no"]
    if bad.empty:
        return f"Flat: yes. Every judged quantity is within its band ({', '.join(measured['quantity'])})."
    return "Flat: no. " + "; ".join(f"{r['quantity']} reaches {r['worst']} against {r['band']}"
                                    for _, r in bad.iterrows()) + "."


def memory_section(df: pd.DataFrame, judgement: Judgement) -> Section:
    """Whether memory stays flat as the run's rules judge it (per judged quantity: value and band), then the
    informational byte counts over decode and what the decoder's own calls did to the allocator."""
    decode = df[(df["site"] == ROW.memory.name) & (df["phase"] == "decode")]
    rules = memory_rule_table(judgement)
    if decode.empty and (rules is None or not rules["values checked"].any()):
        return Section("Memory flatness", ["No decode-step memory rows in this run."])
    text = [_flatness_text(rules),
            "Preallocated caches keep memory flat across decode; growth means allocations inside the step. The "
            f"growth quantities sum each decode call after the first {WARMUP_DECODE_CALLS} (the warm-up): held = "
            "tensor bytes reachable from the decoder object; retained / reserved = CUDA bytes the decoder's calls "
            "kept beyond their outputs / reserved; cache = the caches' bytes since the prefill; new device mallocs = "
            "cudaMallocs after the warm-up."]
    calls = decode[decode["metric"].isin(CALL_METRICS)]
    if not calls.empty:
        per_call = calls.groupby("metric")["value"].agg(["min", "max", "mean"])
        text.append("CUDA allocator calls per decode call (min / mean / max): " + "; ".join(
            f"{m} {per_call.loc[m, 'min']:.0f} / {per_call.loc[m, 'mean']:.1f} / {per_call.loc[m, 'max']:.0f}"
            for m in CALL_METRICS if m in per_call.index) + ".")
    tables = []
    info = memory_bytes_table(decode)
    if info is not None:
        tables.append((f"Not judged, over the decode steps: {UNJUDGED_GROWTH} is malloc's count on the CPU, which "
                       "also holds the CPU kernels' caches (oneDNN keeps ~0.5 MiB per new bf16 matmul shape)."
                       + _rss_note(df), info))
    return Section("Memory flatness", text, rules, tables=tables)


def _rss_note(df: pd.DataFrame) -> str:
    """What allocated / reserved bytes mean where the memory probe reads the process's resident set (the CPU)."""
    rss = df[(df["site"] == ROW.memory.name) & (df["metric"] == "memory_is_rss")]["value"]
    if not len(rss) or rss.max() <= 0:
        return ""
    return (" On the CPU, allocated and reserved are the process's resident set (oracle and harness included), not "
            "allocator counters: read their spread as an upper bound. cache_bytes is the production caches' own size.")


CLASS_TEXT = {
    "exact": "exact (no quantization or bf16 rounding: agreement up to float rounding)",
    "bf16": "bf16 (no FP8/FP4 format in any field)",
    "quantized": "quantized (FP8/FP4 formats: the official QAT numerics or a variant)",
}


def threshold_section(judgement: Judgement) -> Section:
    """The rules that judged this run, with how many values each checked; rules that checked none are named."""
    rules, counts = judgement.rules, judgement.rule_counts()
    table = pd.DataFrame({
        "rule": range(1, len(rules) + 1),
        "site regex": [t.site_regex for t in rules],
        "metric": [t.metric for t in rules],
        "modes": [", ".join(t.modes) if t.modes else "all" for t in rules],
        "threshold": [t.text for t in rules],
        "source": [t.source for t in rules],
        "checked": [int(counts.loc[k, "checked"]) if rules[k].op != "off" else "-" for k in range(len(rules))],
        "failed": [int(counts.loc[k, "failed"]) if rules[k].op != "off" else "-" for k in range(len(rules))],
    })
    text = [f"Default rules for the profile class {CLASS_TEXT.get(judgement.profile_class, judgement.profile_class)}, "
            "then the rules of a threshold file. For each site, metric and mode the last matching rule applies; "
            "NaN never passes; 'checked' counts the values a rule judged."]
    unmatched = judgement.unmatched()
    if unmatched:
        names = "; ".join(f"rule {rules.index(t) + 1} ({t.site_regex} {t.metric}, {t.source})" for t in unmatched)
        text.append(f"{len(unmatched)} rule(s) checked nothing in this run (no row of that site, metric and mode, or "
                    f"a later rule takes every such row): {names}.")
    return Section("Thresholds", text, table)


def build_sections(df: pd.DataFrame, manifest: dict, judgement: Judgement,
                   token_margin: float = TOKEN_FLIP_MARGIN) -> list[Section]:
    """All report sections in reading order, plots excluded."""
    return [verdict_section(judgement, manifest), layer_error_section(df), header_section(df, manifest),
            modes_section(df, manifest), residual_section(df), sinkhorn_section(df, judgement),
            indexer_section(df), visible_section(df), anomaly_section(df), token_section(df, token_margin),
            *filter(None, [repetition_section(df, manifest), continuation_section(manifest)]),
            memory_section(df, judgement),
            threshold_section(judgement)]


# ---- rendering -------------------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,sans-serif;color:#222;max-width:1150px;margin:1.5em auto;padding:0 1em}
table{display:block;max-width:100%;overflow-x:auto}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:2px 8px;vertical-align:top}th{background:#f2f2f2;text-align:left}
td.num{text-align:right;font-family:ui-monospace,Menlo,monospace}td.nowrap{white-space:nowrap}
section.pass>p:first-of-type{color:#060;font-weight:bold;font-size:1.15em}
section.fail>p:first-of-type{color:#b00;font-weight:bold;font-size:1.15em}
figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-size:13px;color:#555}
pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:12px}
.blocks{display:flex;gap:1em}.blocks>div{flex:1;min-width:0}.blocks pre{white-space:pre-wrap}
"""


def _caption(path: Path, captions: dict[str, str] | None = None) -> str:
    return (captions or {}).get(path.name) or PLOT_CAPTIONS.get(path.name, path.stem)


def render_markdown(title: str, sections: Sequence[Section], base: Path) -> str:
    """Markdown text; images are linked relative to ``base`` (the run directory)."""
    out = [f"# {md_escape(title)}"]
    for s in sections:
        out += ["", f"## {md_escape(s.title)}"]
        out += [x for line in s.text for x in ("", md_escape(line))]
        if s.table is not None:
            out += ["", md_table(s.table, s.na)]
        for caption, table in s.tables:
            out += ["", md_escape(caption), "", md_table(table, s.na)]
        for caption, block in s.blocks:
            fence = "~~~~" if "~~~" in block else "~~~"
            out += ["", f"{md_escape(caption)}:", "", fence, block, fence]
        for img in s.images:
            rel = img.relative_to(base).as_posix() if img.is_relative_to(base) else img.as_posix()
            out += ["", f"![{md_escape(_caption(img, s.captions))}]({rel.replace(' ', '%20')})"]
    return "\n".join(out) + "\n"


def _img_tag(path: Path, captions: dict[str, str] | None = None) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    cap = html.escape(_caption(path, captions))
    return f'<figure><img alt="{cap}" src="data:image/png;base64,{data}"><figcaption>{cap}</figcaption></figure>'


def render_html(title: str, sections: Sequence[Section]) -> str:
    """A self-contained HTML page: inline CSS, images embedded as base64 PNG, every data string escaped."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for s in sections:
        css = f' class="{html.escape(s.css)}"' if s.css else ""
        body.append(f"<section{css}><h2>{html.escape(s.title)}</h2>")
        body += [f"<p>{html.escape(line)}</p>" for line in s.text]
        tables = [("", s.table)] * (s.table is not None) + list(s.tables)
        for k, (caption, table) in enumerate(tables):
            rendered = html_table(table, s.na, s.links, s.nowrap)
            if k == 0 and s.table is not None and s.collapsed:
                rendered = f"<details><summary>{html.escape(s.collapsed)}</summary>{rendered}</details>"
            body += [f"<p>{html.escape(caption)}</p>"] * bool(caption) + [rendered]
        if s.blocks:
            body.append('<div class="blocks">' + "".join(
                f"<div><p>{html.escape(c)}</p><pre>{html.escape(b)}</pre></div>" for c, b in s.blocks) + "</div>")
        body += [_img_tag(img, s.captions) for img in s.images]
        if s.details:
            body.append(f"<details><summary>{html.escape(s.details_title)}</summary>"
                        f"<pre>{html.escape(s.details)}</pre></details>")
        body.append("</section>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(run_dir: str | Path, df: pd.DataFrame, manifest: dict,
                 judgement: Judgement | Sequence[Threshold] | None = None, plots: Sequence[Path] | None = None,
                 token_margin: float = TOKEN_FLIP_MARGIN, stem: str = "report") -> tuple[Path, Path]:
    """Write ``<stem>.md`` and ``<stem>.html`` (``report``) into ``run_dir`` (each atomically); plots are made under
    ``run_dir/plots`` if None. ``judgement``: the run's judgement, rules to judge with, or None for the rules in
    ``manifest`` (or the defaults of its profile)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not isinstance(judgement, Judgement):
        rules, klass = run_rules(manifest, df)
        judgement = judge(df, rules if judgement is None else judgement, klass, token_margin)
    plots = make_plots(df, run_dir / "plots", judgement.rules) if plots is None else [Path(p) for p in plots]
    sections = build_sections(df, manifest, judgement, token_margin)
    # the plots after the verdict and the per-layer summary, before the Run table
    sections.insert(2, Section("Plots", [] if plots else ["No plot had data."], images=list(plots)))
    run_ids = [str(r) for r in df["run_id"].unique()]
    title = f"dsv4-fidelity report: {', '.join(run_ids) or manifest.get('run_id', run_dir.name)}"
    md_path, html_path = run_dir / f"{stem}.md", run_dir / f"{stem}.html"
    write_text_atomic(md_path, render_markdown(title, sections, run_dir))
    write_text_atomic(html_path, render_html(title, sections))
    return md_path, html_path
