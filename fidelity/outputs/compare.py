"""Runs side by side (profiles, versions, checkpoints): one row per run (verdict, logits cosine, indexer recall,
token agreement, repetition onset, memory), worst cos / calc_diff per layer and site family in one table,
1 - cos per layer in one plot, each run under a short label (its profile name, or the profile fields that
differ between the runs). ``fidelity compare A B ...`` writes ``compare.md`` and the plot to a folder of its own.

Scenario report directories (``fidelity scenarios``: a folder holding matrix.csv) compare with each other instead:
each run's verdict, first divergence, worst local cos and self-consistency, each self-consistency pair's passed,
cos_min and rel_l2, one column per report, the runs and pairs whose verdict changed, and 1 - worst local cos per
run in one plot (``compare_scenarios``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fidelity.atomic_write import check_new_dir, write_dir_atomic
from fidelity.harness.thresholds import LAYER_SITE_ORDER, MODES, profile_fields, profile_label, site_order_key
from fidelity.model.sites import ROW, SITE
from fidelity.outputs.plots import DPI, FLOOR
from fidelity.outputs.report import decode_path, md_escape, md_table, worst
from fidelity.outputs.rundir import MANIFEST_FILE, METRICS_FILE, check_metrics, read_run

RunLike = str | Path | tuple[pd.DataFrame, dict]
PLOT_NAME, TABLE_NAME = "compare_1mcos.png", "compare.md"
MATRIX_FILE, PAIRS_FILE = "matrix.csv", "pairs.csv"  # what makes a folder a scenario report (fidelity scenarios)
SCENARIO_PLOT, RUNS_CSV, PAIRS_CSV = "compare_worst_local_cos.png", "compare_runs.csv", "compare_pairs.csv"
RUN_KEY, PAIR_KEY = ["scenario", "run"], ["scenario", "pair", "b", "a"]
RUN_COLUMNS = ["verdict", "worst_local_cos", "self_consistency", "first_divergence"]
PAIR_COLUMNS = ["passed", "cos_min", "rel_l2"]


class CompareError(ValueError):
    """Runs that cannot be compared (fewer than two, no common mode, no similarity rows, scenario reports mixed
    with run directories, a folder that is neither)."""


def _load(run: RunLike) -> tuple[pd.DataFrame, dict]:
    if isinstance(run, tuple):
        return check_metrics(run[0]), run[1]
    return read_run(run)


def _run_id(df: pd.DataFrame, manifest: dict) -> str:
    return str(manifest.get("run_id") or ", ".join(map(str, df["run_id"].unique())))


def short_labels(runs: Sequence[tuple[pd.DataFrame, dict]]) -> list[str]:
    """One label per run: the profile names when they differ, else the profile fields that differ between the
    runs; labels still repeated get the run id added (and a position for the same run given twice)."""
    profiles = [m.get("profile") or ", ".join(map(str, df["profile"].unique())) for df, m in runs]
    labels = [profile_label(p) for p in profiles]
    if len(set(labels)) < len(labels):
        fields = [profile_fields(p) or {} for p in profiles]
        keys = sorted({k for f in fields for k in f if len({g.get(k) for g in fields}) > 1})
        if keys:
            labels = [", ".join(f"{k}={f.get(k)}" for k in keys) for f in fields]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({_run_id(df, m)})" for label, (df, m) in zip(labels, runs, strict=True)]
    if len(set(labels)) < len(labels):  # the same run twice
        labels = [f"{label} [{k + 1}]" for k, label in enumerate(labels)]
    return labels


def _common_mode(frames: Sequence[pd.DataFrame]) -> str:
    common = set.intersection(*(set(f["mode"]) for f in frames))
    for mode in reversed(MODES):  # free first: end-to-end effect of the profile
        if mode in common:
            return mode
    raise CompareError("no mode common to every run: " + "; ".join(str(sorted(set(f["mode"]))) for f in frames))


def family_table(df: pd.DataFrame) -> pd.DataFrame:
    """Worst cos (min) and calc_diff (max) per (layer, family); family = the site part after ``L{i}.`` up to '.'."""
    sub = df[df["metric"].isin(["cos", "calc_diff"])]
    layer_part = sub["site"].str.extract(r"^L\d+\.([^.]+)")[0]
    sub = sub.assign(family=layer_part.fillna(sub["site"]), layer=sub["layer"].where(layer_part.notna(), -1))
    keys = ["layer", "family"]
    cols = {name: worst(sub[sub["metric"] == name], keys, how)
            for name, how in (("cos", "min"), ("calc_diff", "max")) if (sub["metric"] == name).any()}
    if not cols:
        return pd.DataFrame(columns=["cos", "calc_diff"], index=pd.MultiIndex.from_tuples([], names=keys))
    return pd.DataFrame(cols)


def _family_key(layer: int, family: str) -> tuple:
    """Data-flow position of a (layer, family) row: the first site of the family in ``LAYER_SITE_ORDER``."""
    if layer < 0:
        return site_order_key(family)
    first = next((s for s in LAYER_SITE_ORDER if s == family or s.startswith(family + ".")), family)
    return site_order_key(f"L{layer}.{first}")


def _side_by_side(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    parts = [t.rename(columns=lambda c, k=label: f"{c} {k}") for label, t in tables.items()]
    both = pd.concat(parts, axis=1, join="outer")
    both = both.reindex(sorted(both.index, key=lambda k: _family_key(int(k[0]), str(k[1]))))
    order = [f"{m} {label}" for m in ("cos", "calc_diff") for label in tables]
    both = both[[c for c in order if c in both.columns]].reset_index()
    both["layer"] = both["layer"].map(lambda v: "-" if v < 0 else f"L{int(v)}")
    return both


def _value(df: pd.DataFrame, site: str, metric: str, how: str, mode: str | None = None) -> object:
    rows = df[(df["site"].str.fullmatch(site)) & (df["metric"] == metric)]
    if mode is not None:
        rows = rows[rows["mode"] == mode]
    rows = rows[rows["value"].notna()]
    return getattr(rows["value"], how)() if len(rows) else "-"


def summary_row(label: str, df: pd.DataFrame, manifest: dict) -> dict:
    """One run in one row: verdict, worst logits cos (free mode), indexer recall (layer mode), token agreement,
    how it decoded, repetition of the stream, peak memory and cache growth."""
    verdict = manifest.get("verdict", {})
    tokens = df[(df["site"] == ROW.tokens.name) & (df["metric"] == "agree") & (df["mode"] == "free")]
    loop = _value(df, ROW.repetition.regex, "loop_onset", "max")
    peaks = manifest.get("memory_peaks", {}).get("decode", {})
    peak = peaks.get("gpu_reserved_peak_bytes", peaks.get("host_rss_peak_bytes"))
    return {
        "run": label, "verdict": ("PASS" if verdict.get("passed") else "FAIL") if verdict else "-",
        "free logits cos min": _value(df, SITE.logits.regex, "cos", "min", "free"),
        "layer recall min": _value(df, SITE.indexer_topk.regex, "recall", "min", "layer"),
        "layer recall mean": _value(df, SITE.indexer_topk.regex, "recall", "mean", "layer"),
        "token agreement": float((tokens["value"] != 0).mean()) if len(tokens) else "-",
        "decode steps": manifest.get("decode_steps", "-"),
        "decode": decode_path(manifest),
        "4-gram repeat rate": _value(df, ROW.repetition.regex, "repeat_rate", "max"),
        "loop onset": ("none" if loop < 0 else int(loop)) if loop != "-" else "-",
        "peak memory (decode)": f"{peak / 2**20:.0f} MiB" if peak else "-",
        "cache growth": _value(df, ROW.memory.regex, "cache_growth", "max"),
    }


def comparison_figure(tables: dict[str, pd.DataFrame], mode: str) -> Figure:
    """1 - cos per layer (worst site, step, position), one line per run label, legend outside the axes."""
    fig = Figure(figsize=(7.5, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    markers = "osD^v<>ph*"
    drawn = 0
    for k, (label, table) in enumerate(tables.items()):
        per_layer = table.reset_index()
        per_layer = per_layer[per_layer["layer"] >= 0].dropna(subset=["cos"]) if "cos" in per_layer else per_layer[:0]
        if per_layer.empty:
            continue
        err = (1 - per_layer.groupby("layer")["cos"].min()).clip(lower=FLOOR)
        ax.plot(err.index, err.to_numpy(), marker=markers[k % len(markers)], ms=4, lw=1.2, label=label)
        drawn += 1
    if not drawn:
        raise CompareError(f"no run has per-layer cos rows in {mode} mode")
    ax.set(yscale="log", xlabel="layer", ylabel="1 - cos (worst site, step, position)",
           title=f"{mode} mode: worst 1 - cos per layer")
    fig.legend(loc="outside right upper", fontsize=8, title="run", title_fontsize=8)
    return fig


def _steps_note(runs: Sequence[tuple[pd.DataFrame, dict]], labels: Sequence[str]) -> str:
    """A warning when the runs decoded different numbers of steps ('' when they agree)."""
    steps = [int(df["step"].max()) if len(df) else 0 for df, _ in runs]
    if len(set(steps)) == 1:
        return ""
    per_run = ", ".join(f"{label}: {n}" for label, n in zip(labels, steps, strict=True))
    return (f"The runs decoded different numbers of steps ({per_run}); worst values over steps compare different "
            "spans of decoding.")


def default_out(runs: Sequence[RunLike]) -> Path:
    """``<parent of the first run>/compare-<id A>-vs-<id B>[...]``."""
    paths = [Path(r) for r in runs if not isinstance(r, tuple)]
    parent = paths[0].parent if paths else Path("runs")
    names = [p.name for p in paths] or ["runs"]
    stem = "-vs-".join(names[:3]) + (f"-and-{len(names) - 3}-more" if len(names) > 3 else "")
    return parent / f"compare-{stem}"


def kind(run: RunLike) -> str:
    """'scenarios' for a scenario report directory (it holds matrix.csv), 'run' for a run directory or a
    ``(df, manifest)`` pair; a path that is neither raises CompareError naming what it holds."""
    if isinstance(run, tuple):
        return "run"
    path, expected = Path(run), (f"a run directory ({METRICS_FILE}, {MANIFEST_FILE}) or a scenario report "
                                 f"directory ({MATRIX_FILE})")
    if not path.is_dir():
        raise CompareError(f"{path}: not a folder; expected {expected}")
    if (path / MATRIX_FILE).is_file():
        return "scenarios"
    if (path / METRICS_FILE).is_file():
        return "run"
    raise CompareError(f"{path}: expected {expected}, found {sorted(p.name for p in path.iterdir())}")


def _check_kinds(runs: Sequence[RunLike]) -> str:
    """The one kind of every run ('scenarios' or 'run'); a mix raises CompareError naming which is which."""
    kinds = [kind(r) for r in runs]
    if len(set(kinds)) == 1:
        return kinds[0]
    names = {k: ", ".join("(a metrics table)" if isinstance(r, tuple) else str(r)
                          for r, rk in zip(runs, kinds, strict=True) if rk == k) for k in ("scenarios", "run")}
    raise CompareError(f"compare: cannot mix scenario report directories ({names['scenarios']}) with run "
                       f"directories ({names['run']}); compare reports with reports, or runs with runs (a report's "
                       "runs are in its runs/ folder)")


def compare_runs(runs: Sequence[RunLike], out_dir: str | Path | None = None, mode: str | None = None,
                 overwrite: bool = False) -> tuple[str, Path]:
    """Markdown (caption + table) and the plot for two or more runs, written to ``out_dir`` (default
    ``default_out``) as compare.md and compare_1mcos.png. Runs are run directories or ``(df, manifest)``
    pairs. ``mode=None`` picks the first mode every run has of free, layer, op. Two or more scenario report
    directories go to ``compare_scenarios`` instead."""
    if len(runs) < 2:
        raise CompareError(f"compare: expected at least two runs or two scenario reports, found {len(runs)}")
    if _check_kinds(runs) == "scenarios":
        if mode is not None:
            raise CompareError(f"compare: mode {mode!r} applies to run directories, not scenario reports")
        return compare_scenarios([Path(r) for r in runs], out_dir, overwrite)
    out_dir = check_new_dir(out_dir or default_out(runs), overwrite, "--out")
    loaded = [_load(r) for r in runs]
    labels = short_labels(loaded)
    mode = mode or _common_mode([df for df, _ in loaded])
    tables = {label: family_table(df[df["mode"] == mode]) for label, (df, _) in zip(labels, loaded, strict=True)}
    if all(t.empty for t in tables.values()):
        raise CompareError(f"no run has cos / calc_diff rows in {mode} mode")
    key = "; ".join(f"{label} = {_run_id(df, m)}" for label, (df, m) in zip(labels, loaded, strict=True))
    caption = [md_escape(f"{mode} mode; worst over steps and positions. Runs: {key}.")]
    if note := _steps_note(loaded, labels):
        caption.append(md_escape(note))
    summary = pd.DataFrame([summary_row(label, df, m) for label, (df, m) in zip(labels, loaded, strict=True)])
    summary = summary.loc[:, (summary != "-").any()]  # columns no run has
    text = (f"{md_table(summary)}\n\n" + "\n\n".join(caption) + f"\n\n{md_table(_side_by_side(tables))}\n")

    def fill(tmp: Path) -> None:
        comparison_figure(tables, mode).savefig(tmp / PLOT_NAME, dpi=DPI)
        (tmp / TABLE_NAME).write_text(f"# dsv4-fidelity comparison\n\n{text}", encoding="utf-8")

    write_dir_atomic(out_dir, fill, overwrite)
    return text, out_dir / PLOT_NAME


# ---- scenario report directories ----------------------------------------------------------------------------------

def read_scenarios(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(matrix, pairs) of a scenario report directory; errors name the file and what it lacks."""
    frames = []
    for name, needed in ((MATRIX_FILE, RUN_KEY + RUN_COLUMNS), (PAIRS_FILE, PAIR_KEY + PAIR_COLUMNS)):
        try:
            df = pd.read_csv(path / name, keep_default_na=False, na_values=["nan", "NaN", ""])
        except FileNotFoundError:
            raise CompareError(f"{path}: missing {name}; a scenario report holds {MATRIX_FILE} and {PAIRS_FILE}, "
                               f"found {sorted(p.name for p in path.iterdir())}") from None
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as err:
            raise CompareError(f"{path / name}: cannot read: {err}") from None
        if missing := [c for c in needed if c not in df.columns]:
            raise CompareError(f"{path / name}: missing columns {missing}; expected {needed}, found {list(df.columns)}")
        key = needed[: len(RUN_KEY) if name == MATRIX_FILE else len(PAIR_KEY)]
        if df.duplicated(key).any():
            raise CompareError(f"{path / name}: rows repeat the key {key}")
        frames.append(df)
    return frames[0], frames[1]


