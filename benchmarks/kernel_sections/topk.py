"""The indexer's top-k selection routes (``topk.stable_topk``)."""

from __future__ import annotations

import torch

from kernel_sections.common import BF16, DEV, _n_sets, record, time_fn


def _radix_at(block: int):
    """The radix selection at ``block`` entries per program (a sweep point)."""
    from fidelity.decoders.production.kernels.radix_topk import radix_topk

    return lambda s, k: radix_topk(s, k, {"block": block})


def bench_topk(quick: bool):
    """Indexer top-k selection on bf16 scores (what the indexer ops return; -inf past the causal limit): the
    routes of ``topk.stable_topk`` (each must equal the CPU's stable sort of the scores; ``radix`` is the Triton
    selection, ``sort`` the default before it), the path before the fourth 2026-12-01 session (an fp32 copy, then
    CUDA's float sort, which differs from the CPU's on -0.0 and negative NaNs), and plain ``torch.topk`` (tie order
    unspecified: a speed reference only). Cases marked "ties" have 80% of the scores at +-0.0 (ReLU-weighted
    scores of a short context), so the k-th score is a zero shared by thousands of entries."""
    from fidelity.decoders.production.topk import ROUTES, default_route, stable_topk

    cases = [("decode b1, 128K ctx (32768 keys), k=512", 1, 32768, 512),
             ("decode b1, 1M ctx (262144 keys), k=512", 1, 262144, 512),
             ("decode b1, 1M ctx (262144 keys), k=1024", 1, 262144, 1024),
             ("decode b64, 32K ctx (8192 keys), k=512", 64, 8192, 512),
             ("decode b1, 1M ctx (262144 keys), k=512, ties", 1, 262144, 512),
             ("decode b64, 32K ctx (8192 keys), k=512, ties", 64, 8192, 512)]
    cases += [(f"prefill chunk {r} q x {n} keys, k=512", r, n, 512)
              for r, n in ((128, 32768), (256, 32768), (512, 8192), (512, 32768), (512, 262144), (1024, 32768))]
    z = torch.randn(1, 32768).bfloat16().float()  # why the routes sort integers: signed zeros and NaNs
    z[torch.rand(1, 32768) < 0.8] = 0.0
    z[torch.rand(1, 32768) < 0.4] = -0.0
    z[0, 5], z[0, 9] = float("nan"), -float("nan")
    cpu = z.sort(dim=-1, descending=True, stable=True).indices[:, :4096]
    print(f"[topk] on +-0 / NaN scores: CUDA float sort == CPU sort: "
          f"{torch.equal(z.to(DEV).sort(dim=-1, descending=True, stable=True).indices[:, :4096].cpu(), cpu)}, "
          f"route sort == CPU sort: {torch.equal(stable_topk(z.to(DEV), 4096, 'sort').cpu(), cpu)}", flush=True)
    for name, rows, n, k in cases[:2] if quick else cases:
        g = torch.Generator(device=DEV).manual_seed(9)
        sets = []
        for _ in range(_n_sets(rows * n * 2, hi=48)):
            x = torch.randn(rows, n, device=DEV, generator=g).to(BF16)
            if name.endswith("ties"):
                x[torch.rand(rows, n, device=DEV, generator=g) < 0.8] = 0.0
                x[torch.rand(rows, n, device=DEV, generator=g) < 0.4] = -0.0
            x[:, n - n // 8:] = float("-inf")
            sets.append((x,))
        x = sets[0][0]
        ref = x.float().cpu().sort(dim=-1, descending=True, stable=True).indices[:, :k]
        check = {f"{route}_equal_to_cpu_stable_sort": bool(torch.equal(stable_topk(x, k, route).cpu(), ref))
                 for route in ROUTES}
        check["default_route"] = default_route(x, k)
        base = {}
        variants = [(f"route {route}", lambda s, k=k, route=route: stable_topk(s, k, route)) for route in ROUTES]
        sweep = {b: _radix_at(b) for b in (1024, 2048, 4096, 8192) if b <= n}
        check.update({f"radix_block_{b}_equal_to_cpu_stable_sort": bool(torch.equal(fn(x, k).cpu(), ref))
                      for b, fn in sweep.items()})
        print(f"[topk] {name}: {check}", flush=True)
        variants += [(f"radix, block {b} (sweep)", lambda s, k=k, fn=fn: fn(s, k)) for b, fn in sweep.items()]
        variants += [("before: fp32 copy + CUDA float sort",
                      lambda s, k=k: s.float().sort(dim=-1, descending=True, stable=True).indices[:, :k]),
                     ("torch.topk, unspecified ties", lambda s, k=k: torch.topk(s, k).indices)]
        for variant, fn in variants:
            r = record("topk", name, variant, time_fn(fn, sets), bytes_=rows * n * 2, flops=0, check=check)
            base[variant] = r["us"]
        chosen = base["route " + check["default_route"]]
        print(f"  default route {check['default_route']}: {chosen:.1f} us, {base['route sort'] / chosen:.2f}x "
              f"faster than the route sort, {base['before: fp32 copy + CUDA float sort'] / chosen:.2f}x than the "
              f"fp32 float sort", flush=True)
        del sets
        torch.cuda.empty_cache()
