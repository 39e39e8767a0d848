"""Dumps written by SGLang's own dumper (``sglang/srt/debug_utils/dumper.py``, sglang without its dependencies) over
transformers' DeepseekV4ForCausalLM, with tensor-parallel ranks as gloo processes: every rank runs the model (the
reduced tensors are the same on every rank, as after an all-reduce) and dumps, as SGLang does, every module's
output (``register_non_intrusive_dumper``, mode ``all``), the batch metadata of each forward pass, and its own heads
of the queries after RoPE and of the attention output (``dims="t h[tp] d"``), the tensors a column-parallel
attention shards. ``plant`` perturbs the queries of one layer, of rank 1's heads only (a rank's shard is wrong) or
of every head (a port bug before sharding)."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

STUBS = {"sglang.srt.managers.io_struct": {"sock_recv": None, "sock_send": None, "wrap_as_pickle": None},
         "sglang.srt.runtime_context": {"get_parallel": None, "get_server_args": None, "get_serving": None},
         "sglang.srt.utils": {"get_device": lambda: "cpu"}}
SITE_MAP = """base = "transformers"
[[rule]]
match = 'attn_q'
site = "L{i}.attn.q"
[[rule]]
match = 'attn_core'
site = "L{i}.attn.core"
"""


def dumper_path() -> Path | None:
    """dumper.py of the installed sglang (``pip install --no-deps sglang==0.5.23 pyzmq``), None without it."""
    if "sglang_dumper" in sys.modules:
        return Path(sys.modules["sglang_dumper"].__file__)
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "debug_utils" / "dumper.py"
    return path if path.is_file() else None


def load_dumper():
    """SGLang's dumper module, its three server-side imports stubbed (they serve its HTTP control, unused here)."""
    path = dumper_path()
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", *STUBS):
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(STUBS.get(name, {}))
        sys.modules[name] = module
    spec = importlib.util.spec_from_file_location("sglang_dumper", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_dumper"] = module
    spec.loader.exec_module(module)
    return module.dumper


def script(vocab: int, seed: int = 0) -> list[list[tuple[str, torch.Tensor]]]:
    """Forward passes: requests a and b (40-token prompts) prefilled together in two chunks, decoded together for
    three steps; then request c (24 tokens) alone, decoded for two steps. Decode tokens are drawn here (a greedy
    engine's would be its argmax; the judgement replays whatever the dump fed)."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(3, vocab, (n,), generator=g) for n in (40, 40, 24))
    passes = [[("a", a[:20]), ("b", b[:20])], [("a", a[20:]), ("b", b[20:])]]
    passes += [[("a", torch.randint(3, vocab, (1,), generator=g)), ("b", torch.randint(3, vocab, (1,), generator=g))]
               for _ in range(3)]
    passes += [[("c", c)]] + [[("c", torch.randint(3, vocab, (1,), generator=g))] for _ in range(2)]
    return passes


def _rank_main(rank: int, world: int, ckpt_dir: str, out: str, port: int, plant: str | None, layer: int) -> None:
    import torch.distributed as dist
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from fidelity.decoders.transformers import hf_model
    from fidelity.model.load import load_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dumper = load_dumper()
    dumper.configure(enable=True, dir=out, exp_name="exp", non_intrusive_mode="all", enable_output_console=False,
                     filter="'.inputs.' not in name")  # module inputs are other modules' outputs
    model = hf_model(load_checkpoint(ckpt_dir), torch.float32)
    heads = model.config.num_attention_heads

    def attention(module, query, key, value, mask, scaling, dropout=0.0, **kwargs):
        i = module.layer_idx
        if plant is not None and i == layer:  # query [b, H, s, d]
            query = query.clone()
            query[:, heads // 2 if plant == "rank" else 0:] *= 1.25
        out, weights = hf.eager_attention_forward(module, query, key, value, mask, scaling, dropout, **kwargs)
        mine = slice(rank * heads // world, (rank + 1) * heads // world)
        q = query.transpose(1, 2).reshape(-1, heads, query.shape[-1])
        dumper.dump("attn_q", q[:, mine].contiguous(), dims="t h[tp] d")
        dumper.dump("attn_core", out.reshape(-1, heads, out.shape[-1])[:, mine].contiguous(),
                    dims="t h[tp] d")
        return out, weights

    AttentionInterface.register("dump_test", attention)
    AttentionMaskInterface.register("dump_test", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation("dump_test")
    dumper.register_non_intrusive_dumper(model)
    caches, stands = {}, {}
    with torch.no_grad():
        for batch in script(model.config.vocab_size):
            rids = [r for r, _ in batch]
            key = tuple(rids)
            cache = caches.setdefault(key, DynamicCache(config=model.config))
            start = stands.get(key, 0)
            ids = torch.stack([t for _, t in batch])
            n = ids.shape[1]
            dumper.dump("positions", torch.arange(start, start + n).repeat(len(batch)))
            dumper.dump("seq_lens", torch.full((len(batch),), start + n))
            dumper.dump("rids", rids)
            model(input_ids=ids, past_key_values=cache, use_cache=True,
                  position_ids=torch.arange(start, start + n)[None].expand(len(batch), -1))
            stands[key] = start + n
            dumper.step()
    dist.barrier()
    dist.destroy_process_group()


def write_sglang_dump(ckpt_dir: str | Path, out: str | Path, world: int = 2, plant: str | None = None,
                      layer: int = 3, port: int = 29561) -> Path:
    """A TP=``world`` dump of ``script`` on the checkpoint at ``ckpt_dir`` (transformers' layout) in ``out``;
    returns the experiment folder. ``plant``: None, ``rank`` (rank 1's query heads of ``layer`` perturbed) or
    ``all`` (every head of that layer's queries)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, str(ckpt_dir), str(out), port, plant, layer), nprocs=world, join=True)
    return Path(out) / "exp"


def to_hook_layout(experiment: str | Path, out: str | Path) -> Path:
    """The dumper experiment's tensors in the forward-hook layout (``TP<r>_PP0_Rank<r>_pid<p>/Pass<NNNNN>.pt``, one
    dict per pass and rank): module outputs under their module paths, the batch metadata under
    ``model.forward_batch_info.*``, the extra attention dumps under ``model.layers.<i>.self_attn.<name>``."""
    out = Path(out)
    passes: dict[tuple[int, int], dict] = {}
    for path in sorted(Path(experiment).glob("*.pt")):
        tags = dict(p.split("=", 1) for p in path.stem.split("___"))
        value = torch.load(path, weights_only=True)["value"]
        name = tags["name"]
        if name.startswith("non_intrusive__"):
            key = name.removeprefix("non_intrusive__").replace(".output", "")
        elif name in ("input_ids", "positions", "seq_lens"):
            if "layer_id" in tags:
                continue
            key = f"model.forward_batch_info.{name}"
        elif name.startswith("attn_"):
            key = f"model.layers.{tags['layer_id']}.self_attn.{name}"
        else:
            continue
        passes.setdefault((int(tags["step"]), int(tags["rank"])), {}).setdefault(key, value)
    for (step, rank), tensors in passes.items():
        folder = out / f"TP{rank}_PP0_Rank{rank}_pid{1000 + rank}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, folder / f"Pass{step:05d}.pt")
    return out


HOOK_SITE_MAP = """base = "transformers"
[meta]
input_ids = "model.forward_batch_info.input_ids"
positions = "model.forward_batch_info.positions"
seq_lens = "model.forward_batch_info.seq_lens"
[[rule]]
match = 'model\\.layers\\.(?P<layer>\\d+)\\.self_attn\\.attn_q'
site = "L{i}.attn.q"
[[rule]]
match = 'model\\.layers\\.(?P<layer>\\d+)\\.self_attn\\.attn_core'
site = "L{i}.attn.core"
"""
