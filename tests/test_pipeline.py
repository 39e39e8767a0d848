"""The production decoder pipelined over processes (``PipelineSession``, gloo on the CPU): each stage holds only its
layers' caches and weights, and every stage returns the one-process session's logits bit for bit."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fidelity.decoders.production import ProductionModel
from fidelity.decoders.production.pipeline import PipelineSession, layer_bytes, place_layers
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize

TINY = ModelConfig.preset("tiny")
PROMPT, STEPS = 150, 4


def _ids() -> torch.Tensor:
    return torch.randint(3, TINY.vocab_size, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(0))


def _decode(session) -> torch.Tensor:
    ids = _ids()
    out = [session.prefill(ids[: PROMPT // 2]), session.prefill(ids[PROMPT // 2 : PROMPT])]  # two chunks
    return torch.cat(out + [session.step(int(t))[None] for t in ids[PROMPT:]])


def _stage(rank: int, world: int, port: int, profile: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = ProductionModel(synthesize(TINY, seed=0), profile, max_context=PROMPT + STEPS)
        session = PipelineSession(model)
        logits = _decode(session)
        held = sorted(i for i, c in enumerate(session.layers) if c is not None)
        read = sorted({int(n.split(".")[1]) for n in model._weights if n.startswith("layers.")})
        torch.save({"logits": logits, "caches": held, "weights": read}, f"{out}/stage{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("profile", ["reference", "reference:residual=fp32@0-3"])  # fp32 streams cross stages
def test_two_pipeline_stages_give_the_one_process_logits_bit_for_bit(tmp_path, profile):
    world = 2
    mp.spawn(_stage, args=(world, _free_port(), profile, str(tmp_path)), nprocs=world, join=True)
    whole = _decode(ProductionModel(synthesize(TINY, seed=0), profile, max_context=PROMPT + STEPS).session())
    ranges = place_layers(TINY, world)
    for rank in range(world):
        got = torch.load(os.path.join(tmp_path, f"stage{rank}.pt"))
        assert torch.equal(got["logits"], whole), rank
        assert got["caches"] == got["weights"] == list(ranges[rank])  # its own layers only


def test_placement_covers_every_layer_once_in_balanced_contiguous_ranges():
    flash = ModelConfig.preset("flash")
    for cfg in (TINY, flash):
        sizes = layer_bytes(cfg)
        for stages in range(1, 5):
            ranges = place_layers(cfg, stages)
            assert [i for r in ranges for i in r] == list(range(cfg.n_layers)) and all(len(r) for r in ranges)
            share = sum(sizes) / stages
            assert max(sum(sizes[i] for i in r) for r in ranges) <= share + max(sizes)
    with pytest.raises(ValueError, match="stages: expected 1..6"):
        place_layers(TINY, 7)
