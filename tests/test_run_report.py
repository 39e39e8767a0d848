"""Reports and thresholds on real (small) runs of the tiny checkpoint: the verdict first, the memory section, the
Sinkhorn plot's judged quantities and limits, the metric names a threshold file may use, rules that match nothing,
a re-rendered report equal to the run's, the thresholds table, the checkpoint's identity, defaults that follow a
profile's fields, and per-run implementation records."""

from __future__ import annotations

import html
import json
import math
import re
import shutil

import pytest

import fidelity
from fidelity import cli
from fidelity.decoders import Decoder, ProductionDecoder
from fidelity.decoders.production.profiles import get_profile
from fidelity.harness.judgement import judge, run_rules
from fidelity.harness.runner import RunSpec
from fidelity.harness.thresholds import (
    CORE_GAP,
    CORE_GAP_FP8,
    MEMORY_GROWTH_BAND,
    ThresholdError,
    default_thresholds,
    load_thresholds,
)
from fidelity.harness.thresholds import profile_class as klass
from fidelity.job import run_job
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt
from fidelity.model.sites import Recorder
from fidelity.model.synthesize import synthesize
from fidelity.outputs.report import write_report
from fidelity.outputs.rundir import read_run
from probes.metrics import METRICS, SELF_CONSISTENCY, is_metric


@pytest.fixture(scope="module")
def tiny():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    ckpt.origin["preset"] = "tiny"
    return ckpt


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """200-token prompt (past index_topk * 4, so the indexer selects), 3 decode steps, every mode."""
    spec = RunSpec(prompt=default_prompt(4096, 200), decode_steps=3)
    return run_job(tiny, spec, tmp_path_factory.mktemp("runs"), run_id="small")


def _report(run) -> str:
    return (run.run_dir / "report.md").read_text()


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}")[1].split("\n## ")[0]


def test_memory_section_shows_the_bytes_the_memory_probe_writes(run):
    memory = _section(_report(run), "Memory flatness")
    assert "No decode-step memory rows" not in memory
    for metric in ("allocated_bytes", "reserved_bytes", "cache_bytes", "held_bytes", "host_retained_growth"):
        assert f"| {metric} | 3 |" in memory or f"| {metric} | 1 |" in memory
    assert "process's resident set" in memory  # on the CPU the allocator counters are the RSS
    mib = f"{run.manifest['cache_bytes'] / 2**20:.3f} MiB"
    assert f"| cache_bytes | 3 | {mib} | {mib} | 0.000 MiB |" in memory  # informational: no 'flat' verdict


