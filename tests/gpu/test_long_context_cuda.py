"""Long prompts on a CUDA device (skipped without one): chunked prefill against the whole prefill, and a chunked
run with the oracle on the GPU, its fp32 without TF32."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders.production import ProductionModel  # noqa: E402
from fidelity.harness.judgement import judge  # noqa: E402
from fidelity.harness.runner import Runner, RunSpec  # noqa: E402
from fidelity.harness.thresholds import default_thresholds  # noqa: E402
from fidelity.job import tidy  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.default import default_prompt  # noqa: E402
from fidelity.model.sites import Recorder  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


def test_chunked_prefill_equals_the_whole_prefill_on_cuda(tiny):
    """Chunks of 512 over a 2048-token prompt against one prefill: the first layer's values to the rounding of GEMMs
    over other row counts (cuBLAS and the Triton kernels tile by the row count; the random model amplifies such
    bits layer by layer, so later values are compared op by op by the runner's op mode, next test), the window
    part of every visible set and the whole visible sets of the layers without an indexer exactly, as many
    compressed entries and indexer keys."""
    ids = default_prompt(4096, 2048)
    sites = [r"L\d+\.attn\.(visible|compressed_kv)", r"L\d+\.indexer\.keys", r"L0\.attn\.(q|kv)"]
    recs = [Recorder(sites), Recorder(sites)]
    for rec, split in zip(recs, ([2048], [512] * 4), strict=True):
        s = ProductionModel(tiny, "reference", max_context=2056, device="cuda").session(rec)
        for chunk in ids.split(split):
            s.prefill(chunk)
    whole, chunked = recs
    assert set(whole.records) == set(chunked.records)
    for site in whole.records:
        a, b = whole.get(site), chunked.get(site)
        assert a.shape == b.shape, site
        if site.startswith("L0.attn."):
            if a.is_floating_point():
                cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)
                assert cos > 0.99999, (site, cos)
            else:
                assert torch.equal(a, b), site
        if site.endswith("visible"):
            assert torch.equal(a[:, :128], b[:, :128]), site
            if tiny.config.ratio(int(site[1])) != 4:
                assert torch.equal(a, b), site


def test_a_chunked_run_with_the_oracle_on_cuda_passes_without_tf32(tiny):
    spec = RunSpec(prompt=default_prompt(4096, 3000), decode_steps=3, modes=("layer", "op"), sample_queries=48,
                   prefill_chunk=1024, device="cuda")
    df, manifest = Runner(tiny, spec).run()
    assert manifest["oracle_device"].startswith("cuda")
    assert not manifest["oracle_numerics"]["matmul_allow_tf32"]
    assert manifest["memory_peaks"]["prefill"]["gpu_allocated_peak_bytes"] > 0
    df = tidy(df, "cuda", "reference")
    judgement = judge(df, default_thresholds("reference", [2, 4]), "quantized")
    assert judgement.passed, str(judgement.first_divergence)
