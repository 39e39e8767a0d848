"""The production decoder's layers placed over processes: a pipeline by contiguous layer ranges
(``torch.distributed``: NCCL between GPUs, gloo between CPU processes).

Stage r holds the caches of its layers only and reads only their weights (``ProductionModel.w`` loads a tensor on
first use, so a stage never touches another stage's shards); stage 0 also embeds the tokens, the last stage also
runs the head. A call sends the mHC streams [n, hc, dim] from stage to stage and broadcasts the last stage's fp32
logits to every stage, so each returns what the one-process session returns: the same ops on the same tensors in
the same order, bit for bit (``tests/test_pipeline.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fidelity.decoders.production.model import ProductionModel, ProductionSession
from fidelity.model.config import ModelConfig
from fidelity.model.sites import Recorder
from fidelity.model.weights import expected_tensors, stored_nbytes


def layer_bytes(cfg: ModelConfig) -> list[float]:
    """Bytes of each layer's weights in their stored formats (what a stage must hold)."""
    out = [0.0] * cfg.n_layers
    for name, spec in expected_tensors(cfg).items():
        if name.startswith("layers."):
            out[int(name.split(".")[1])] += stored_nbytes(spec)
    return out


def place_layers(cfg: ModelConfig, stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, each as close as it can be to an equal share of the layers'
    weight bytes (every stage gets at least one layer)."""
    if not 1 <= stages <= cfg.n_layers:
        raise ValueError(f"stages: expected 1..{cfg.n_layers} (one layer at least per stage), found {stages}")
    sizes = layer_bytes(cfg)
    total, bounds, acc = sum(sizes), [0], 0.0
    for i, size in enumerate(sizes):
        acc += size
        left = stages - len(bounds)  # boundaries still to place
        if left > 0 and (acc >= total * len(bounds) / stages or cfg.n_layers - (i + 1) == left):
            bounds.append(i + 1)
    bounds.append(cfg.n_layers)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class PipelineStage:
    """The stage policy of rank ``rank`` of ``world``: the session's own layers, the streams received from the
    previous stage (stage 0: the embedding) and sent to the next, the last stage's logits broadcast to all."""

    head_rows_free = False  # every stage receives the whole logits of the call

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def layers(self, s: ProductionSession) -> range:
        return s.own

    def enter(self, s: ProductionSession, ids: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return s.embed(ids)
        x = torch.empty((len(ids), s.cfg.hc_mult, s.cfg.dim), dtype=s.res_dtypes[s.own[0] - 1],
                        device=s.model.device)
        dist.recv(x, self.rank - 1)
        return x

    def leave(self, s: ProductionSession, x: torch.Tensor) -> torch.Tensor:
        if self.rank < self.world - 1:
            dist.send(x.contiguous(), self.rank + 1)
            logits = torch.empty((x.shape[0], s.cfg.vocab_size), dtype=torch.float32, device=s.model.device)
        else:
            logits = s.head(x)
        dist.broadcast(logits, self.world - 1)
        return logits


class PipelineSession(ProductionSession):
    """One stage of a pipelined session: ``rank`` of ``world`` processes of the default process group, layers
    ``place_layers(cfg, world)[rank]``, under the :class:`PipelineStage` policy; ``prefill`` / ``step`` are called
    on every stage with the same ids."""

    def __init__(self, model: ProductionModel, recorder: Recorder | None = None, rank: int | None = None,
                 world: int | None = None):
        rank = dist.get_rank() if rank is None else rank
        world = dist.get_world_size() if world is None else world
        self.rank, self.world = rank, world
        super().__init__(model, recorder, own=place_layers(model.cfg, world)[rank], stage=PipelineStage(rank, world))