def _rows(table: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell."""
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in table.splitlines() if ln.startswith("| ")]
    return {r[0]: r[1:] for r in cells[1:]}


def test_the_memory_table_gives_each_judged_quantity_its_value_band_and_the_rules_verdict(run, tmp_path):
    memory = _section(_report(run), "Memory flatness")
    judged = memory.split("Not judged")[0]
    band = f"<= {MEMORY_GROWTH_BAND / 2**20:g} MiB"
    rows = _rows(judged)
    assert rows["held_growth"] == [band, "1", "0", "yes"]  # 3 decode calls, 2 of them the warm-up
    assert rows["cache_growth"] == ["<= 0", "4", "0", "yes"]
    for metric in ("retained_growth", "reserved_growth"):
        assert rows[metric] == [band, "0", "-", "not measured (CUDA only)"]
    assert rows["new_device_mallocs"] == ["<= 0", "0", "-", "not measured (CUDA only)"]
    assert "host_retained_growth" not in rows  # malloc's count is not judged
    assert "Flat: yes. Every judged quantity is within its band (cache_growth, held_growth)." in memory
    df, manifest = read_run(run.run_dir)
    judgement = judge(df, *run_rules(manifest, df))
    verdict = judgement.judged[judgement.judged["site"] == "memory"].groupby("metric")["passed"].all()
    assert {m: r[-1] for m, r in rows.items() if r[1] != "0"} == {m: "yes" if ok else "no" for m, ok in verdict.items()}
    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    th = tmp_path / "th.toml"
    th.write_text(f"[memory]\nheld_growth = \"<={-2**20}\"\n")
    assert cli.main(["report", str(copy), "--thresholds", str(th)]) == 0
    md = (copy / "report-rejudged.md").read_text()
    memory = _section(md, "Memory flatness")
    assert _rows(memory.split("Not judged")[0])["held_growth"] == ["<= -1 MiB", "1", "0", "no"]
    assert "Flat: no. held_growth reaches 0 against <= -1 MiB." in memory
    assert "held_growth" in _section(md, "Verdict").split("first divergence:")[1].splitlines()[0]


@pytest.mark.smoke
def test_the_report_opens_with_the_verdict_and_the_first_divergence(run):
    md = _report(run)
    verdict = "PASS: all " if run.passed else "FAIL: "
    divergence = f"first divergence: {run.first_divergence or 'none'}"
    text = [ln for ln in md.splitlines() if ln and not ln.startswith("#")]
    assert text[0].startswith(verdict) and text[1] == divergence
    assert [ln for ln in md.splitlines() if ln.startswith("## ")][:4] == [
        "## Verdict", "## Per-layer error: local vs inherited", "## Plots", "## Run"]  # the summary first
    body = (run.run_dir / "report.html").read_text().split("<body>")[1]
    paragraphs = re.findall(r"<p>(.*?)</p>", body)
    assert paragraphs[0].startswith(verdict) and paragraphs[1] == html.escape(divergence)
    assert body.index("<h2>Verdict") < body.index("<h2>Per-layer") < body.index("<img") < body.index("<h2>Run")
    run_section = body.split("<h2>Run</h2>")[1].split("</section>")[0]
    assert run_section.index(" fields of this run</summary>") < run_section.index("<table>")  # collapsed
    ids = " ".join(map(str, run.manifest["generated"]))
    assert ids not in md and f"| generated | {len(run.manifest['generated'])} tokens (ids in manifest.json) |" in md


def test_the_sinkhorn_plot_draws_what_the_stored_rules_judge_against_their_limits(run, tmp_path):
    from fidelity.outputs.plots import plot_sinkhorn

    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    th = tmp_path / "th.toml"
    th.write_text("['L\\d+\\.mhc_(attn|ffn)\\.comb']\ncol_dev = \"<=0.05\"\n")
    assert cli.main(["report", str(copy), "--thresholds", str(th)]) == 0
    assert (copy / "plots-rejudged" / "sinkhorn.png").read_bytes() != \
        (run.run_dir / "plots" / "sinkhorn.png").read_bytes()
    df, manifest = read_run(copy)
    excess = next(r["value"] for r in manifest["thresholds"] if r["metric"] == "row_dev_excess")
    fig = plot_sinkhorn(df, run_rules(manifest, df, th)[0])
    assert [ax.get_title() for ax in fig.axes] == [f"row_dev_excess <= {excess:g} (op, layer mode)",
                                                   "col_dev <= 0.05 (op, layer, free mode)"]
    for ax, (metric, modes, limit) in zip(fig.axes, [("row_dev_excess", ("op", "layer"), excess),
                                                     ("col_dev", ("op", "layer", "free"), 0.05)], strict=True):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert set(lines["limit"].get_ydata()) == {limit}
        for family in ("mhc_attn.comb", "mhc_ffn.comb"):
            rows = df[(df["metric"] == metric) & df["site"].str.endswith(family) & df["mode"].isin(modes)]
            assert list(lines[family].get_ydata()) == rows.groupby("layer")["value"].max().tolist(), (metric, family)


def test_every_metric_a_run_writes_is_a_known_metric(run):
    df, _ = read_run(run.run_dir)
    written = set(df["metric"])
    assert {m for m in written if not is_metric(m)} == set()
    assert {"allocated_bytes", "reserved_bytes", "test_nonfinite", "recall"} <= written
    # the list names nothing a run cannot write (derived token flips and indices excepted)
    # kv_storage=fp8 only: rows_mismatch .. rule_rows; the scenarios' logits pairs only: SELF_CONSISTENCY
    cuda_only = {"alloc_calls", "free_calls", "device_mallocs", "new_device_mallocs", "retained_delta",
                 "retained_growth", "reserved_delta", "reserved_growth"}  # the CUDA allocator's counters
    assert set(METRICS) - written <= {"token_flip_with_margin", "max_abs_index", "nonfinite_first", "nonfinite",
                                      "pick_flip_with_margin", "routing_agree", "routing_flips", "test_invisible",
                                      "first_row", "miss_gap", "rows_missing", "rows_extra", "shape_mismatch",
                                      "ambiguous_queries", "ambiguous_tokens", "rows_mismatch", "rule_mismatch",
                                      "other_rule_rows", "rule_rows"} | cuda_only | written | set(SELF_CONSISTENCY)


def test_threshold_files_take_the_memory_probes_names_and_refuse_the_old_ones(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text("[memory]\nreserved_bytes = \"<=1e12\"\nallocated_bytes = \"<=1e12\"\n")
    assert [r.metric for r in load_thresholds(good)] == ["reserved_bytes", "allocated_bytes"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[memory]\nreserved = \"<=1e12\"\n")
    with pytest.raises(ThresholdError, match=r"bad.toml: key 'memory'.reserved: unknown metric; expected one of"):
        load_thresholds(bad)


def test_a_rule_that_checks_nothing_is_named_in_the_report_and_on_the_command_line(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    th = tmp_path / "th.toml"
    th.write_text("['L9\\.attn\\.out']\ncos = \">=0.5\"\n[memory]\nreserved_bytes = \"<=1e15\"\n")
    assert cli.main(["report", str(copy), "--thresholds", str(th)]) == 0
    err = capsys.readouterr().err
    assert "warning: threshold rule 'L9\\\\.attn\\\\.out' cos >= 0.5 (th.toml) checked no value of this run" in err
    assert "reserved_bytes" not in err  # that rule checked the memory rows
    md = (copy / "report-rejudged.md").read_text()
    assert "rule(s) checked nothing in this run" in md and "L9\\\\.attn\\\\.out cos, th.toml" in md


def _report_of(path) -> str:
    return (path / "report.md").read_text()


@pytest.mark.smoke
def test_rerendering_a_run_reproduces_its_report_and_verdict(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    before = _report_of(copy), (copy / "report.html").read_text()
    assert cli.main(["report", str(copy)]) == 0
    out = capsys.readouterr().out
    assert (_report_of(copy), (copy / "report.html").read_text()) == before
    verdict = "verdict: PASS" if run.passed else "verdict: FAIL"
    assert verdict in out and f"first divergence: {run.first_divergence or 'none'}" in out
    checked = json.loads((copy / "manifest.json").read_text())["verdict"]["checked"]
    assert f"all {checked} checked values" in before[0] or f"of {checked} checked values" in before[0]


@pytest.mark.smoke
def test_rejudging_writes_beside_the_run_and_keeps_its_verdict(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    kept = {name: (copy / name).read_bytes() for name in ("report.md", "report.html", "manifest.json")}
    th = tmp_path / "strict.toml"
    th.write_text("['logits']\ncos = \">=0.9999999999\"\n")
    assert cli.main(["report", str(copy), "--thresholds", str(th)]) == 0
    out = capsys.readouterr().out
    assert {name: (copy / name).read_bytes() for name in kept} == kept
    assert "verdict: FAIL" in out and f"report: {copy / 'report-rejudged.md'}" in out
    assert "beside the run's own report" in out
    rejudged = json.loads((copy / "rejudged.json").read_text())
    assert rejudged["verdict"]["passed"] is False and rejudged["rejudged_with"] == str(th)
    assert (copy / "report-rejudged.md").read_text().split("## Verdict")[1].split()[0] == "FAIL:"
    assert (copy / "plots-rejudged").is_dir()


def test_a_rerender_reuses_the_runs_plots(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    (copy / "plots" / "sinkhorn.png").write_bytes(b"kept")  # a re-render that redrew it would overwrite this
    assert cli.main(["report", str(copy)]) == 0
    assert (copy / "plots" / "sinkhorn.png").read_bytes() == b"kept"


def test_a_csa_floor_holds_only_a_quantized_decoder_reporting_no_top_k_and_names_the_configs_csa_layers(run, tiny):
    """The built-in decoder reports its top-k, which layer mode attends: its CSA layers take the layer rules. A
    quantized decoder without a top-k gets the floor, on the config's CSA layers."""
    from fidelity.harness.judgement import rules_for
    from fidelity.harness.thresholds import CSA_LAYER_COS

    def floors(rules):
        return [r for r in rules if "attn\\.(core|out)" in r["site_regex"] and r["modes"] == ["layer"]
                and r["metric"] == "cos" and r["op"] == ">="]

    assert floors(json.loads((run.run_dir / "manifest.json").read_text())["thresholds"]) == []
    residuals = frozenset({"logits", "embed", "L{i}.residual"})
    csa = floors([r.to_dict() | {"modes": list(r.modes)} for r in rules_for("reference", tiny.config, residuals)])
    assert [r["site_regex"] for r in csa] == ["L(2|4)\\.(attn\\.(core|out)|moe\\.out|residual)"]
    assert csa[0]["value"] == CSA_LAYER_COS
    assert floors([r.to_dict() | {"modes": list(r.modes)} for r in rules_for("bf16", tiny.config, residuals)]) == []


def test_the_thresholds_table_shows_modes_class_and_what_each_rule_checked(run):
    table = _section(_report(run), "Thresholds")
    assert "class quantized (FP8/FP4 formats" in table
    assert "| rule | site regex | metric | modes | threshold | source | checked | failed |" in table
    rows = [ln.split(" | ") for ln in table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    by_rule = {(r[2], r[3], r[4]): (r[6], r[7].rstrip(" |")) for r in rows}  # (metric, modes, threshold)
    assert by_rule[("miss_gap", "op", "<= 0.05")] == ("8", "0")  # 2 CSA layers x 4 steps, op mode only
    assert by_rule[("recall", "layer", ">= 0.3125")] == ("8", "0")  # the quantized floor at index_topk 32
    assert by_rule[("routing_gap", "all", "<= 0")][1] == "0"  # the hash layers, every mode
    assert by_rule[("nonfinite_mismatch", "all", "<= 0")][0] != "0"


def test_the_manifest_and_the_report_name_the_checkpoint(run, tiny):
    info = json.loads((run.run_dir / "manifest.json").read_text())["checkpoint"]
    assert info["preset"] == "tiny" and info["seed"] == 0 and info["layout"] == "synthetic"
    assert len(info["hash"]) == 16 and info["hash_scope"] == "every tensor's bytes"
    first = _section(_report(run), "Run").strip().splitlines()[0]
    assert first == f"Tested: production (reference) on preset 'tiny' (synthetic, seed 0), sha256 {info['hash']} " \
                    "(every tensor's bytes)."
    other = synthesize(ModelConfig.preset("tiny"), seed=1)
    spec = RunSpec(prompt=default_prompt(4096, 20), decode_steps=0, modes=("op",))
    from fidelity.harness.runner import Runner
    assert Runner(other, spec).run()[1]["checkpoint"]["hash"] != info["hash"]


def test_defaults_follow_the_profiles_fields_not_its_name(tmp_path):
    my = tmp_path / "my.toml"
    my.write_text('fmha = "fp8"\n')
    core = {p: next(t.value for t in default_thresholds(get_profile(p)) if t.site_regex.endswith("attn\\.core")
                    and t.metric == "calc_diff") for p in (str(my), "fp8-fmha", "reference")}
    assert core == {str(my): CORE_GAP_FP8, "fp8-fmha": CORE_GAP_FP8, "reference": CORE_GAP}
    assert klass(get_profile("bf16:residual=fp32")) == "bf16" and klass(get_profile("bf16")) == "bf16"
    assert klass(get_profile("reference:residual=fp32")) == "quantized" and klass("fp64") == "exact"
    assert klass(get_profile("bf16:indexer_qk=fp4")) == "quantized"


def test_a_profile_file_with_fp8_attention_passes_its_own_run(tiny, tmp_path):
    """Before the defaults followed the fields, this profile got the bf16 attention core's gap and failed."""
    my = tmp_path / "my.toml"
    my.write_text('fmha = "fp8"\n')
    spec = RunSpec(prompt=default_prompt(4096, 140), decode_steps=2, modes=("op",), profile=str(my))
    res = run_job(tiny, spec, tmp_path, run_id="my")
    assert res.passed, str(res.first_divergence)
    assert json.loads((res.run_dir / "manifest.json").read_text())["profile_class"] == "quantized"


def test_the_manifest_lists_only_the_implementations_that_ran_in_this_run(tiny, tmp_path):
    spec = RunSpec(prompt=default_prompt(4096, 40), decode_steps=1, modes=("op",))
    packed = RunSpec(prompt=default_prompt(4096, 40), decode_steps=1, modes=("op",), profile="fp4-indexer-packed")
    first = run_job(tiny, packed, tmp_path, run_id="packed").manifest["implementations"]
    second = run_job(tiny, spec, tmp_path, run_id="plain").manifest["implementations"]
    assert first["index_scores_fp4"] == "cpu" and "index_scores_fp4" not in second
    assert second["sparse_attention"] == "cpu"


def _text_outside(fig) -> list[str]:
    """What reaches outside the figure once drawn: an axes with its title, labels and tick labels, or a legend."""
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    parts = [(ax.get_title() or ax.get_ylabel(), ax.get_tightbbox(renderer)) for ax in fig.axes]
    parts += [("legend", leg.get_window_extent(renderer)) for leg in fig.legends]
    return [name for name, b in parts
            if b.x0 < box.x0 - 1 or b.y0 < box.y0 - 1 or b.x1 > box.x1 + 1 or b.y1 > box.y1 + 1]


def test_run_plots_keep_their_text_inside_and_say_which_mode_they_show(run):
    import warnings

    from fidelity.outputs.plots import PLOTS

    df, manifest = read_run(run.run_dir)
    rules = run_rules(manifest, df)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. constrained_layout giving up
        figures = {name: build(df, rules) for name, build in PLOTS.items()}
        for name, fig in figures.items():
            assert _text_outside(fig) == [], name
    assert all(fig.legends for name, fig in figures.items() if name != "heatmap_1mcos.png")  # outside the axes
    assert not any(ax.get_legend() for fig in figures.values() for ax in fig.axes)  # none over the data
    assert "(free mode rows)" in figures["residual_norms.png"].axes[0].get_title()
    assert [ax.get_title().endswith(" mode)") for ax in figures["sinkhorn.png"].axes] == [True, True]
    lines = {ln.get_label(): ln for ln in figures["sinkhorn.png"].axes[1].get_lines()}
    attn, ffn = lines["mhc_attn.comb"], lines["mhc_ffn.comb"]
    assert (attn.get_linestyle(), attn.get_marker()) != (ffn.get_linestyle(), ffn.get_marker())


def test_the_comparison_plot_labels_runs_by_what_differs_and_keeps_its_text_inside(run, tiny, tmp_path):
    from fidelity.outputs.compare import comparison_figure, family_table, short_labels

    spec = RunSpec(prompt=default_prompt(4096, 200), decode_steps=3, profile="reference:kv_storage=fp8")
    other = run_job(tiny, spec, tmp_path, run_id="fp8kv")
    loaded = [read_run(run.run_dir), read_run(other.run_dir)]
    assert short_labels(loaded) == ["reference", "reference:kv_storage=fp8"]
    same_name = [(df, {**m, "profile": {**m["profile"], "name": "mine"}}) for df, m in loaded]
    assert short_labels(same_name) == ["kv_storage=bf16", "kv_storage=fp8"]
    fig = comparison_figure({label: family_table(df[df["mode"] == "free"]) for label, (df, _) in
                             zip(short_labels(loaded), loaded, strict=True)}, "free")
    assert _text_outside(fig) == [] and [t.get_text() for t in fig.legends[0].get_texts()] == short_labels(loaded)



def _residual_tables(section: str) -> dict[str, dict[str, dict[str, str]]]:
    """The residual section's tables by mode: {mode: {layer: {column: cell}}}."""
    out, mode = {}, None
    for block in section.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.startswith("| ")]
        if lines and mode is not None:
            head = [c.strip() for c in lines[0].strip("|").split(" | ")]
            out[mode] = {layer: dict(zip(head[1:], cells, strict=True)) for layer, cells in _rows(block).items()}
        elif " mode: " in block and not block.startswith("Oracle"):
            mode = block.strip().split(" mode: ")[0]
    return out


RESIDUAL_COLUMNS = ["oracle prefill", "decoder prefill", "ratio prefill", "oracle decode first", "oracle decode last",
                    "oracle decode max", "decoder decode max", "ratio decode"]


def test_the_residual_section_sets_the_oracles_rms_beside_the_decoders_per_layer(run, tiny):
    """Both models' RMS of L{i}.residual per layer, in every mode that compares the streams (op mode feeds the
    decoder's); the oracle's equals the RMS of the oracle's own record of the prefill and of the first decode
    step."""
    from oracles import OracleModel

    tables = _residual_tables(_section(_report(run), "Residual stream RMS"))
    layers = [f"L{i}" for i in range(tiny.config.n_layers)]
    assert list(tables) == ["free", "layer"]
    for table in tables.values():
        assert list(table) == layers and all(list(row) == RESIDUAL_COLUMNS for row in table.values())
        values = [float(v) for row in table.values() for v in row.values()]
        assert all(math.isfinite(v) and v > 0 for v in values)
    rec = Recorder([r"L\d+\.residual"])
    session = OracleModel(tiny).session(rec)
    session.prefill(default_prompt(4096, 200))
    session.step(run.manifest["generated"][0])
    df, _ = read_run(run.run_dir)
    ref = df[(df["metric"] == "ref_rms") & (df["mode"] == "free")].set_index(["site", "step"])["value"]
    for site in ("L0.residual", "L5.residual"):
        for step, x in rec.records[site]:
            rms = x.double().square().mean().sqrt().item()
            assert ref[(site, step)] == pytest.approx(rms, rel=1e-9), (site, step)
        prefill = rec.records[site][0][1].double().square().mean().sqrt().item()
        assert float(tables["free"][site.split(".")[0]]["oracle prefill"]) == pytest.approx(prefill, rel=1e-5)
    decoder = df[(df["metric"] == "rms") & (df["mode"] == "free") & (df["site"] == "L5.residual")]
    last = decoder.loc[decoder["step"].idxmax()]
    assert float(tables["free"]["L5"]["ratio decode"]) > 0 and last["value"] > 0


class _SomeSites(Decoder):
    """The production decoder reporting only the sites matching ``patterns`` (of ``templates``)."""

    def __init__(self, ckpt, templates: frozenset[str], patterns: list[str]):
        self.inner = ProductionDecoder(ckpt, max_context=64)
        self.label, self.config, self.profile = "production, some sites", ckpt.config, self.inner.profile
        self.templates, self.patterns = templates, patterns

    @property
    def pos(self) -> int:
        return self.inner.pos

    def _call(self, fn, arg):
        own = Recorder(self.patterns, device=None)
        self.inner.rec = own
        out = fn(arg)
        for site, records in own.records.items():
            self.rec.records.setdefault(site, []).extend(records)
        return out

    def prefill(self, ids):
        return self._call(self.inner.prefill, ids)

    def step(self, token):
        return self._call(self.inner.step, token)

    def sites(self):
        return self.templates

    def reset(self):
        self.inner.reset()


@pytest.mark.parametrize(("templates", "patterns", "expected"), [
    ({"logits"}, ["logits"], "No L{i}.residual rows in this run: the decoder reports no residual streams."),
    ({"logits", "embed", "L{i}.residual"}, [r"logits|embed|L\d+\.residual"], "Oracle residual RMS (layer mode): "),
])
def test_the_residual_section_of_a_decoder_reporting_some_sites_says_what_it_lacks(tiny, tmp_path, templates,
                                                                                   patterns, expected):
    dec = _SomeSites(tiny, frozenset(templates), patterns)
    res = fidelity.run(dec, tiny, prompt=40, decode_steps=1, out=tmp_path, run_id="some")
    section = _section(_report(res), "Residual stream RMS")
    assert expected in section
    assert list(_residual_tables(section)) == ([] if templates == {"logits"} else ["free", "layer"])


def test_the_residual_section_of_a_run_recorded_before_the_oracles_rms_names_what_is_missing(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run.run_dir, copy)
    df, manifest = read_run(copy)
    old = df[~df["metric"].isin(["rms", "ref_rms", "ref_rms_max"]) & ~df["metric"].str.startswith("ref_rms_stream")]
    write_report(copy, old.reset_index(drop=True), manifest, plots=[])
    section = _section(_report_of(copy), "Residual stream RMS")
    assert "holds no RMS of the oracle's (ref_rms) or the decoder's (rms) at L{i}.residual" in section
    assert _residual_tables(section) == {}


class RaisesAtDecodeStep3(ProductionDecoder):
    """A port whose third decode step fails (say an index past a table at that length)."""

    def step(self, token: int):
        if self.pos == self.prompt_len + 2:
            raise IndexError("index 4096 is out of bounds for dimension 0 with size 4096\n(traceback lines)")
        return super().step(token)


def test_a_decoder_that_raises_ends_its_run_judged_up_to_that_call_with_a_report(tiny, tmp_path, capsys):
    """The run directory is written: the calls before the failing one keep their rows, the failing call's
    ``decoder`` / ``raised`` row is the first divergence, the manifest, report and command line say what it
    raised and after which site (it stopped with a traceback and no report before)."""
    dec = RaisesAtDecodeStep3(tiny, "reference", 4096, "cpu")
    res = fidelity.run(dec, tiny, 40, 6, ("free", "op"), tmp_path, run_id="r")
    raised = res.manifest["decoder_raised"]
    assert raised["step"] == 3 and raised["phase"] == "decode" and raised["after_site"] is None  # before any site
    assert raised["error"] == "IndexError: index 4096 is out of bounds for dimension 0 with size 4096"
    assert res.manifest["stop_reason"] == "decoder raised" and res.manifest["decode_steps"] == 3
    assert not res.passed and res.first_divergence.site == "decoder" and res.first_divergence.step == 3
    df, _ = read_run(res.run_dir)
    assert set(df[df["site"] != "decoder"]["step"]) == {0, 1, 2}  # the calls before it, in every mode
    md = (res.run_dir / "report.md").read_text()
    assert "The decoder raised IndexError: index 4096 is out of bounds" in md and "in call 3 (decode)" in md

    cli._print_run(res, "tiny", 1.0, 1)
    printed = capsys.readouterr().out
    assert "(decoder raised)" in printed and "verdict: FAIL" in printed
    assert "the decoder raised IndexError: index 4096 is out of bounds for dimension 0 with size 4096 in call 3 " \
           "(decode), before recording any site; the run ends there" in printed
