"""``fidelity train``: the default checkpoint's recipe, from corpus to a release-format checkpoint.

Tiny shape (``ModelConfig.preset("tiny")``: every DSv4 structure), initialised by ``synthesize(config, seed)``,
trained on random windows of the token stream with AdamW (warm-up, cosine decay), the indexer's KL loss, and
MoE balance by the routing-bias update (bias += rate * sign(mean load - load), no auxiliary loss). Then stored
as the release stores it (``TrainableWeights.checkpoint``) and the held-out NLL measured on that checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fidelity.atomic_write import write_text_atomic
from fidelity.model import text
from fidelity.model.config import ModelConfig
from fidelity.model.load import load_checkpoint
from fidelity.model.save import save_checkpoint
from fidelity.model.synthesize import synthesize
from fidelity.train import corpus as corpus_mod
from fidelity.train.objective import step_losses
from fidelity.train.tokenizer import encode_document, train_tokenizer
from fidelity.train.trainable import TrainableWeights
from oracles.model import OracleModel

EVAL_MAX_LEN = 4096  # held-out documents are scored on their first 4096 tokens (from BOS)


@dataclass
class TrainSettings:
    out: str
    steps: int = 2000
    seq_len: int = 4096
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    kl_rows: int = 512
    bias_rate: float = 2e-3
    seed: int = 0
    device: str = "cpu"
    corpus: str | None = None  # default: the running Python's standard library
    tokenizer: str | None = None  # a tokenizer.json to reuse (default: --init's, else train one on the training files)
    init: str | None = None  # continue from this checkpoint's weights (default: synthesize(tiny, seed))
    eval_every: int = 250
    eval_docs: int = 8  # held-out documents measured during training (all of them at the end)
    eval_max_len: int = EVAL_MAX_LEN
    log_every: int = 10


def lr_at(s: TrainSettings, step: int) -> float:
    """Linear warm-up, then cosine from lr to lr * min_lr_ratio at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def tokenize(tok, files: list[corpus_mod.SourceFile]) -> list[list[int]]:
    return [encode_document(tok, f.path.read_text(encoding="utf-8")) for f in files]


@torch.no_grad()
def heldout_nll(model: OracleModel, docs: list[list[int]], max_len: int) -> tuple[float, int]:
    """Mean next-token NLL (nats) over documents (each its first ``max_len`` + 1 tokens, from BOS) and the
    number of tokens predicted."""
    total, count = 0.0, 0
    for doc in docs:
        ids = torch.tensor(doc[: max_len + 1], device=model.device)
        logits = model.session().forward(ids[:-1])
        total += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
        count += len(ids) - 1
    return total / max(1, count), count


def optimizer(weights: TrainableWeights, s: TrainSettings) -> torch.optim.Optimizer:
    """AdamW (0.9, 0.95): weight decay on the matrices (not the embedding), none on norms, biases and mHC."""
    decay = [p for n, p in weights.params.items() if p.ndim == 2 and n.endswith(".weight") and "embed" not in n]
    rest = [p for p in weights.params.values() if not any(p is d for d in decay)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=s.lr, betas=(0.9, 0.95), eps=1e-8)


