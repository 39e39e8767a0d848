"""GPU memory of the 1M-token decode cache: what ``torch.cuda.memory_allocated()`` says against the analytic figure
(``cache_sizes.cache_bytes``), FP8 KV rows + packed FP4 indexer keys.

    python benchmarks/bench_1m_cache_memory.py --out DIR [--context 1048576] [--chunk 16384] [--layers 4]
        [--presets flash pro] [--no-prefill]

1. Full depth, allocation: a V4-Flash (43 layers) and a V4-Pro (61 layers) session at ``--context`` tokens on the
   GPU, weights lazy (never read): the bytes the model's tables and the session's caches add to
   ``memory_allocated``; the caches against the analytic total.
2. A ``--context``-token prefill, the cache filled to its last row: the Flash slice of ``--layers`` layers at
   V4-Flash's widths (SWA, SWA, CSA, HCA for 4), its weights generated on the GPU when first read and kept there
   (a whole V4-Flash model's weights, about 160 GB stored, do not fit one GPU). ``memory_allocated`` after the
   model, after the session, after the prefill, and after the session is freed (the model's weights alone); the
   peak during the prefill. The session after the prefill minus its analytic cache is what the prefill left
   allocated beyond the cache.

Writes DIR/cache_memory_1m.json and prints a table. Without CUDA it writes nothing and exits 2 with one line.
About 1.5 minutes on an H100 with the Triton kernels compiled (2.5 while they compile).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity.decoders.production import ProductionModel, get_profile  # noqa: E402
from fidelity.decoders.production.cache import decode_gathers  # noqa: E402
from fidelity.decoders.production.cache_sizes import cache_bytes, profile_formats  # noqa: E402
from fidelity.model.config import ModelConfig  # noqa: E402
from fidelity.model.synthesize import synthesize  # noqa: E402

PROFILE = "reference:kv_storage=fp8,indexer_storage=packed"  # FP8 KV rows (584 B), packed FP4 keys (68 B)
GiB = 1 << 30


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def free_all() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def analytic(cfg: ModelConfig, context: int) -> int:
    prof = get_profile(PROFILE)
    return cache_bytes(cfg, context, *profile_formats(prof), decode_gathers(prof)).total()


def session_on_gpu(cfg: ModelConfig, context: int) -> tuple[ProductionModel, object, int, int, int]:
    """(model, session, bytes allocated before the model, the model's tables, the session) for ``cfg`` at
    ``context`` tokens on the GPU, weights lazy."""
    base = allocated()
    model = ProductionModel(synthesize(cfg, seed=0, lazy=True, device="cuda"), PROFILE, max_context=context,
                            device="cuda")
    after_model = allocated()
    session = model.session()
    return model, session, base, after_model - base, allocated() - after_model


def full_depth(preset: str, context: int) -> dict:
    """Part 1: the whole model's session allocated at ``context`` tokens, no weight read."""
    cfg = ModelConfig.preset(preset)
    model, session, _, tables, held = session_on_gpu(cfg, context)
    row = {"part": "allocation", "preset": preset, "layers": cfg.n_layers, "context": context,
           "model_tables": tables, "session": held,
           "session_reported": session.cache_bytes(), "analytic": analytic(cfg, context)}
    del session, model
    free_all()
    return row


def prefill_slice(layers: int, context: int, chunk: int) -> dict:
    """Part 2: the Flash slice prefilled to ``context`` tokens in ``chunk``-token calls."""
    cfg = ModelConfig.preset("flash").first_layers(layers)
    torch.cuda.reset_peak_memory_stats()
    model, session, base, tables, held = session_on_gpu(cfg, context)
    ids = torch.randint(3, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    for s in range(0, context, chunk):
        session.prefill(ids[s : s + chunk], last_only=True)
    after_prefill = allocated()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    assert session.pos == context
    cache = analytic(cfg, context)
    del session
    free_all()
    model_only = allocated()
    del model
    free_all()
    return {"part": "prefill", "preset": "flash", "layers": layers, "context": context, "chunk": chunk,
            "prefill_s": round(seconds, 1), "model_tables": tables, "session": held,
            "analytic": cache, "after_prefill": after_prefill - base, "peak": peak - base,
            "model_after_prefill": model_only - base, "session_after_prefill": after_prefill - model_only,
            "beyond_cache": after_prefill - model_only - cache}


def table(rows: list[dict]) -> str:
    cols = ("part", "preset", "layers", "context", "model_tables", "session", "analytic", "session_after_prefill",
            "beyond_cache", "model_after_prefill", "peak", "prefill_s")
    gib = {"model_tables", "session", "analytic", "session_after_prefill", "model_after_prefill", "peak"}
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c] / GiB:.4f} GiB" if c in gib and c in r else
                 (f"{r[c]:,} B" if c == "beyond_cache" and c in r else str(r.get(c, "-"))) for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4, help="the prefilled Flash slice's layers")
    ap.add_argument("--presets", nargs="+", default=["flash", "pro"], choices=("flash", "pro"))
    ap.add_argument("--no-prefill", action="store_true", help="part 1 only")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_1m_cache_memory: needs a CUDA device (torch.cuda.is_available() is False); nothing written",
              file=sys.stderr)
        return 2
    if a.context < 1 or a.chunk < 1:
        print(f"bench_1m_cache_memory: --context, --chunk: expected >= 1, found {a.context}, {a.chunk}",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # as a run sets it
    rows = [full_depth(p, a.context) for p in a.presets]
    if not a.no_prefill:
        rows.append(prefill_slice(a.layers, a.context, a.chunk))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "profile": PROFILE}
    (out / "cache_memory_1m.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
