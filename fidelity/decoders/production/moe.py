"""The mixture of experts of one layer (spec §4): the gate (sqrt-softplus scores with a routing bias, or hash
routing), the routed experts in ascending expert id, the shared expert, their fp32 sum rounded to bf16."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.registry import implementation
from fidelity.decoders.production.shapes import plain
from fidelity.decoders.production.sublayer import BF16, Model, Session, SubLayer
from fidelity.model.sites import SITE


class MoE(SubLayer):
    """Layer i's MoE, the gate's weights resolved when built; the shared expert's GEMM weights by name (read as
    stored on the GEMV path), the routed experts read per use through the model (a release-sized model's would
    not fit dequantized). Its methods take the sequence's session ``s`` (recorder, decode policy)."""

    def __init__(self, model: Model, i: int):
        super().__init__(model, i)
        p, w = f"layers.{i}.ffn.", model.w
        self.hashed = self.cfg.is_hash_layer(i)
        self.gate_weight, self.gate_fp32 = w(p + "gate.weight"), model.w_as(p + "gate.weight", torch.float32)
        self.bias = None if self.hashed else w(p + "gate.bias")
        self.tid2eid = w(p + "gate.tid2eid") if self.hashed else None
        self.shared = tuple(f"{p}shared_experts.{m}.weight" for m in ("w1", "w2", "w3"))
        self.prefix = p + "experts."

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routed expert e's (w1, w2, w3) as ``ProductionModel.w`` reads them."""
        w, q = self.model.w, f"{self.prefix}{e}."
        return w(q + "w1.weight"), w(q + "w2.weight"), w(q + "w3.weight")

    def __call__(self, s: Session, h: torch.Tensor | Fp8Input, ids: torch.Tensor) -> torch.Tensor:
        """h: the ffn norm's output [n, dim] -> bf16 [n, dim], as the session's decode policy picks the experts
        (``s.decode.moe``: :meth:`forward`, or graph decode's device-side picks)."""
        return s.decode.moe(self, s, h, ids)

    def route(self, s: Session, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate: (routing weights [n, k] fp32, expert ids [n, k])."""
        cfg, hashed = self.cfg, self.hashed
        weights, experts = self.op("gate")(x.float(), self.gate_fp32, self.bias,
                                           _tid2eid(self.tid2eid) if hashed else None, ids, cfg)
        if on("routing-bias-in-weights") and not hashed:
            weights = _biased_weights(x, self.gate_weight, self.bias, experts, cfg.route_scale)
        if not hashed:
            s.emit(SITE.moe_scores, self.i, lambda: _selection_scores(x, self.gate_weight, self.bias))
        s.emit(SITE.moe_experts, self.i, experts)
        s.emit(SITE.moe_weights, self.i, weights)
        return weights, experts

    def shared_expert(self, h: torch.Tensor | Fp8Input) -> torch.Tensor:
        """The shared expert's output bf16 [n, dim]."""
        w1, w2, w3 = self.shared
        stored = h.shape[0] <= ops.GEMV_ROWS and self.profile.gemm_act == "fp8"
        pair = self.model.stacked_gemv_weight((w1, w3)) if stored else None

        linear = self.linear
        if pair is not None:  # w1 and w3 in one FP8 GEMV over their stacked rows (expert_cuda uses it)
            def linear(x, w, act):
                return self.linear(x, w, act)

            linear.pair = lambda x, act: self.op("fp8_weight_linear")(
                x.xq if isinstance(x, Fp8Input) else x, *pair, act).split(pair[0].shape[0] // 2, dim=-1)
        return self.op("expert")(h, w1, w2, w3, self.cfg.swiglu_limit, None, self.profile.gemm_act, linear)

    def forward(self, s: Session, h: torch.Tensor | Fp8Input, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts in ascending expert id, then the shared expert; fp32 sum -> bf16 [n, dim]. h: the ffn
        norm's output (an :class:`Fp8Input` under a fused profile, which the experts' first GEMMs read). A few
        tokens on a GPU read the FP4 experts as stored (:meth:`routed_on_stored`), more tokens too, in one grouped
        GEMM per weight (:meth:`routed_grouped`)."""
        cfg, act, x = self.cfg, self.profile.gemm_act, plain(h)
        weights, experts = self.route(s, x, ids)
        few = x.shape[0] <= ops.GEMV_ROWS
        stacks = self.model.stored_experts(self.i) if not few or act == "fp8" else None
        if stacks is not None:
            routed = self.routed_on_stored if few else self.routed_grouped
            return moe_sum(routed(h, weights, experts, stacks), self.shared_expert(h))
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        expert = self.op("expert")
        for e, rows, slot in by_expert(experts):
            y[rows] += expert(h[rows], *self.expert(e), cfg.swiglu_limit, weights[rows, slot, None], act,
                              self.linear).float()
        y += self.shared_expert(h).float()
        return y.to(BF16)

    def picked_on_device(self, s: Session, h: torch.Tensor | Fp8Input, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for one token with no host read of its expert ids (graph decode): each routed expert's
        weights taken on the device from the model's per-layer stack (``ProductionModel.expert_stack``), in
        ascending expert id as the eager loop adds them."""
        cfg, act, x = self.cfg, self.profile.gemm_act, plain(h)
        weights, experts = self.route(s, x, ids)
        w1, w2, w3 = self.model.expert_stack(self.i)
        expert = self.op("expert")
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        order = experts[0].argsort()  # the eager session's ascending expert ids (a token's experts are distinct)
        for k in range(experts.shape[1]):
            slot = order[k : k + 1]
            e = experts[0].index_select(0, slot)
            y += expert(h, take(w1, e), take(w2, e), take(w3, e), cfg.swiglu_limit,
                        weights.index_select(1, slot), act, self.linear).float()
        y += self.shared_expert(h).float()
        return y.to(torch.bfloat16)

    def routed_on_stored(self, h: torch.Tensor | Fp8Input, weights: torch.Tensor, experts: torch.Tensor,
                         stacks) -> torch.Tensor:
        """The routed experts of a few tokens [n, k] on the stored FP4 weights (op ``fp4_picked_linear``: the
        expert ids stay on the device, no weight is copied): each token's expert outputs bf16 [n, k, dim] in
        ascending expert id, the order :meth:`forward` adds them in. No host sync (graph decode runs it too)."""
        n, k = experts.shape
        picked, order = experts.sort(dim=1)  # a token's k expert ids are distinct: no ties to order
        picked = picked.flatten()
        slot_weights = weights.gather(1, order).flatten()[:, None]
        hs = _repeat_rows(h, k)

        w1, w2, w3, w13 = stacks
        picked_linear = self.op("fp4_picked_linear")

        def linear(x, w, act):
            return picked_linear(x.xq if isinstance(x, Fp8Input) else x, picked, *w, act)

        # w1 and w3 in one launch over their stacked rows (expert_cuda uses it). ``pair`` becomes an attribute of
        # ``linear`` and must not refer to it: that cycle kept each call's expert ids until a gc pass
        def pair(x, act):
            out = picked_linear(x.xq if isinstance(x, Fp8Input) else x, picked, *w13, act)
            return out.split(w1[0].shape[1], dim=-1)

        linear.pair = pair
        out = self.op("expert")(hs, w1, w2, w3, self.cfg.swiglu_limit, slot_weights, self.profile.gemm_act, linear)
        return out.unflatten(0, (n, k))

    def routed_grouped(self, h: torch.Tensor | Fp8Input, weights: torch.Tensor, experts: torch.Tensor,
                       stacks) -> torch.Tensor:
        """The routed experts of many tokens [n, k] on the stored FP4 experts (op ``grouped_expert``: a handful of
        launches whatever the number of experts): each token's expert outputs bf16 [n, k, dim] in ascending expert
        id, the order :meth:`forward` adds them in."""
        picked, order = experts.sort(dim=1)  # a token's k expert ids are distinct: no ties to order
        xq = h.xq if isinstance(h, Fp8Input) else h
        return self.op("grouped_expert")(xq, weights.gather(1, order).float(), picked, *stacks[3], *stacks[1],
                                         self.cfg.swiglu_limit, self.profile.gemm_act, isinstance(h, Fp8Input))


def moe_sum(out: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Routed slot outputs bf16 [n, k, dim] and the shared expert's [n, dim] summed by op ``moe_sum`` (one launch
    on a GPU, the same bits as the emulation's loop)."""
    return implementation("moe_sum", out.device)(out, shared)


def by_expert(experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert id, rows, slots) for every expert picked in ``experts`` [n, k], ascending id; rows ascending, as
    ``torch.where(experts == e)`` gives them. One stable sort and one host read for all experts (not a
    ``torch.where`` and its host sync per expert)."""
    k = experts.shape[1]
    order = experts.flatten().argsort(stable=True)  # flat ids grouped by expert, row-major within each
    counts = torch.bincount(experts.flatten())
    picked = counts.nonzero().flatten()
    ids, sizes = torch.stack((picked, counts[picked])).tolist()
    groups, start = [], 0
    for e, size in zip(ids, sizes, strict=True):
        flat = order[start : start + size]
        groups.append((e, flat // k, flat % k))
        start += size
    return groups


def take(stack: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``stack[index[0]]`` (a copy) without reading the index on the host: op ``take`` for the stack's device."""
    return implementation("take", stack.device)(stack, index)


def _repeat_rows(h: torch.Tensor | Fp8Input, k: int) -> torch.Tensor | Fp8Input:
    """Each row of h [n, d] k times in a row [n k, d]: one token's as a stride-0 view (no copy; the GEMV kernels
    read it as it is), several tokens' copied."""
    if isinstance(h, Fp8Input):
        return Fp8Input(_repeat_rows(h.y, k), _repeat_rows(h.xq, k))
    return h.expand(k, -1) if h.shape[0] == 1 else h.repeat_interleave(k, dim=0)


def _tid2eid(table: torch.Tensor) -> torch.Tensor:
    """The hash-routing table as the gate reads it (fault ``tid2eid-bf16``: cast through bf16, as a blanket
    weight-dtype conversion does; ids above 256 move to a bf16 neighbour)."""
    return table.to(BF16).to(table.dtype) if on("tid2eid-bf16") else table


def _selection_scores(x, gate_w, bias) -> torch.Tensor:
    """fp32 [n, n_routed]: the sqrt-softplus gate scores plus the routing bias, what the top-k selects from."""
    return torch.nn.functional.softplus(ops.rows_mm(x.float(), gate_w.float().T)).sqrt() + bias


def _biased_weights(x, gate_w, bias, experts, route_scale) -> torch.Tensor:
    """Fault ``routing-bias-in-weights``: weights gathered from the biased scores."""
    w = _selection_scores(x, gate_w, bias).gather(1, experts)
    return w / w.sum(-1, keepdim=True) * route_scale
