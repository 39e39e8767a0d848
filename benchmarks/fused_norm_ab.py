"""What fusing the norms with their quantization changes in the production decoder's numbers: profile
``fused-norm`` (``rms_norm_act_quant``, ``kv_norm_rope_fp8``) against ``reference`` (RMSNorm, RoPE and each GEMM's
activation quantization as separate ops), same device, same tokens.

    python benchmarks/fused_norm_ab.py --out DIR [--device cuda] [--prompt 512] [--steps 16]
                                       [--model default,flash4]

Models: ``default`` (the shipped checkpoint: tiny widths, head_dim 128, where ``kv_norm_rope_fp8`` runs its
emulation and says so under ``kernel_fallbacks``) and ``flash4`` (V4-Flash widths, its first 4 layers, weights
synthesized on the device, seed 0: head_dim 512, where both kernels run). Per model and profile: an eager
session prefills ``--prompt`` tokens of the default text and decodes ``--steps`` teacher-forced tokens, recording
the sites below. The fused run is compared with the unfused one site by site (every layer in the JSON; the table:
the first site that differs, layer 0's sites, the last residual, the logits): the share of elements that are not
bit-equal, the worst row cosine, and for the logits the greedy picks that agree. Writes DIR/fused_norm_ab.json
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import (  # noqa: E402
    ProductionModel,
    fallbacks,  # noqa: E402
    registry,
)
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.default import DEFAULT_DIR, prompt_for  # noqa: E402
from fidelity.model.load import load_checkpoint  # noqa: E402
from fidelity.model.sites import Recorder  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402

SITES = ("attn.in", "attn.q", "attn.kv", "attn.core", "moe.in", "moe.out", "residual")


def checkpoint(name: str, device: str):
    if name == "default":
        return load_checkpoint(DEFAULT_DIR)
    if name == "flash4":
        return synthesize(ModelConfig.preset("flash").first_layers(4), seed=0, lazy=True, device=device)
    raise SystemExit(f"--model: expected default or flash4, found {name!r}")


def record(ckpt, profile: str, ids: torch.Tensor, prompt: int, device: str) -> tuple[Recorder, dict]:
    """Sites of a prefill of ids[:prompt] and one teacher-forced decode step per remaining id."""
    patterns = [r"L\d+\." + re.escape(s) for s in SITES] + ["logits"]
    rec = Recorder(patterns)
    registry.reset_used()
    fallbacks.reset()
    model = ProductionModel(ckpt, profile, max_context=len(ids) + 1, device=device)
    session = model.session(rec)
    session.prefill(ids[:prompt].to(device))
    for t in ids[prompt:].tolist():
        session.step(t)
    return rec, {"implementations": registry.implementations_used(), "kernel_fallbacks": fallbacks.counts()}


def compare(a: Recorder, b: Recorder) -> dict:
    """Per site (all layers pooled): elements not bit-equal, worst row cosine; logits: greedy picks agreeing."""
    out = {}
    for site in a.records:
        x, y = a.get(site).double(), b.get(site).double()
        rows_x, rows_y = x.flatten(1), y.flatten(1)
        cos = torch.nn.functional.cosine_similarity(rows_x, rows_y, dim=-1)
        out[site] = {"elements": x.numel(), "not_bit_equal": float((x != y).double().mean()),
                     "worst_cos": float(cos.min())}
        if site == "logits":
            out[site]["picks_agree"] = float((x.argmax(-1) == y.argmax(-1)).double().mean())
    return out


def table_rows(name: str, per_site: dict, n_layers: int) -> list[str]:
    """Markdown rows: the first layer's sites (what fusion does locally), the last residual and the logits (what
    the model makes of it), and the first site in data-flow order that is not bit-equal."""
    first = next((site for site, v in per_site.items() if v["not_bit_equal"]), "none")
    rows = [f"| {name} | first site not bit-equal: **{first}** | | | |"]
    for site in [f"L0.{s}" for s in SITES] + [f"L{n_layers - 1}.residual", "logits"]:
        v = per_site[site]
        agree = f"{v['picks_agree']:.4f}" if "picks_agree" in v else ""
        rows.append(f"| {name} | {site} | {v['not_bit_equal']:.2e} | {v['worst_cos']:.7f} | {agree} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--model", default="default,flash4")
    a = ap.parse_args()
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "prompt": a.prompt,
               "steps": a.steps, "models": {}}
    lines = ["| model | site | elements not bit-equal | worst row cos | greedy picks agree |",
             "|---|---|---|---|---|"]
    for name in a.model.split(","):
        ckpt = checkpoint(name, a.device)
        ids = prompt_for(ckpt, a.prompt + a.steps)
        runs = {p: record(ckpt, p, ids, a.prompt, a.device) for p in ("reference", "fused-norm")}
        per_site = compare(runs["reference"][0], runs["fused-norm"][0])
        results["models"][name] = {"per_site": per_site, **{p: meta for p, (_, meta) in runs.items()}}
        lines += table_rows(name, per_site, ckpt.config.n_layers)
        print(f"{name}: fused-norm implementations {runs['fused-norm'][1]['implementations']}; "
              f"fallbacks {runs['fused-norm'][1]['kernel_fallbacks']}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_norm_ab.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
