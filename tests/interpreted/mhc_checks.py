"""Checks of the mHC split-K finish kernels (``kernels/mhc.py``: ``_hc_finish_kernel``, ``_hc_head_finish_kernel``)
under Triton's CPU interpreter; run as ``TRITON_INTERPRET=1 python -m tests.interpreted.mhc_checks``
(``tests/test_mhc_interpreted.py`` does so). The mixes' partial kernel (tensor-core dots the interpreter does not
run) is stood in for by torch: each split's fp32 mixes and sum of squares, written where the kernel writes them, so
``hc_pre_cuda`` / ``hc_head_cuda`` run their finish launches on real partials, at the token counts of decode (a tile
of their own size, many splits summed a group at a time) and of prefill (the mix kernels' tile, split order).
Prints one JSON object: {check name: error text, empty when the check passed}."""

from __future__ import annotations

import json

import torch

from tests.interpreted import contract_error, index_through_item

index_through_item()

from fidelity.decoders.production.kernels import mhc  # noqa: E402


class TorchPartials:
    """``_hc_mix_partial_kernel[grid](...)`` in torch: ws[s, t, :MIXES] = x[t, cols_s] @ fn[:MIXES, cols_s]^T and
    ws[s, t, 32] = sum(x[t, cols_s]^2), cols_s the s-th slice of ``per`` columns of the flattened streams."""

    def __getitem__(self, grid):
        def launch(x, fn, ws, n, dim, per, stride_xn, *, MIXES, **_):
            flat = x.reshape(n, 4 * dim).float()
            for s in range(grid[1]):
                cols = slice(s * per, min((s + 1) * per, 4 * dim))
                ws[s, :, :MIXES] = flat[:, cols] @ fn[:MIXES, cols].T
                ws[s, :, MIXES:32] = 0.0
                ws[s, :, 32] = flat[:, cols].square().sum(1)
        return launch


def split_hc_pre(*args):
    """``hc_pre_cuda`` over 16-column slices (a split launch and its finish at every width the cases draw)."""
    return mhc.hc_pre_cuda(*args, bk=16)


def split_hc_head(*args):
    return mhc.hc_head_cuda(*args, bk=16)


def _contract(op: str, fn) -> str:
    return contract_error(op, fn, 25)


def _groups_differ(g: torch.Generator) -> str:
    """Decode (3 tokens, 64 splits: one load of the splits a tile) against the same inputs finished by the prefill
    tile (the 3 tokens inside 16 masked ones, split order): the same values within fp32 summation order."""
    x = torch.randn(3, 4, 256, generator=g).to(torch.bfloat16)
    fn = torch.randn(24, 1024, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g), torch.randn(24, generator=g) * 0.1
    decode = mhc.hc_pre_cuda(x, fn, scale, base, 1e-6, 20, 1e-6, precision="ieee", splits=64)
    prefill = mhc.hc_pre_cuda(x, fn, scale, base, 1e-6, 20, 1e-6, precision="ieee", splits=64, bt=2)
    bad = [name for name, a, b in zip(("y", "pre", "post", "comb"), decode, prefill, strict=True)
           if not torch.allclose(a.float(), b.float(), rtol=2e-6 if a.dtype == torch.float32 else 2**-7, atol=1e-6)]
    return ", ".join(bad)


def main() -> dict[str, str]:
    mhc._hc_mix_partial_kernel = TorchPartials()
    g = torch.Generator().manual_seed(0)
    return {"hc_pre_split_finish_contract": _contract("hc_pre", split_hc_pre),
            "hc_head_split_finish_contract": _contract("hc_head", split_hc_head),
            "decode_and_prefill_finish_agree": _groups_differ(g)}


if __name__ == "__main__":
    print(json.dumps(main()))
