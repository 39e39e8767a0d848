"""Trainable DSv4 weights for the oracle: every float tensor of a checkpoint as an fp32 Parameter.

The oracle reads them through ``weights[name]`` like any checkpoint. The lightning indexer's tensors are handed
to it detached (the main loss never trains them: they learn from their own KL loss, see ``objective``), the
routing biases are plain tensors (moved by the load-balancing update, no gradient) and ``tid2eid`` stays fixed.
"""

from __future__ import annotations

import torch

from fidelity.model.checkpoint import Checkpoint, StoredTensor
from fidelity.model.synthesize import store
from fidelity.model.weights import TensorSpec


class TrainableWeights:
    """Parameters initialised from ``init`` (e.g. ``synthesize(config, seed)``) on ``device``."""

    def __init__(self, init: Checkpoint, device: str | torch.device = "cpu"):
        self.config = init.config
        self._specs = {n: init.spec(n) for n in init.names()}
        self.params: dict[str, torch.nn.Parameter] = {}
        self.fixed: dict[str, torch.Tensor] = {}  # tid2eid (int) and the routing biases
        for name in init.names():
            t = init[name].to(device)
            if not t.is_floating_point():
                self.fixed[name] = t
            elif name.endswith(".gate.bias"):
                self.fixed[name] = t.float().clone()
            else:
                self.params[name] = torch.nn.Parameter(t.float().clone())

    def names(self) -> list[str]:
        return list(self._specs)

    def spec(self, name: str) -> TensorSpec:
        return self._specs[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        """What the oracle reads: a Parameter, the indexer's detached, or a fixed tensor."""
        if name in self.fixed:
            return self.fixed[name]
        p = self.params[name]
        return p.detach() if is_indexer(name) else p

    def indexer_params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.params.items() if is_indexer(n)}

    def main_params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.params.items() if not is_indexer(n)}

    def checkpoint(self) -> Checkpoint:
        """The weights stored as a release stores them (FP8 / FP4 / bf16 per tensor spec, one quantization)."""
        tensors = {}
        for name, spec in self._specs.items():
            t = self.fixed[name] if name in self.fixed else self.params[name]
            t = t.detach().cpu()
            tensors[name] = store(t.float(), spec.fmt) if t.is_floating_point() else StoredTensor.plain(t)
        ckpt = Checkpoint.from_tensors(self.config, tensors)
        ckpt.origin.update(trained=True)
        return ckpt


def is_indexer(name: str) -> bool:
    return ".attn.indexer." in name

