"""The MoE gate after its GEMM in one launch (spec §4 ``Gate``, ``score_func = "sqrtsoftplus"``): scores
``sqrt(softplus(logits))`` in fp32, the top-k of ``scores + bias`` (or ``tid2eid[token]`` on hash layers), the picked
unbiased scores divided by their sum and scaled by ``route_scale``.

The logits come from the emulation's own fp32 GEMM; softplus takes torch's form (``x > 20 ? x : log1p(expf(x))``
with libdevice's ``log1p`` / ``expf``) and sqrt rounds correctly, so the scores are torch's; the sum of the k picks
may add in another order (the ``gate`` contract's fp32 tolerance). Experts come out in top-k order (descending
``scores + bias``, the lower id first on a tie). One launch replaces the emulation's nine kernels after the GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fidelity.decoders.production.kernels._common import (
    INTERPRET,
    PDL_LAUNCH,
    UNSUPPORTED,
    next_pow2,
    on_device,
    wait_for_previous_kernel,
)


@triton.jit
def _sqrt_softplus(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        sp = libdevice.log1p(libdevice.exp(x))
    else:  # Triton's CPU interpreter has no libdevice
        sp = tl.log(1.0 + tl.exp(x))
    return tl.sqrt_rn(tl.where(x > 20.0, x, sp))


@triton.jit
def _gate_kernel(l_ptr, b_ptr, t_ptr, ids_ptr, w_ptr, e_ptr, n_experts, route_scale, K: tl.constexpr,
                 EP: tl.constexpr, KP: tl.constexpr, BIAS: tl.constexpr, HASH: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    """Token pid0: logits [n_experts] -> routing weights [K] fp32 and expert ids [K] int64."""
    wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, EP)
    ok = cols < n_experts
    slots = tl.arange(0, KP)
    score = _sqrt_softplus(tl.load(l_ptr + row * n_experts + cols, mask=ok, other=0.0), LIBDEVICE)
    if HASH:
        token = tl.load(ids_ptr + row).to(tl.int64)
        experts = tl.load(t_ptr + token * K + slots, mask=slots < K, other=0).to(tl.int32)
    else:
        choice = score
        if BIAS:
            choice = choice + tl.load(b_ptr + cols, mask=ok, other=0.0)
        choice = tl.where(ok, choice, float("-inf"))
        experts = tl.zeros([KP], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.argmax(choice, 0, tie_break_left=True)
            experts = tl.where(slots == j, best, experts)
            choice = tl.where(cols == best, float("-inf"), choice)
    hit = cols[None, :] == experts[:, None]
    picked = tl.where(slots < K, tl.sum(tl.where(hit, score[None, :], 0.0), axis=1), 0.0)  # exact: one term
    weights = tl.math.div_rn(picked, tl.sum(picked, axis=0)) * route_scale
    tl.store(w_ptr + row * K + slots, weights, mask=slots < K)
    tl.store(e_ptr + row * K + slots, experts.to(tl.int64), mask=slots < K)


def takes_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
               ids: torch.Tensor, cfg) -> str | None:
    """Why :func:`gate_cuda` cannot take these inputs (None: it can): sqrt-softplus scores, fp32 x, <= 1024
    experts."""
    if cfg.score_func != "sqrtsoftplus" or not on_device(x) or x.dtype != torch.float32 or cfg.n_routed_experts > 1024:
        return UNSUPPORTED
    return None


def gate_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              ids: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature as ``ops.gate``: x fp32 [n, dim] -> (routing weights fp32 [n, k], expert ids int64 [n, k])."""
    n, k, n_experts = x.shape[0], cfg.n_activated_experts, cfg.n_routed_experts
    logits = (x @ weight.to(x.dtype).T).contiguous()  # the emulation's GEMM
    weights = torch.empty((n, k), dtype=torch.float32, device=x.device)
    experts = torch.empty((n, k), dtype=torch.int64, device=x.device)
    if n:
        b = bias.to(torch.float32).contiguous() if bias is not None else logits
        table = tid2eid.contiguous() if tid2eid is not None else experts
        _gate_kernel[(n,)](logits, b, table, ids.contiguous(), weights, experts, n_experts, float(cfg.route_scale),
                           K=k, EP=next_pow2(n_experts), KP=next_pow2(k), BIAS=bias is not None,
                           HASH=tid2eid is not None, LIBDEVICE=not INTERPRET, num_warps=4, **PDL_LAUNCH)
    return weights, experts
