"""Long prompts on a CUDA device (skipped without one): chunked prefill against the whole prefill, and a chunked
run with the oracle on the GPU, its fp32 without TF32."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.config import ModelConfig  # noqa: E402
from fidelity.job import tidy  # noqa: E402
from fidelity.judgement import judge  # noqa: E402
from fidelity.oracle_run import default_prompt  # noqa: E402
from fidelity.production import ProductionModel  # noqa: E402
from fidelity.runner import Runner, RunSpec  # noqa: E402
from fidelity.sites import Recorder  # noqa: E402
from fidelity.synthesize import synthesize  # noqa: E402
from fidelity.thresholds import default_thresholds  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return synthesize(ModelConfig.preset("tiny"), seed=0)


def test_chunked_prefill_equals_the_whole_prefill_on_cuda(tiny):
    """Chunks of 512 over a 2048-token prompt: the same logits, visible sets and caches' entries as one prefill
    (and the same decode steps after it)."""
    ids = default_prompt(4096, 2048)
    sites = [r"L\d+\.attn\.visible", "logits"]
    recs = [Recorder(sites), Recorder(sites)]
    out = []
    for rec, split in zip(recs, ([2048], [512] * 4), strict=True):
        s = ProductionModel(tiny, "reference", max_context=2056, device="cuda").session(rec)
        logits = torch.cat([s.prefill(c) for c in ids.split(split)])
        out.append(torch.cat((logits, *(s.step(t)[None] for t in (5, 6, 7)))).cpu())
    diff = (out[0] - out[1]).abs().max().item()
    assert torch.equal(out[0], out[1]), f"max |logit difference| {diff}"
    for site in recs[0].records:
        if site.endswith("visible"):
            assert torch.equal(recs[0].get(site), recs[1].get(site)), site


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