def scenario_labels(paths: Sequence[Path], matrices: Sequence[pd.DataFrame]) -> list[str]:
    """One label per report: the profile names (from its first run's manifest) when they differ, else the
    decoders, else the folder names (with a position for the same folder given twice)."""
    manifests = []
    for path, matrix in zip(paths, matrices, strict=True):
        first = path / str(matrix["run_dir"].iloc[0]) / MANIFEST_FILE if "run_dir" in matrix and len(matrix) else None
        try:
            manifests.append(json.loads(first.read_text(encoding="utf-8")) if first else {})
        except (OSError, json.JSONDecodeError):
            manifests.append({})
    for labels in ([profile_label(m["profile"]) if m.get("profile") else "?" for m in manifests],
                   [str(m.get("decoder", "?")) for m in manifests], [p.name for p in paths]):
        if "?" not in labels and len(set(labels)) == len(labels):
            return labels
    return [f"{p.name} [{k + 1}]" for k, p in enumerate(paths)]


def _short(divergence: object) -> str:
    """A first divergence without its hint and its consequences: 'step 0 (prefill), L1.attn.q cos ... (op mode)'."""
    return str(divergence).split(": ")[0].split("; ")[0]


def scenario_table(frames: dict[str, pd.DataFrame], key: list[str], columns: list[str]) -> pd.DataFrame:
    """One row per key any report has (in the first report's order, then the others'), ``columns`` of each report
    side by side ('<column> <label>'; '-' where a report lacks the row), and ``only in`` naming the reports that
    have a row when not all do."""
    order = list(dict.fromkeys(k for f in frames.values() for k in f[key].itertuples(index=False, name=None)))
    index = pd.MultiIndex.from_tuples(order, names=key) if order else pd.MultiIndex.from_arrays([[]] * len(key),
                                                                                                 names=key)
    sides = {label: f.set_index(key)[columns].reindex(index) for label, f in frames.items()}
    have = {label: index.isin(f.set_index(key).index) for label, f in frames.items()}
    out = pd.DataFrame(index=index)
    for column in columns:
        for label, side in sides.items():
            out[f"{column} {label}"] = side[column].astype(object).where(have[label], "-")
    present = pd.DataFrame(have, index=index)
    out["only in"] = [", ".join(present.columns[row]) if not row.all() else "" for row in present.to_numpy()]
    return out.reset_index()


