"""What training changed: attention entropy, routing spread and indexer concentration of the oracle on the
trained default vs random weights of the same shape, on the same prompt (the default's own text).

    python benchmarks/trained_vs_random.py [--prompt-len 1221] [--out FILE.md]

attention entropy: per layer, the mean over queries and heads of the entropy of the attention weights over the
visible rows (the sink's share excluded), divided by log(visible rows): 1 = flat, 0 = one row.
routing: per MoE layer, the entropy of the expert load over the prompt's routed slots / log(experts), and the
largest load over the mean load. indexer: per CSA layer, the share of the main attention's mass (over compressed
entries) that falls on the indexer's top-k entries, mean over queries.
"""

from __future__ import annotations

import argparse
import math

import pandas as pd
import torch

import fidelity
from fidelity.model.config import ModelConfig
from fidelity.model.default import default_prompt_ids
from fidelity.model.sites import Recorder
from fidelity.outputs.report import md_table
from oracles import attention, model

_entropies: list[tuple[float, int]] = []


def _recording_sink_softmax(logits, valid, sink):
    p = _original(logits, valid, sink)
    n_valid = valid.sum(-1).clamp(min=2).to(p.dtype)  # [n]
    q = p / p.sum(-1, keepdim=True).clamp_min(1e-30)  # renormalised without the sink's share
    h = -(q * q.clamp_min(1e-30).log()).sum(-1)  # [n, H]
    _entropies.append((float((h / n_valid.log()[:, None]).mean()), int(q.shape[0])))
    return p


_original = attention.sink_softmax


def measure(ckpt, ids: torch.Tensor) -> dict[str, float]:
    cfg = ckpt.config
    rec = Recorder([r"L\d+\.(moe\.experts|attn\.(q|compressed_kv)|indexer\.topk)"])
    out = {}
    session = model.OracleModel(ckpt).session(rec)
    attention.sink_softmax = _recording_sink_softmax
    try:
        _entropies.clear()
        per_layer = []
        orig_block = session.block

        def block(i, *a, **k):
            start = len(_entropies)
            y = orig_block(i, *a, **k)
            got = _entropies[start:]
            per_layer.append(sum(e * n for e, n in got) / max(1, sum(n for _, n in got)))
            return y

        session.block = block
        session.prefill(ids)
    finally:
        attention.sink_softmax = _original
    for i, kind in enumerate(cfg.layer_kinds):
        out[f"L{i} {kind} attention entropy"] = per_layer[i]
    for i in range(cfg.n_layers):
        load = torch.bincount(rec.get(f"L{i}.moe.experts").flatten(), minlength=cfg.n_routed_experts).double()
        p = load / load.sum()
        ent = float(-(p * p.clamp_min(1e-30).log()).sum() / math.log(cfg.n_routed_experts))
        tag = "hash" if cfg.is_hash_layer(i) else "routed"
        out[f"L{i} {tag} routing load entropy"] = ent
        out[f"L{i} {tag} routing max/mean load"] = float(load.max() / load.mean())
    for i, kind in enumerate(cfg.layer_kinds):
        if kind != "csa":
            continue
        q, entries, picks = rec.get(f"L{i}.attn.q"), rec.get(f"L{i}.attn.compressed_kv"), rec.get(f"L{i}.indexer.topk")
        pos = torch.arange(len(ids))
        visible = torch.arange(entries.shape[0])[None, :] < ((pos + 1) // 4)[:, None]
        rows = visible.sum(-1) > cfg.index_topk  # queries where the indexer must choose
        logits = torch.einsum("nhd,ed->nhe", q, entries) * cfg.head_dim**-0.5
        mass = logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1).mean(1)  # [n, E]
        chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, picks.clamp(min=0), picks >= 0)
        out[f"L{i} csa indexer top-k share of attention mass"] = float((mass * chosen).sum(-1)[rows].mean())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    ids = default_prompt_ids(4096, length=a.prompt_len)
    trained = fidelity.load_checkpoint(fidelity.default_checkpoint())
    random = fidelity.synthesize(ModelConfig.preset("tiny"), 0)
    table = pd.DataFrame({"trained default": measure(trained, ids), "random (tiny, seed 0)": measure(random, ids)})
    text = f"prompt: the default's text, {len(ids)} tokens\n\n" + md_table(table.rename_axis("measure").reset_index())
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
