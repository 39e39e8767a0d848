"""Which CUDA tensors an eager production decode step in the runner's setting (a fresh ``Recorder(device=None)`` per
call) leaves alive beyond its logits and records, and what refers to them (gc referrer chains): the diagnosis of a
``retained_growth`` failure in ``tests/gpu/test_allocator_cuda.py``.

    python benchmarks/diag_retained_cuda.py
"""

import gc
import inspect
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fidelity  # noqa: E402
from fidelity.decoders.production.decoder import ProductionDecoder  # noqa: E402
from fidelity.model.default import prompt_for  # noqa: E402
from fidelity.model.load import load_checkpoint  # noqa: E402
from fidelity.model.sites import Recorder  # noqa: E402


def cuda_tensors() -> dict[int, torch.Tensor]:
    return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda}


def describe(o) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} ({o.f_code.co_filename.split('/')[-1]}:{o.f_lineno})"
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__} ({o.__code__.co_filename.split('/')[-1]}:{o.__code__.co_firstlineno})"
    if isinstance(o, types.CellType):
        return "cell"
    if isinstance(o, torch.Tensor):
        return f"tensor {tuple(o.shape)} {o.dtype}"
    if isinstance(o, dict):
        return f"dict keys {list(o)[:6]}"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__} len {len(o)}"
    return type(o).__name__


def chain(o, depth=0, seen=None, skip=()):
    seen = seen if seen is not None else set()
    if depth > 7:
        return
    for r in gc.get_referrers(o):
        if id(r) in seen or r is skip or isinstance(r, types.FrameType) and r.f_code.co_filename == __file__:
            continue
        if r is globals() or (isinstance(r, list) and len(r) > 10000):
            continue
        seen.add(id(r))
        print("  " * (depth + 1) + describe(r))
        chain(r, depth + 1, seen, skip)


def main() -> None:
    ckpt = load_checkpoint(fidelity.default_checkpoint())
    kw = {"graphs": False} if "graphs" in inspect.signature(ProductionDecoder).parameters else {}
    dec = ProductionDecoder(ckpt, "reference", 340, "cuda", **kw)
    dec.rec = Recorder(device=None)
    logits = dec.prefill(prompt_for(ckpt, 300, 0).cuda())[-1]
    for step in range(8):
        gc.collect()
        rec = Recorder(device=None)
        dec.rec = rec
        before_ids = cuda_tensors()
        alloc0 = torch.cuda.memory_allocated()
        logits = dec.step(int(logits.argmax()))
        alloc1 = torch.cuda.memory_allocated()
        handed = {t.untyped_storage().data_ptr() for r in rec.records.values() for _, t in r}
        handed.add(logits.untyped_storage().data_ptr())
        new = [t for i, t in cuda_tensors().items() if i not in before_ids
               and t.untyped_storage().data_ptr() not in handed]
        print(f"step {step}: allocated delta {alloc1 - alloc0} B, new cuda tensor objects not handed: {len(new)}",
              flush=True)
        if step >= 3:
            for t in new[:6]:
                base = None if t._base is None else tuple(t._base.shape)
                print(f" survivor {tuple(t.shape)} {t.dtype} base {base} refcount {sys.getrefcount(t)}")
                chain(t, skip=new)
        gc.collect()
        print(f"  after gc.collect: allocated delta {torch.cuda.memory_allocated() - alloc0} B", flush=True)
        del new


if __name__ == "__main__":
    main()
