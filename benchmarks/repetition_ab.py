"""Repetition A/B: does a stream loop with greedy picks, with a repetition penalty (1.1, 1.5; over the whole history
or a recent-ids window), at temperature 0 and 0.6? Each model generates its own stream from the default prompt.

    python benchmarks/repetition_ab.py --out DIR [--checkpoint DIR | --preset P --layers N [--experts E]]
        [--steps 512] [--models oracle production] [--window 256] [--device cuda]

``oracle``: the exact fp32 oracle's own stream (``OracleModel``); ``production``: the production decoder's
(``reference`` profile). Per model and sampler: the stop reason (``stop``: a stop id, ``length``: ``--steps``
picks), the tokens generated, and the repetition probe's loop onset / period (-1 / 0: the stream does not end in a
loop), 4-gram repeat rate and longest repeated span. Writes DIR/repetition_ab.json and DIR/repetition_ab.md.
``--preset flash --layers 4 --experts 8 --device cuda``: a Flash-shaped slice (V4-Flash's widths, its first four
layers, 8 routed experts a layer; random weights, seed 0) synthesized and run on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity import ModelConfig, synthesize  # noqa: E402
from fidelity.api import plan_checkpoint  # noqa: E402
from fidelity.decoders.production import ProductionModel  # noqa: E402
from fidelity.model.default import is_default, prompt_for  # noqa: E402
from fidelity.model.sampling import Sampler, SamplerConfig, StopSet, generate  # noqa: E402
from oracles.model import OracleModel  # noqa: E402
from probes.repetition import repetition  # noqa: E402

COLUMNS = ("model", "temperature", "penalty", "window", "stop", "generated", "loop_onset", "loop_period",
           "repeat_rate", "longest_repeat", "seconds")


def samplers(window: int) -> list[SamplerConfig]:
    """Greedy and penalties 1.1 / 1.5 (whole history, then the last ``window`` ids) at temperature 0 and 0.6."""
    grid = [(1.0, 0), (1.1, 0), (1.5, 0), (1.1, window), (1.5, window)]
    return [SamplerConfig(temperature=t, repetition_penalty=p, repetition_window=w, seed=0)
            for t in (0.0, 0.6) for p, w in grid]


def session_fns(model):
    """(prefill_fn -> last logits [V] fp32 on the host, step_fn) of a fresh session of ``model``."""
    s = model.session()
    return (lambda ids: s.prefill(ids)[-1].float().cpu()), (lambda tok: s.step(tok).float().cpu())


def load_model(kind: str, ckpt, capacity: int, device: str):
    """The exact fp32 oracle or the production decoder (``reference`` profile) on ``device``."""
    if kind == "oracle":
        return OracleModel(ckpt, torch.float32, device=device)
    return ProductionModel(ckpt, "reference", max_context=capacity, device=device)


def one_stream(kind: str, model, ckpt, prompt: torch.Tensor, steps: int, cfg: SamplerConfig) -> dict:
    t0 = time.perf_counter()
    prefill, step = session_fns(model)
    out = generate(prefill, step, prompt, steps, Sampler(cfg), StopSet.from_config(ckpt.config))
    rep = repetition(out.ids)
    return {"model": kind, "temperature": cfg.temperature, "penalty": cfg.repetition_penalty,
            "window": cfg.repetition_window or "all", "stop": out.reason, "generated": len(out.ids),
            "loop_onset": rep["loop_onset"], "loop_period": rep["loop_period"],
            "repeat_rate": round(rep["repeat_rate"], 3), "longest_repeat": rep["longest_repeat"],
            "seconds": round(time.perf_counter() - t0, 1), "ids": out.ids}


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def open_checkpoint(a: argparse.Namespace):
    """The checkpoint asked: a directory, the trained default, or a preset's first ``--layers`` with ``--experts``
    routed experts a layer, synthesized (seed 0) on ``--device``."""
    if a.preset and a.experts:
        cfg = ModelConfig.preset(a.preset)
        cfg = (cfg.first_layers(a.layers) if a.layers else cfg).replace(n_routed_experts=a.experts)
        return synthesize(cfg, seed=0, lazy=a.device != "cpu", device=a.device)
    return plan_checkpoint(a.checkpoint, preset=a.preset, layers=a.layers, device=a.device).open()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", help="checkpoint directory (default: the trained default)")
    ap.add_argument("--preset", help="synthesize this preset instead (random weights)")
    ap.add_argument("--layers", type=int, help="with --preset: its first N layers")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--models", nargs="+", default=["oracle", "production"], choices=("oracle", "production"))
    ap.add_argument("--window", type=int, default=256, help="the windowed rows' repetition window")
    ap.add_argument("--experts", type=int, help="with --preset: routed experts a layer (default: the preset's)")
    ap.add_argument("--prompt-len", type=int, help="the default prompt's first N ids (default: all of it)")
    ap.add_argument("--device", default="cpu", help="where the models run and a preset is synthesized")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ckpt = open_checkpoint(a)
    prompt = prompt_for(ckpt, a.prompt_len)
    rows = []
    for kind in a.models:
        model = load_model(kind, ckpt, len(prompt) + a.steps + 1, a.device)
        for cfg in samplers(a.window):
            rows.append(one_stream(kind, model, ckpt, prompt, a.steps, cfg))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": "trained default" if is_default(ckpt.path) else str(ckpt.path),
            "prompt_tokens": len(prompt), "steps": a.steps, "seed": 0, "torch": torch.__version__, "threads": 1,
            "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "preset": a.preset, "layers": a.layers, "experts": a.experts}
    (out / "repetition_ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "repetition_ab.md").write_text(markdown(rows))
    print(f"wrote {out / 'repetition_ab.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