def _row_name(row: pd.Series, key: list[str]) -> str:
    """'scenario/run' of a runs row, 'scenario/pair b vs a' of a pairs row."""
    name = f"{row[key[0]]}/{row[key[1]]}"
    return f"{name} {row['b']} vs {row['a']}" if key == PAIR_KEY else name


def _changes(table: pd.DataFrame, key: list[str], column: str, labels: Sequence[str]) -> list[str]:
    """'scenario/run (A PASS, B FAIL)' for every row whose ``column`` differs between the reports that have it."""
    out = []
    for _, row in table.iterrows():
        values = {label: row[f"{column} {label}"] for label in labels if str(row[f"{column} {label}"]) != "-"}
        if len({str(v) for v in values.values()}) > 1:
            shown = ", ".join(f"{label} {('PASS' if v else 'FAIL') if isinstance(v, bool | np.bool_) else v}"
                              for label, v in values.items())
            out.append(f"{_row_name(row, key)} ({shown})")
    return out


def _only(table: pd.DataFrame, key: list[str]) -> list[str]:
    """'scenario/run (only in A)' for every row that some reports lack."""
    return [f"{_row_name(row, key)} (only in {row['only in']})" for _, row in table.iterrows() if row["only in"]]


def _without_empty_only(table: pd.DataFrame) -> pd.DataFrame:
    return table if table["only in"].any() else table.drop(columns="only in")


