"""Train the default checkpoint within a wall-clock budget (one GPU call): time a few steps of the recipe,
choose the step count that fits, then run ``fidelity train`` with it. The chosen command is printed and
recorded in ``training.json``, so the result is reproduced by running that command.

    python tools/train_default.py --out OUT --device cuda --budget-s 420 [--seq-len 4096] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fidelity.cli import main as cli_main
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.train.loop import TrainSettings, optimizer
from fidelity.train.objective import step_losses
from fidelity.train.trainable import TrainableWeights
from oracles.model import OracleModel


def seconds_per_step(seq_len: int, device: str, steps: int = 4) -> float:
    """Median wall time of one training step (forward, both losses, backward, AdamW) on random ids."""
    cfg = ModelConfig.preset("tiny")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    weights = TrainableWeights(synthesize(cfg, 0), device)
    model, opt = OracleModel(weights, device=device), optimizer(weights, TrainSettings(out=""))
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):
        ids = torch.randint(3, cfg.vocab_size, (seq_len + 1,), generator=gen).to(device)
        t0 = time.perf_counter()
        losses = step_losses(model, weights, ids, 512, gen)
        (losses.lm + losses.indexer_kl).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds of training steps")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--corpus")
    p.add_argument("--tokenizer")
    p.add_argument("--init", help="continue from this checkpoint (its tokenizer too)")
    p.add_argument("--lr", default="3e-3")
    p.add_argument("--warmup", default="100")
    a = p.parse_args()
    per_step = seconds_per_step(a.seq_len, a.device)
    steps = max(50, int(a.budget_s / per_step))
    argv = ["train", "--out", a.out, "--device", a.device, "--steps", str(steps), "--seq-len", str(a.seq_len),
            "--eval-every", str(max(50, steps // 8))]
    argv += ["--corpus", a.corpus] if a.corpus else []
    argv += ["--tokenizer", a.tokenizer] if a.tokenizer else []
    argv += ["--init", a.init] if a.init else []
    argv += ["--lr", a.lr, "--warmup", a.warmup]
    print(f"{per_step:.3f} s/step at {a.seq_len} tokens -> fidelity {' '.join(argv)}", flush=True)
    sys.argv = ["fidelity", *argv]
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
