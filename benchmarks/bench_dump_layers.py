"""Judging an engine dump of a real-width model layer by layer: peak host memory and time per layer against one
layer's bytes, with the stream oracle (``oracles.stream``: each layer's weights read once per mode) and with the
call-by-call oracle, on a synthesized V4-Flash-width checkpoint in the release layout.

    python benchmarks/bench_dump_layers.py --work /tmp/dump-bench --layers 16 --out results/

1. ``--work``/base: ``ModelConfig.preset("flash").first_layers(5)`` with ``--experts`` routed experts per layer
   (256 in the release: 3.2 GB of FP4 experts a layer; fewer keep the disk and the synthesis small), synthesized once
   (seed 0) and saved in the release layout (FP8 + ue8m0, FP4 experts).
2. ``--work``/ckpt-<N>: the first ``--layers`` layers of V4-Flash, each layer's tensors those of the base layer of
   its kind (SWA hash-routed 0-1, CSA hash-routed 2, HCA 3, CSA 4: layers past 4 repeat 3 and 4; the values are
   random either way, the bytes and the work per layer are the real widths').
3. A dump in SGLang's dumper layout of the oracle's own calls on it (``DumpWriter``; a ``--prompt``-token prompt in
   one call, then ``--decode`` steps), written call by call with the weights streamed.
4. ``fidelity run --decoder sglang-dump:<dump> --checkpoint ckpt-<N> --mode free --mode layer`` in a fresh process,
   the oracle keeping one layer's weights at a time (``oracle_one_layer``, the default past 16 GiB of fp32 weights),
   once with the stream oracle and once call by call (``--orders``): wall time, the oracle's time by layer (block
   calls timed), peak host RSS (``ru_maxrss``, which counts the checkpoint's mapped file pages too, and the
   anonymous bytes sampled from /proc) and the verdict.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FLASH_BASE_LAYERS = 5


def base_checkpoint(work: Path, experts: int) -> Path:
    from fidelity import ModelConfig, save_checkpoint, synthesize

    path = work / f"base-{experts}"
    if not (path / "config.json").exists():
        cfg = ModelConfig.preset("flash").first_layers(FLASH_BASE_LAYERS).replace(n_routed_experts=experts)
        save_checkpoint(synthesize(cfg, seed=0), path, layout="deepseek")
    return path


def source_layer(i: int) -> int:
    """The base layer whose tensors layer i of V4-Flash takes: same attention kind and routing."""
    if i < FLASH_BASE_LAYERS:
        return i
    return 4 if i % 2 == 0 else 3


def composed_checkpoint(work: Path, base: Path, layers: int) -> Path:
    from fidelity.model.config import ModelConfig

    path = work / f"ckpt-{layers}-{base.name}"
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_file(base / "config.json")
    flash = ModelConfig.preset("flash").first_layers(layers).replace(n_routed_experts=cfg.n_routed_experts)
    tensors = {}
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            parts = key.split(".")
            at = parts.index("layers") + 1 if "layers" in parts else None
            if at is None:
                tensors[key] = f.get_tensor(key)
                continue
            for i in range(layers):
                if source_layer(i) == int(parts[at]):  # a copy each: safetensors stores no shared tensors
                    tensors[".".join([*parts[:at], str(i), *parts[at + 1:]])] = f.get_tensor(key).clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(flash.to_official_dict(), indent=1))
    return path


def write_oracle_dump(ckpt: Path, out: Path, prompt: int, decode: int, device: str = "cpu") -> None:
    """The oracle's calls (a prompt call, then greedy decode steps) in SGLang's dumper layout at ``out``."""
    from fidelity.decoders.engine_dump.write import DumpWriter
    from fidelity.model.load import load_checkpoint
    from fidelity.model.sites import Recorder
    from oracles import OracleModel

    model = OracleModel(load_checkpoint(ckpt), device=device)
    writer = DumpWriter(out, overwrite=True)
    session = model.session()
    ids = torch.randint(3, model.cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    pos = 0
    for step in range(decode + 1):
        rec = Recorder(device=None)
        session.rec = rec
        logits = session.forward(ids)
        writer.add_call("oracle", step, ids, torch.arange(pos, pos + len(ids)), logits, rec)
        pos += len(ids)
        ids = logits[-1:].argmax(-1).cpu()
    writer.finish()


JUDGE = """
import json, resource, sys, threading, time
from collections import defaultdict
anon = [0]
def sample():  # the process's anonymous resident bytes (ru_maxrss also counts the checkpoint's mapped file pages)
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                anon[0] = max(anon[0], int(line.split()[1]) * 1024)
        time.sleep(0.2)
