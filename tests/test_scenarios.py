"""Scenarios (fidelity/studies/): the catalogue covers the residues and edges it claims, a scenario passes on
the clean production decoder against the oracle and against itself, planted chunk-boundary bugs are caught by
self-consistency alone, and the CLI writes one combined report (a bad name: one line, exit 2)."""

import pandas as pd
import pytest
import torch

from fidelity.api import open_decoder, plan_checkpoint
from fidelity.cli import main
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.outputs import scenarios_report
from fidelity.outputs.report import md_escape
from fidelity.studies import catalogue
from fidelity.studies.catalogue import CATALOGUE, Pair, Run, Scenario
from fidelity.studies.scenarios import run_scenarios, self_consistency

SMALL = Scenario("small", "a whole prompt, a chunked one (128-aligned and not), a prefix", (
    Run("whole", 136, 2, param=("chunk", 136)),
    Run("chunks 5,6,7,118", 136, 2, (5, 6, 7, 118), ("chunk", 5)),
    Run("chunks 128,8", 136, 2, (128, 8), ("chunk", 128)),
    Run("prompt 128", 128, 2, param=("prompt_len", 128)),
), (Pair("chunked==whole", "whole", "chunks 5,6,7,118"), Pair("chunked==whole", "whole", "chunks 128,8"),
    Pair("prefix", "whole", "prompt 128"), Pair("decode==prefill", "whole", "prompt 128")))


@pytest.fixture(scope="module")
def plan():
    p = plan_checkpoint(None)
    p.open()
    return p


def test_catalogue_covers_every_residue_and_the_edges():
    assert set(CATALOGUE) == {"lengths", "chunks", "decode-boundaries", "long-decode", "batch", "prefix", "verify"}
    lengths = {r.prompt_len for r in CATALOGUE["lengths"].runs}
    assert {n % 4 for n in lengths} == {0, 1, 2, 3}
    assert {127, 128, 129, 255, 256, 257} <= lengths
    chunked = [r for r in CATALOGUE["chunks"].runs if r.chunks]
    starts = {b for r in chunked for b in r.boundaries()}
    assert {b % 4 for b in starts} == {0, 1, 2, 3}
    assert any(b % 128 and b % 4 == 0 for b in starts) and any(b % 128 == 0 for b in starts)
    assert any(c % 4 and c < 128 for r in chunked for c in r.chunks)  # shorter than the window, off the blocks
    decode = CATALOGUE["decode-boundaries"].runs
    assert any(r.prompt_len < 256 <= r.positions - 1 and r.prompt_len % 4 for r in decode)  # closes HCA in decode
    assert max(r.decode_steps for r in CATALOGUE["long-decode"].runs) >= 512
    for s in CATALOGUE.values():
        labels = [r.label for r in s.runs]
        assert len(set(labels)) == len(labels) and (s.pairs or s.checks) and s.description
        assert all({p.a, p.b} <= set(labels) for p in s.pairs)
        assert all({c.a[0], c.b[0]} <= {x.label for x in s.scripts} for c in s.checks)
        assert bool(s.needs) == bool(s.scripts)
    batch = CATALOGUE["batch"].runs
    assert 3 <= len(batch) <= 8 and len({r.prompt_len % 4 for r in batch}) > 1
    assert len({r.decode_steps for r in batch}) > 1  # some finish early
    proposed = _proposals(CATALOGUE["verify"].script("verified"))
    assert any(op.accept < op.n for _, op in proposed)
    crosses = [range(p, p + op.n) for p, op in proposed]
    assert any(any(q % 4 == 3 for q in r[:-1]) for r in crosses)  # a CSA block ends inside a proposal
    assert any(any(q % 128 == 127 for q in r[:-1]) for r in crosses)  # and an HCA block


def _proposals(script):
    """(position, Propose) of every proposal of a one-sequence script."""
    from fidelity.studies.catalogue import Feed, Propose

    pos, out = 0, []
    for op in script.ops:
        if isinstance(op, Propose):
            out.append((pos, op))
            pos += op.accept
        elif isinstance(op, Feed):
            pos += sum(n for _, n in op.calls)
    return out


def test_a_scenario_passes_on_the_clean_production_decoder(plan, tmp_path):
    res = run_scenarios(plan, [SMALL], out=tmp_path, run_id="s", modes=("layer", "op"))
    assert res.passed, res.failures()
    pairs = res.pairs.set_index("b")
    assert pairs.loc["chunks 128,8", "bitwise"] and pairs.loc["chunks 128,8", "bitwise promised"] != "no"
    assert pairs.loc["chunks 5,6,7,118", "bitwise promised"] == "no"
    prefix = res.pairs[res.pairs["pair"] == "prefix"].iloc[0]
    assert prefix["bitwise"] and prefix["bitwise promised"] != "no"
    assert (res.matrix["verdict"] == "PASS").all() and (res.matrix.loc[1:, "self_consistency"] == "PASS").all()
    for name in ("report.md", "report.html", "matrix.csv", "pairs.csv", "plots/worst_local_cos.png"):
        assert (tmp_path / "s" / name).is_file()
    assert len(list((tmp_path / "s" / "runs").iterdir())) == len(SMALL.runs)