def train(s: TrainSettings, progress=print) -> dict:
    """Train, write ``out/checkpoint/`` (release layout + tokenizer.json) and ``out/training.json``; the log."""
    out = Path(s.out)
    files = corpus_mod.corpus_files(s.corpus)
    train_files, held_files = corpus_mod.split(files)
    init = load_checkpoint(s.init) if s.init else synthesize(ModelConfig.preset("tiny"), s.seed)
    cfg = init.config
    tok_file = s.tokenizer or (str(Path(s.init) / "tokenizer.json") if s.init else None)
    tok = text.load(tok_file) if tok_file else train_tokenizer(
        (f.path.read_text(encoding="utf-8") for f in train_files), cfg.vocab_size)
    stream = torch.tensor([t for doc in tokenize(tok, train_files) for t in doc], dtype=torch.int64)
    held = tokenize(tok, held_files)
    if len(stream) < s.seq_len + 2:
        raise corpus_mod.CorpusError(f"corpus: expected more than {s.seq_len + 1} training tokens for --seq-len "
                                     f"{s.seq_len}, found {len(stream)}")
    device = torch.device(s.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # training speed; the oracle's evaluation below is exact
    torch.manual_seed(s.seed)
    weights = TrainableWeights(init, device)
    model = OracleModel(weights, device=device)
    opt = optimizer(weights, s)
    gen = torch.Generator().manual_seed(s.seed)
    log = {"settings": asdict(s), "command": " ".join(sys.argv), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "corpus": corpus_mod.describe(s.corpus, files), "train_tokens": len(stream),
           "held_out_tokens": sum(len(d) - 1 for d in held), "steps": [], "evals": []}
    t0 = time.perf_counter()
    for step in range(s.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, step)
        start = int(torch.randint(0, len(stream) - s.seq_len - 1, (1,), generator=gen))
        ids = stream[start : start + s.seq_len + 1].to(device)
        losses = step_losses(model, weights, ids, s.kl_rows, gen)
        (losses.lm + losses.indexer_kl).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(weights.main_params().values()), s.clip)
        torch.nn.utils.clip_grad_norm_(list(weights.indexer_params().values()), s.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _balance(weights, losses.loads, s.bias_rate)
        if step % s.log_every == 0 or step == s.steps - 1:
            row = {"step": step, "lm": float(losses.lm.detach()), "indexer_kl": float(losses.indexer_kl.detach()),
                   "grad_norm": float(gnorm), "lr": lr_at(s, step), "seconds": time.perf_counter() - t0,
                   "load_max_over_mean": max(float(v.max() / v.float().mean()) for v in losses.loads.values())}
            log["steps"].append(row)
            progress(f"step {step}: lm {row['lm']:.3f} kl {row['indexer_kl']:.3f} lr {row['lr']:.2e} "
                     f"load max/mean {row['load_max_over_mean']:.2f} ({row['seconds']:.0f} s)")
        if s.eval_every and (step + 1) % s.eval_every == 0 and step + 1 < s.steps:
            nll, _ = heldout_nll(model, held[: s.eval_docs], s.eval_max_len)
            log["evals"].append({"step": step + 1, "held_out_nll": nll, "docs": min(len(held), s.eval_docs)})
            progress(f"step {step + 1}: held-out NLL {nll:.3f} ({min(len(held), s.eval_docs)} documents)")
    log["train_seconds"] = time.perf_counter() - t0
    return _finish(s, out, weights, tok, held, log, progress)


def _balance(weights: TrainableWeights, loads: dict[int, torch.Tensor], rate: float) -> None:
    for i, load in loads.items():
        bias = weights.fixed[f"layers.{i}.ffn.gate.bias"]
        bias += rate * torch.sign(load.float().mean() - load.float())


def _finish(s: TrainSettings, out: Path, weights: TrainableWeights, tok, held: list[list[int]], log: dict,
            progress) -> dict:
    """Save the release-format checkpoint, measure it on every held-out document, write the log."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "checkpoint"
    save_checkpoint(weights.checkpoint(), target, "deepseek", overwrite=True)
    tok.save(str(target / "tokenizer.json"))
    saved = OracleModel(load_checkpoint(target), device=s.device)
    fp32_nll, _ = heldout_nll(OracleModel(weights, device=s.device), held, s.eval_max_len)
    nll, count = heldout_nll(saved, held, s.eval_max_len)
    log["final"] = {"held_out_nll_fp32_weights": fp32_nll, "held_out_nll": nll, "held_out_tokens_scored": count,
                    "held_out_docs": len(held), "uniform_nll": math.log(weights.config.vocab_size)}
    progress(f"held-out NLL {nll:.3f} nats/token over {count} tokens of {len(held)} documents "
             f"(fp32 weights before storing: {fp32_nll:.3f})")
    write_text_atomic(out / "training.json", json.dumps(log, indent=1) + "\n")
    return log