def scenario_figure(runs: pd.DataFrame, labels: Sequence[str]) -> Figure:
    """1 - worst local cos per run (x: scenario/run), a marker per report; a failing run has a red x."""
    fig = Figure(figsize=(max(7.5, 3 + 0.22 * len(runs)), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    x = range(len(runs))
    drawn = 0
    for k, label in enumerate(labels):
        cos = pd.to_numeric(runs[f"worst_local_cos {label}"].where(runs[f"verdict {label}"] != "-"), errors="coerce")
        y = (1 - cos).clip(lower=FLOOR)
        ax.scatter(x, y, marker="osD^v<>ph*"[k % 10], s=22, label=label, alpha=0.8)
        bad = (runs[f"verdict {label}"] == "FAIL").to_numpy()
        ax.scatter([i for i, b in zip(x, bad, strict=True) if b], y[bad], marker="x", color="red", s=60)
        drawn += int(y.notna().sum())
    if drawn:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no run has layer or op mode rows", ha="center", transform=ax.transAxes)
    ax.set_xticks(list(x), [f"{s}/{r}" for s, r in zip(runs["scenario"], runs["run"], strict=True)], rotation=90,
                  fontsize=7)
    ax.set(ylabel="1 - worst local cos (layer/op)", title="worst local cos per run (red x: fails against the oracle)")
    fig.legend(loc="outside right upper", fontsize=8, title="report", title_fontsize=8)
    return fig


def compare_scenarios(paths: Sequence[Path], out_dir: str | Path | None = None,
                      overwrite: bool = False) -> tuple[str, Path]:
    """Two or more scenario report directories side by side, written to ``out_dir`` (default ``default_out``):
    compare.md (per report its runs and pairs passing; per run each report's verdict, worst local cos,
    self-consistency and first divergence; per pair its passed, cos_min, rel_l2; what changed verdict, what only
    some reports have), compare_runs.csv and compare_pairs.csv (the same tables, first divergences in full) and
    compare_worst_local_cos.png. Returns (the markdown, the plot's path)."""
    if len(paths) < 2:
        raise CompareError(f"compare: expected at least two scenario reports, found {len(paths)}")
    out_dir = check_new_dir(out_dir or default_out(paths), overwrite, "--out")
    loaded = [read_scenarios(p) for p in paths]
    labels = scenario_labels(paths, [m for m, _ in loaded])
    runs = scenario_table({lb: m for lb, (m, _) in zip(labels, loaded, strict=True)}, RUN_KEY, RUN_COLUMNS)
    pairs = scenario_table({lb: p for lb, (_, p) in zip(labels, loaded, strict=True)}, PAIR_KEY, PAIR_COLUMNS)
    summary = pd.DataFrame([{"report": lb, "folder": str(p), "runs": len(m), "runs passing": int((m["verdict"] ==
                             "PASS").sum()), "pairs": len(pr), "pairs passing": int(pr["passed"].astype(bool).sum())}
                            for lb, p, (m, pr) in zip(labels, paths, loaded, strict=True)])
    changed = _changes(runs, RUN_KEY, "verdict", labels) + _changes(pairs, PAIR_KEY, "passed", labels)
    only = _only(runs, RUN_KEY) + _only(pairs, PAIR_KEY)
    shown = runs.copy()
    for label in labels:
        shown[f"first_divergence {label}"] = shown[f"first_divergence {label}"].map(_short)
    lines = [md_table(summary), md_escape("Changed verdict: " + ("; ".join(changed) or "none") + "."),
             md_escape("In some reports only: " + ("; ".join(only) or "none") + "."),
             f"## Runs\n\n{md_table(_without_empty_only(shown))}",
             f"## Self-consistency pairs\n\n{md_table(_without_empty_only(pairs))}"]
    text = "\n\n".join(lines) + "\n"

    def fill(tmp: Path) -> None:
        scenario_figure(runs, labels).savefig(tmp / SCENARIO_PLOT, dpi=DPI)
        runs.to_csv(tmp / RUNS_CSV, index=False)
        pairs.to_csv(tmp / PAIRS_CSV, index=False)
        (tmp / TABLE_NAME).write_text(f"# dsv4-fidelity scenario comparison\n\n{text}", encoding="utf-8")

    write_dir_atomic(out_dir, fill, overwrite)
    return text, out_dir / SCENARIO_PLOT
