"""Long prompts on bounded memory: chunked prefill through the runner (every mode, exact visible sets), sampled
queries spread over the chunks, and host memory that grows by at most 16 KiB per prompt token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fidelity.harness.judgement import judge
from fidelity.harness.runner import AUTO_CHUNK, AUTO_WHOLE, RunError, Runner, RunSpec
from fidelity.harness.thresholds import default_thresholds
from fidelity.job import tidy
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt
from fidelity.model.synthesize import synthesize

GROWTH = """
import json, resource, sys, torch
torch.set_num_threads(1)
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt
from fidelity.harness.runner import Runner, RunSpec
from fidelity.model.synthesize import synthesize
ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
peaks = {}
for n in (2048, 6144):
    spec = RunSpec(prompt=default_prompt(4096, n), decode_steps=2, modes=("layer", "op"), sample_queries=64,
                   prefill_chunk=512)
    Runner(ckpt, spec).run()
    peaks[n] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(peaks))
"""


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


def test_a_run_prefilled_in_chunks_passes_with_exact_visible_sets(tiny):
    spec = RunSpec(prompt=default_prompt(4096, 700), decode_steps=2, prefill_chunk=300)
    df, manifest = Runner(tiny, spec).run()
    df = tidy(df, "chunks", "reference")
    calls = df.groupby("step")["phase"].first()
    assert list(calls) == ["prefill"] * 3 + ["decode"] * 2  # chunks of 300, 300, 100, then two tokens
    visible = df[df["site"].str.endswith("attn.visible") & df["metric"].isin(["missing", "extra"])]
    assert set(visible["mode"]) == {"free", "layer"} and visible["value"].sum() == 0  # op mode reads them
    judgement = judge(df, default_thresholds("reference", [2, 4]), "quantized")
    assert judgement.passed, str(judgement.first_divergence)
    assert manifest["memory_peaks"]["prefill"]["host_rss_peak_bytes"] > 0


def test_sampled_queries_are_spread_over_the_chunks_and_each_keeps_its_last(tiny):
    spec = RunSpec(prompt=default_prompt(4096, 700), decode_steps=0, modes=("layer",), sample_queries=8,
                   prefill_chunk=300)
    runner = Runner(tiny, spec)
    rows = [runner.rows_of(torch.arange(s, s + n)) for s, n in ((0, 300), (300, 300), (600, 100))]
    assert [int(r[-1]) for r in rows] == [299, 299, 99]
    assert sum(len(r) for r in rows) >= 8 and all(bool((r.diff() > 0).all()) for r in rows)


def test_prefill_chunks_default_to_the_whole_prompt_up_to_the_limit_and_must_cover_it():
    assert RunSpec(prompt=torch.zeros(AUTO_WHOLE, dtype=torch.long)).chunk_sizes() == [AUTO_WHOLE]
    n = AUTO_WHOLE + 1
    assert RunSpec(prompt=torch.zeros(n, dtype=torch.long)).chunk_sizes() == \
        [AUTO_CHUNK] * (n // AUTO_CHUNK) + [n % AUTO_CHUNK]
    spec = RunSpec(prompt=torch.zeros(10, dtype=torch.long), prefill_chunk=[4, 4])
    with pytest.raises(RunError, match=r"prefill_chunk: expected sizes >= 1 adding up to the prompt's 10 tokens"):
        Runner(synthesize(ModelConfig.preset("tiny"), seed=0), spec)


def test_host_memory_grows_by_at_most_16_kib_per_prompt_token():
    """Two prompt lengths in one fresh process (the peak resident set never falls, so the process measures only
    these runs): the recorded sites, the oracle's and op mode's state and the metric table stay bounded."""
    out = subprocess.run([sys.executable, "-c", GROWTH], capture_output=True, text=True, timeout=600, check=True)
    peaks = {int(k): v for k, v in json.loads(out.stdout).items()}
    per_token = (peaks[6144] - peaks[2048]) / (6144 - 2048)
    assert per_token <= 16 * 1024, f"{per_token / 1024:.1f} KiB per prompt token"


def test_a_release_sized_slice_keeps_the_widths_and_every_layer_kind():
    flash = ModelConfig.preset("flash")
    cut = flash.first_layers(4)
    assert cut.layer_kinds == ("swa", "swa", "csa", "hca") and cut.n_hash_layers == 3 and cut.n_mtp_layers == 0
    assert (cut.dim, cut.n_heads, cut.head_dim, cut.index_topk, cut.n_routed_experts) == (4096, 64, 512, 512, 256)
    with pytest.raises(Exception, match=r"layers: expected 1\.\.43, found 0"):
        flash.first_layers(0)


def test_lazy_synthesis_draws_the_eager_tensors_and_keeps_them_when_asked():
    cfg = ModelConfig.preset("tiny")
    eager, lazy = synthesize(cfg, seed=0), synthesize(cfg, seed=0, lazy=True, keep=True)
    for name in ("layers.2.attn.wq_a.weight", "layers.3.ffn.experts.5.w2.weight", "embed.weight"):
        a, b = eager.stored(name), lazy.stored(name)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), name
        assert lazy.stored(name) is b  # kept: read once


def test_a_release_sized_slice_is_refused_on_the_cpu_saying_where_it_can_run(tmp_path, capsys):
    from fidelity import cli

    assert cli.main(["run", "--preset", "flash", "--layers", "4", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "release-sized slices (--preset flash --layers 4) are generated on a GPU with --device cuda" in err