class LocalPositions(ProductionDecoder):
    """Port bug: each prefill chunk is run at chunk-local positions 0..n-1 (RoPE and the compressed entries' rotation
    restart), while the caches continue where the last chunk ended."""

    def prefill(self, ids):
        self.used, s = True, self.session
        s.in_prefill = True
        try:
            out = s._run(ids.long(), torch.arange(len(ids)))
        finally:
            s.in_prefill = False
        self.prompt_len += len(ids)
        return out


class DropCarry(ProductionDecoder):
    """Port bug: the compressors' carry (the unfinished block, and the previous block that overlap pooling reads) is
    not kept between prefill calls."""

    def prefill(self, ids):
        out = super().prefill(ids)
        for cache in self.session.layers:
            for carry in (cache.carry, cache.index_carry):
                if carry is not None:
                    carry.kv.zero_()
                    carry.score.fill_(float("-inf"))
        return out


@pytest.mark.parametrize("bug", [LocalPositions, DropCarry])
def test_a_planted_chunk_boundary_bug_is_caught_by_self_consistency(plan, bug):
    ckpt, ids = plan.ckpt, plan.prompt(160)
    clean = self_consistency(SMALL, ids, lambda n: open_decoder("production", ckpt, max_context=n))
    assert all(p["passed"] for p in clean)
    one = bug(ckpt, max_context=200)  # one decoder object for every run: reset between them
    got = pd.DataFrame(self_consistency(SMALL, ids, lambda n: one)).set_index("b")
    assert not got.loc["chunks 128,8", "passed"]  # promised equal bits: any change shows
    if bug is LocalPositions:  # large enough for the bound as well
        assert not got.loc["chunks 5,6,7,118", "passed"]
    assert got.loc["prompt 128", "passed"].all()  # one chunk: nothing planted shows


class RaisesOnChunk7(ProductionDecoder):
    """Port bug: a prefill call of 7 tokens fails (a kernel's shape rule), as a chunk boundary can."""

    def prefill(self, ids):
        if len(ids) == 7:
            raise RuntimeError("shape '[7, 4, 128]' is invalid for input of size 3072\n(more lines)")
        return super().prefill(ids)


def test_a_run_whose_decoder_raises_fails_alone_and_the_report_is_written(plan, tmp_path):
    """The run with a 7-token chunk raises in its third call: that run is judged up to the call and fails there
    with the exception as its first divergence, the other runs are judged as usual, the scenario's
    self-consistency fails on the same exception, and the report is written (it stopped the whole job, with no
    report, before)."""
    dec = RaisesOnChunk7(plan.ckpt, max_context=200)
    res = run_scenarios(plan, [SMALL], dec, out=tmp_path, run_id="s", modes=("op",))
    rows = res.matrix.set_index("run")
    raised = "the decoder raised RuntimeError: shape '[7, 4, 128]' is invalid for input of size 3072 (call 2, prefill)"
    assert rows.loc["chunks 5,6,7,118", "verdict"] == "FAIL"
    assert rows.loc["chunks 5,6,7,118", "first_divergence"] == raised
    assert rows.loc["chunks 5,6,7,118", "first_site"] == "decoder"
    assert (rows.drop(index="chunks 5,6,7,118")["verdict"] == "PASS").all()
    assert list(res.pairs["pair"]) == ["the decoder raised"] and not res.pairs["passed"].any()
    assert not res.passed and f"small/chunks 5,6,7,118: {raised}" in res.failures()
    report = (tmp_path / "s" / "report.md").read_text()
    assert f"FAIL small/chunks 5,6,7,118: {md_escape(raised)}" in report  # in the verdict, as markdown text
    assert (tmp_path / "s" / "plots" / "first_divergence.png").is_file()
    assert len(list((tmp_path / "s" / "runs").iterdir())) == len(SMALL.runs)  # the failed run's as well