threading.Thread(target=sample, daemon=True).start()
import oracles.model as om
spent = defaultdict(float)
block = om.OracleSession.block
def timed(self, i, *a, **k):
    t = time.perf_counter(); out = block(self, i, *a, **k); spent[i] += time.perf_counter() - t; return out
om.OracleSession.block = timed
import fidelity
from fidelity.api import plan_checkpoint
from fidelity.decoders.engine_dump import open_dump
ckpt, dump, out, stream, device = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5]
t0 = time.perf_counter()
plan = plan_checkpoint(ckpt)
[dec] = open_dump("sglang-dump:" + dump, plan.config, precision="exact")
res = fidelity.run(dec, plan, modes=("free", "layer"), out=out, run_id=f"stream-{int(stream)}", overwrite=True,
                   oracle_stream=stream, oracle_one_layer=True, oracle_device=device)
import torch
gpu = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
print(json.dumps({"wall_s": time.perf_counter() - t0, "verdict": res.verdict,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak_rss_anon_bytes": anon[0], "gpu_allocated_peak_bytes": gpu,
                  "oracle_s_by_layer": [spent[i] for i in sorted(spent)],
                  "oracle_order": res.manifest["oracle_order"],
                  "oracle_weights": res.manifest["oracle_weights"],
                  "seconds_by_part": res.manifest["seconds_by_part"]}))
"""


def layer_bytes(ckpt: Path, i: int) -> dict[str, int]:
    """Layer i's bytes as stored and as the oracle holds them in fp32 (routed experts apart: dequantized at use)."""
    from fidelity.model.load import load_checkpoint

    c = load_checkpoint(ckpt)
    stored = fp32 = experts = 0
    for name in c.names():
        if not name.startswith(f"layers.{i}."):
            continue
        spec = c.spec(name)
        n = 1
        for d in spec.shape:
            n *= d
        if ".ffn.experts." in name:
            experts += 4 * n
        else:
            fp32 += 4 * n
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            if f".layers.{i}." in f".{key}":
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                stored += n * {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F32": 4, "I64": 8,
                               "I32": 4}.get(t.get_dtype(), 4)
    return {"stored": stored, "fp32_held": fp32, "fp32_experts_at_use": experts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--orders", default="stream,call_by_call", help="which oracle orders to time, comma-separated")
    p.add_argument("--device", default="cpu", help="the oracle's device (cuda: its peak GPU memory is reported)")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = base_checkpoint(a.work, a.experts)
    ckpt = composed_checkpoint(a.work, base, a.layers)
    dump = a.work / f"dump-{a.layers}-{a.prompt}-{a.decode}"
    if not dump.exists():
        write_oracle_dump(ckpt, dump, a.prompt, a.decode, a.device)
    prepared = time.perf_counter() - t0
    results = {"layers": a.layers, "experts": a.experts, "prompt": a.prompt, "decode": a.decode,
               "prepare_s": prepared, "layer_bytes": {k: layer_bytes(ckpt, k) for k in (0, 2, 3)},
               "peak_rss_before_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for stream in [o == "stream" for o in a.orders.split(",")]:
        done = subprocess.run([sys.executable, "-c", JUDGE, str(ckpt), str(dump / "oracle"), str(a.work / "runs"),
                               "1" if stream else "0", a.device], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the judging process exited {done.returncode}:\n{done.stderr[-4000:]}")
        results["stream" if stream else "call_by_call"] = json.loads(done.stdout.strip().splitlines()[-1])
    (a.out / "bench_dump_layers.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
