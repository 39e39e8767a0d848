"""What programmatic dependent launch saves per kernel: a chain of 90 dependent Triton kernels captured in a CUDA
graph and replayed, launched plainly, with ``launch_pdl`` (each kernel waits with ``griddepcontrol.wait`` first),
and with ``launch_pdl`` plus an early ``griddepcontrol.launch_dependents``; 1-264 CTAs, with little or some work.
Each graph's result is checked against the plain eager chain.

    python benchmarks/pdl_chain.py [OUT.json]
"""

import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _step(x_ptr, y_ptr, N: tl.constexpr, REPS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    offs = tl.program_id(0) * N + tl.arange(0, N)
    v = tl.load(x_ptr + offs)
    for _ in range(REPS):
        v = v * 1.0001 + 0.5
    tl.store(y_ptr + offs, v)


def chain(bufs, ctas, n, reps, pdl, early, length):
    for i in range(length):
        _step[(ctas,)](bufs[i % 2], bufs[(i + 1) % 2], N=n, REPS=reps, PDL=pdl, EARLY=early, num_warps=4,
                       launch_pdl=pdl)


def main():
    rows = []
    for ctas, reps in ((1, 1), (132, 1), (264, 200), (132, 2000)):
        n = 1024
        bufs = [torch.zeros(ctas * n, device="cuda"), torch.zeros(ctas * n, device="cuda")]
        for pdl, early in ((False, False), (True, False), (True, True)):
            length = 90
            chain(bufs, ctas, n, reps, pdl, early, length)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(bufs, ctas, n, reps, pdl, early, length)
            g.replay()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(20):
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e) * 1e3 / length)
            # correctness: the chain's result equals the eager one
            ref = [torch.zeros_like(bufs[0]), torch.zeros_like(bufs[0])]
            bufs[0].zero_()
            bufs[1].zero_()
            g.replay()
            torch.cuda.synchronize()
            chain(ref, ctas, n, reps, False, False, length)
            torch.cuda.synchronize()
            same = torch.equal(bufs[length % 2], ref[length % 2])
            ts.sort()
            r = {"ctas": ctas, "reps": reps, "pdl": pdl, "early_trigger": early, "us_per_kernel": ts[len(ts) // 2],
                 "same": same}
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


if __name__ == "__main__":
    rows = main()
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(json.dumps(rows, indent=1))