def test_cli_writes_the_combined_report(plan, tmp_path, monkeypatch, capsys):
    tiny = Scenario("tiny", "a whole prompt and a chunked one", (
        Run("whole", 40, 1), Run("chunks 7,33", 40, 1, (7, 33), ("chunk", 7))),
        (Pair("chunked==whole", "whole", "chunks 7,33"),))
    monkeypatch.setitem(catalogue.CATALOGUE, "tiny", tiny)
    rc = main(["run", "--scenario", "tiny", "--mode", "op", "--out", str(tmp_path), "--run-id", "t", "--gate"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2/2 runs pass" in out and "1/1 pairs pass" in out
    md = (tmp_path / "t" / "report.md").read_text()
    assert "## Verdict\n\nPASS: 2 of 2 runs pass against the oracle, 1 of 1 self-consistency pairs pass." in md
    assert "chunked==whole" in md and "Scenario matrix" in md
    page = (tmp_path / "t" / "report.html").read_text()
    assert page.index('<section class="pass"><h2>Verdict') < page.index("<h2>Scenario matrix")
    for run_dir in (tmp_path / "t" / "runs").iterdir():  # each run's report, linked
        link = f"runs/{run_dir.name}/report.html"
        assert f'<a href="{link}">{link}</a>' in page and (tmp_path / "t" / link).is_file()
    assert ">nan<" not in page and "<style>" in page
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder left


def test_an_empty_plot_panel_says_why(plan, tmp_path):
    """Free mode only: no run has a local cos, and no run belongs to the chunks scenario; the panels say so."""
    tiny = Scenario("tiny", "one whole prompt", (Run("whole", 40, 1),), ())
    res = run_scenarios(plan, [tiny], "production", out=tmp_path, run_id="f", modes=("free",))
    assert res.matrix["worst_local_cos"].isna().all()
    texts = [[t.get_text() for t in ax.texts] for ax in scenarios_report.local_cos_figure(res.matrix).axes]
    assert texts == [["no run judged in layer or op mode (free mode has no local cos)"], [scenarios_report.NO_CHUNKS]]
    texts = [[t.get_text() for t in ax.texts] for ax in scenarios_report.divergence_figure(res.matrix).axes]
    assert texts == [[], [scenarios_report.NO_CHUNKS]]
    page = (tmp_path / "f" / "report.html").read_text()
    assert "<td class=\"num\">-</td>" in page and ">nan<" not in page  # worst_local_cos of a free-mode run


@pytest.mark.parametrize("command", ["scenarios", "run"])
def test_a_bad_scenario_name_is_one_line_exit_2(command, tmp_path, capsys):
    assert main([command, "--scenario", "lengths", "--scenario", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fidelity: error: --scenario: expected one of lengths, chunks, decode-boundaries, long-decode, "
                   "batch, prefix, verify, found nope"]


def test_the_matrix_and_plot_place_each_first_divergence(plan, tmp_path):
    """A planted chunk-boundary bug (LocalPositions) fails the chunked runs against the oracle: the matrix names
    their first divergence's step, site and layer; the first-divergence plot draws them at that layer over prompt
    length and chunk size, the passing runs on the 'none' row."""
    chunky = Scenario("chunky", "whole and chunked prompts", (
        Run("whole", 40, 1, param=("chunk", 40)), Run("chunks 7,33", 40, 1, (7, 33), ("chunk", 7)),
        Run("chunks 20,20", 40, 1, (20, 20), ("chunk", 20)), Run("prompt 24", 24, 1, param=("prompt_len", 24))))
    res = run_scenarios(plan, [chunky], LocalPositions(plan.ckpt, max_context=64), out=tmp_path, run_id="d",
                        modes=("op",))
    m = res.matrix.set_index("run")
    assert list(m.index[m["verdict"] == "FAIL"]) == ["chunks 7,33", "chunks 20,20"]
    for run, row in m.iterrows():
        if row["verdict"] == "PASS":
            assert (row["first_divergence"], row["first_step"], row["first_site"], row["first_layer"]) == \
                ("none", -1, "none", -1), run
        else:
            assert row["first_divergence"].startswith(f"step {row['first_step']} (prefill), {row['first_site']} ")
            assert row["first_step"] >= 1 and row["first_site"].startswith(f"L{row['first_layer']}.")  # 2nd chunk
    where = ["first_step", "first_site", "first_layer"]
    on_disk = pd.read_csv(tmp_path / "d" / "matrix.csv", keep_default_na=False)
    assert on_disk[where].values.tolist() == res.matrix[where].values.tolist()
    y, ticks = scenarios_report.divergence_rows(res.matrix)
    none = min(ticks)
    assert ticks[none] == "none (passes)"
    assert list(y) == [none if v == "PASS" else float(layer)
                       for v, layer in zip(res.matrix["verdict"], res.matrix["first_layer"], strict=True)]
    fig = scenarios_report.divergence_figure(res.matrix)
    chunk_panel = {tuple(p) for c in fig.axes[1].collections for p in c.get_offsets()}
    assert chunk_panel == {(40.0, none), (7.0, float(m.loc["chunks 7,33", "first_layer"])),
                           (20.0, float(m.loc["chunks 20,20", "first_layer"]))}
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == list(ticks.values())
    md = (tmp_path / "d" / "report.md").read_text()
    assert "](plots/first_divergence.png)" in md  # the plot linked, its caption as the alt text
    assert (tmp_path / "d" / "plots" / "first_divergence.png").read_bytes().startswith(b"\x89PNG")


def test_sites_outside_the_layers_get_rows_below_and_above_them():
    matrix = pd.DataFrame({"first_site": ["none", "L1.attn.q", "logits", "embed", "L3.ffn.out"],
                           "first_layer": [-1, 1, -1, -1, 3]})
    y, ticks = scenarios_report.divergence_rows(matrix)
    assert list(y) == [-2.5, 1.0, 4.0, -1.0, 3.0]
    assert ticks == {-2.5: "none (passes)", 1.0: "L1", 3.0: "L3", -1.0: "embed", 4.0: "logits"}
