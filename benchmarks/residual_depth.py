"""Residual stream size per layer at full depth: the production decoder's ``L{i}.residual`` (all 4 mHC streams)
over a prefill and its decode steps, on a random-weight model of V4-Flash's 43 layers and widths.

    python benchmarks/residual_depth.py --out DIR [--prompt 2048] [--decode 512] [--experts 8] [--device cuda]

The model is ``ModelConfig.preset("flash")`` with ``--experts`` routed experts instead of 256 (6 active; the
attention, mHC and expert widths kept), so that all 43 layers' weights fit one GPU; weights are generated on the
device when first read. Greedy decode from random prompt ids. Per layer: the RMS and the largest |x| of the
residual streams over the prompt's tokens, then per decode step; written to DIR/residual_depth.json with a table of
the prefill, the first and the last step. Without CUDA (``--device cuda``) it writes nothing and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import ProductionModel  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.sites import Recorder  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402


def layer_stats(rec: Recorder, n_layers: int) -> dict[str, list[float]]:
    """RMS and max |x| per layer of the call's ``L{i}.residual`` records (then dropped)."""
    rms, top = [], []
    for i in range(n_layers):
        x = rec.get(f"L{i}.residual").float()
        rms.append(x.square().mean().sqrt())
        top.append(x.abs().amax())
    rec.records.clear()
    return {"rms": torch.stack(rms).tolist(), "max_abs": torch.stack(top).tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("residual_depth: --device cuda needs a CUDA device (torch.cuda.is_available() is False); nothing "
              "written", file=sys.stderr)
        return 2
    cfg = ModelConfig.preset("flash").replace(n_routed_experts=a.experts)
    model = ProductionModel(synthesize(cfg, seed=0, lazy=True, device=a.device), "reference",
                            max_context=a.prompt + a.decode + 1, device=a.device)
    rec = Recorder([r"L\d+\.residual"], device=None)
    session = model.session(rec)
    ids = torch.randint(3, cfg.vocab_size, (a.prompt,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    logits = session.prefill(ids, last_only=True)[-1]
    steps = [layer_stats(rec, cfg.n_layers)]
    for _ in range(a.decode):
        logits = session.step(int(logits.argmax()))
        steps.append(layer_stats(rec, cfg.n_layers))
    seconds = time.perf_counter() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": "flash", "n_routed_experts": a.experts, "layers": cfg.n_layers, "prompt": a.prompt,
            "decode": a.decode, "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "seconds": round(seconds, 1), "weights": "synthesize(seed=0), random"}
    (out / "residual_depth.json").write_text(json.dumps({"meta": meta, "steps": steps}))
    print("| layer | kind | prefill rms | prefill max | step 0 rms | last step rms | last step max |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for i in range(cfg.n_layers):
        print(f"| {i} | {cfg.layer_kinds[i]} | {steps[0]['rms'][i]:.3g} | {steps[0]['max_abs'][i]:.3g} | "
              f"{steps[1]['rms'][i]:.3g} | {steps[-1]['rms'][i]:.3g} | {steps[-1]['max_abs'][i]:.3g} |")
    print(f"{seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
