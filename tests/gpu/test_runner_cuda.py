"""The run's time by part on CUDA (skipped without CUDA): GPU work a part queued without waiting for it is timed in
that part, not in the next part's first host read."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders import default_decoder  # noqa: E402
from fidelity.harness.runner import Runner, RunSpec  # noqa: E402
from fidelity.job import run_job  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402

SLEEP_CYCLES = 2_000_000_000  # at least 1.01 s of GPU time at the H100 / H200's 1.98 GHz ceiling


def test_gpu_work_the_decoder_queued_is_timed_in_the_decoder_part():
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    prompt = torch.randint(2, ckpt.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    dec = default_decoder(ckpt, "reference", len(prompt) + 1, "cuda")
    prefill = dec.prefill

    def prefill_then_queue_a_second(ids: torch.Tensor) -> torch.Tensor:
        logits = prefill(ids)
        torch.cuda._sleep(SLEEP_CYCLES)  # queued after the call's own kernels, not waited for
        return logits

    dec.prefill = prefill_then_queue_a_second
    runner = Runner(ckpt, RunSpec(prompt, decode_steps=1, modes=("op",), device="cuda"), decoder=dec)
    runner.run()
    assert runner.seconds["prefill decoder"] >= 1.0, runner.seconds


def test_an_oracle_on_the_gpu_judges_a_decoder_on_the_host_like_one_on_the_host(tmp_path):
    """``oracle_device`` apart from the decoder's (a CPU-side dump judged by a GPU oracle): every site pair, the
    routing weights' included, is compared on one device, and the verdict and the rows are those of an all-host run."""
    ckpt = synthesize(ModelConfig.preset("tiny"), seed=0)
    prompt = torch.randint(2, ckpt.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    results = {}
    for oracle_device in ("cpu", "cuda"):
        dec = default_decoder(ckpt, "reference", len(prompt) + 3, "cpu")
        spec = RunSpec(prompt, decode_steps=2, modes=("free", "layer", "op"), device="cpu",
                       oracle_device=oracle_device)
        results[oracle_device] = run_job(ckpt, spec, tmp_path, oracle_device, decoder=dec)
    host, gpu = (results[d].judgement.judged for d in ("cpu", "cuda"))
    assert (host["site"].values == gpu["site"].values).all() and (host["metric"].values == gpu["metric"].values).all()
    assert host["site"].str.endswith(".moe.weights").any(), "no routing-weight rows were compared"
    assert results["cuda"].verdict == results["cpu"].verdict == "PASS"
