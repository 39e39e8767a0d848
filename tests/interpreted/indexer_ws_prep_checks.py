"""Run under TRITON_INTERPRET=1 (tests/test_indexer_ws_cpu.py): the warp-specialized indexer's query preparation
on the CPU. Prints one JSON line {check: [problems]}."""

import json

import torch

from fidelity.production import ops
from fidelity.production.kernels import indexer_ws

BF16 = torch.bfloat16


def _queries() -> tuple[torch.Tensor, list[int]]:
    """FP4-simulated queries, a plain bf16 one, one holding a NaN, and two edge cases of the code grid: a value
    exactly 2^-9 at the query's code scale (exact, an e4m3 subnormal) and one at 2^-10 (not representable)."""
    g = torch.Generator().manual_seed(0)
    q = ops.indexer_round(torch.randn(6, 40, 128, generator=g), "fp4", rotate=True).to(BF16)
    q[1] = torch.randn(40, 128, generator=g).to(BF16)
    q[2, 3, 4] = float("nan")
    for i, k in ((3, 16), (4, 17)):  # amax 2^(E+1) > |x| >= 2^E; the code scale is 2^(7 - E)
        e = int(torch.floor(torch.log2(q[i].float().abs().max())))
        q[i, 0, 0] = 2.0 ** (e - k)
    return q, [1, 0, 0, 1, 0, 1]


def main() -> None:
    q, expected = _queries()
    n, h, d = q.shape
    q8 = torch.empty((n, indexer_ws.HEADS, d), dtype=torch.uint8)
    qexp = torch.empty((n,), dtype=torch.int32)
    used = torch.empty((n,), dtype=torch.int8)
    indexer_ws._prepare_queries[(n,)](q, q8, qexp, used, h, q.stride(0), q.stride(1), H=indexer_ws.HEADS, DIM=d)
    problems: dict[str, list] = {"exact_flags": [], "exponents": [], "codes": [], "padded_heads": []}
    if used.tolist() != expected:
        problems["exact_flags"] = used.tolist()
    amax = q.float().abs().flatten(1).amax(1)
    want_e = torch.floor(torch.log2(amax.nan_to_num(0))).int()
    for i in range(n):
        if expected[i] and int(qexp[i]) != int(want_e[i]):
            problems["exponents"].append([i, int(qexp[i]), int(want_e[i])])
        if expected[i]:
            ref = (q[i].float() * 2.0 ** (7 - int(qexp[i]))).to(torch.float8_e4m3fn).view(torch.uint8)
            if not torch.equal(q8[i, :h], ref):
                problems["codes"].append(i)
            back = q8[i, :h].view(torch.float8_e4m3fn).float() * 2.0 ** (int(qexp[i]) - 7)
            if not torch.equal(back, q[i].float()):
                problems["codes"].append([i, "not exact"])
    if bool(q8[:, h:].any()):
        problems["padded_heads"] = ["nonzero codes"]
    print(json.dumps(problems))


if __name__ == "__main__":
    main()
