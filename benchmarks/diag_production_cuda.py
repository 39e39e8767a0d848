"""Which implementation moves the CUDA production model away from the CPU emulation?

Reproduces tests/gpu/test_production_cuda.py (tiny preset, 300-token prefill + 8 decode steps, per-step cosine
of the logits) with the CPU reference forced to the ``cpu`` implementations (pure CPU emulation), then runs the
CUDA model with: every op on its ``cpu`` implementation (torch on CUDA tensors), every op on ``triton`` where
registered, and one ``triton`` op at a time. Also the test's own setting (default selection in both sessions).

    python benchmarks/diag_production_cuda.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import ProductionModel, registry  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.default import default_prompt  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402


def main() -> None:
    tiny = synthesize(ModelConfig.preset("tiny"), seed=0)
    ids = default_prompt(4096, 300)

    def run(device: str) -> torch.Tensor:
        s = ProductionModel(tiny, "bf16", max_context=320, device=device).session()
        return torch.cat([s.prefill(ids)[-1:], *(s.step(t)[None] for t in ids[:8])]).float().cpu()

    gpu_ops = sorted(op for op, impls in registry.REGISTRY.items() if "triton" in impls)
    print("ops with a triton implementation:", gpu_ops)

    default_cpu = run("cpu")  # the test's reference: default selection (triton wrappers take CPU tensors too)
    default_gpu = run("cuda")
    with registry.forcing(dict.fromkeys(gpu_ops, "cpu")):
        ref = run("cpu")

    def cos(b: torch.Tensor, a: torch.Tensor = ref) -> list[float]:
        return [round(v, 5) for v in torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).tolist()]

    print(f"{'test setting (default selection, both sessions)':58s} {cos(default_gpu, default_cpu)}")
    print(f"{'default-selection CPU session vs pure CPU emulation':58s} {cos(default_cpu)}")
    variants = {"cuda, all ops torch (cpu implementations)": {op: "cpu" for op in gpu_ops},
                "cuda, all triton": {op: "triton" for op in gpu_ops}}
    for op in gpu_ops:
        variants[f"cuda, only {op} triton"] = {o: ("triton" if o == op else "cpu") for o in gpu_ops}
    for name, which in variants.items():
        with registry.forcing(which):
            print(f"{name:58s} {cos(run('cuda'))}", flush=True)


if __name__ == "__main__":
    main()
