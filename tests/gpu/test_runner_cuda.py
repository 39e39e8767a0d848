"""The run's time by part on CUDA (skipped without CUDA): GPU work a part queued without waiting for it is timed in
that part, not in the next part's first host read."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fidelity.decoders import default_decoder  # noqa: E402
from fidelity.harness.runner import Runner, RunSpec  # noqa: E402
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
