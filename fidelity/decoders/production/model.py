"""ProductionModel: the decoder under test, with the official numerics selected by a precision profile.

Mirrors the official ``model.py`` control flow (spec §4-§5): a prefill, then one token per decode step (the
prefill may also come in chunks, an extension the official model lacks, computed as the whole prefill); the
window is a ring buffer written before attention; compressors carry fp32 state; caches are allocated once from
``max_context``. Emits the same sites as the oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fidelity.decoders.base import ContextError
from fidelity.decoders.production import kernels, ops
from fidelity.decoders.production.cache import KeyStore, LayerCache
from fidelity.decoders.production.call_counts import Counts, counting
from fidelity.decoders.production.compressor import CompressorWeights, compress_decode, compress_prefill
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.profiles import Profile, get_profile
from fidelity.decoders.production.registry import implementation
from fidelity.decoders.production.rope_freqs import rope_inv_freq
from fidelity.decoders.production.topk import stable_topk, topk_width
from fidelity.model.formats import decode_e8m0, hadamard
from fidelity.model.sites import MHC_SITES, Recorder, record
from fidelity.model.weights import fp32_nbytes

BF16 = torch.bfloat16
QUERY_CHUNK = 512  # prefill attention / indexer queries per pass (bounds temporaries, not results)
KEEP_ALL_BYTES = 16 << 30  # models up to this size in fp32 keep every dequantized weight


class ProductionModel:
    """The production decoder over a checkpoint; ``session()`` allocates the caches."""

    def __init__(self, checkpoint, profile: str | Profile = "reference", max_context: int = 4096,
                 device: str | torch.device = "cpu"):
        self.ckpt, self.cfg = checkpoint, checkpoint.config
        self.profile = get_profile(profile)
        if max_context < 1:
            raise ValueError(f"max_context: expected >= 1, found {max_context}")
        self.max_context, self.device = max_context, torch.device(device)
        self.freqs = {r: rope_inv_freq(self.cfg, r).to(self.device) for r in {0, *self.cfg.compress_ratios}}
        self._weights: dict[str, torch.Tensor] = {}
        self._expert_stacks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._gemv: dict[str, object] = {}  # stored forms the decode GEMVs read (None: that path does not run)
        # a release-sized model's routed experts would not fit dequantized: they are dequantized at each use
        self.keep_experts = fp32_nbytes(self.cfg) <= KEEP_ALL_BYTES

    def w(self, name: str) -> torch.Tensor:
        """Weight as the production path reads it: FP8/FP4 dequantized exactly to fp32, bf16/fp32 as stored."""
        t = self._weights.get(name)
        if t is None:
            t = self.ckpt[name].to(self.device)
            if self.keep_experts or ".ffn.experts." not in name:
                self._weights[name] = t
        return t

    def w_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``w(name).to(dtype)``, converted once and kept (e.g. wo_a for its bf16 einsum)."""
        key = f"{name}:{dtype}"
        t = self._weights.get(key)
        if t is None:
            t = self._weights[key] = self.w(name).to(dtype)
        return t

    def gemv_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8-stored weight as the decode GEMV reads it: (e4m3 codes [out, in], 128x128 scales decoded to fp32),
        kept on the device; None where that path does not run (no GPU kernels here, or the checkpoint does not
        store this weight in FP8)."""
        if name not in self._gemv:
            st = self.ckpt.stored(name) if self._gemv_ready() else None
            ok = st is not None and st.fmt == "fp8" and st.data.shape[1] % 128 == 0
            self._gemv[name] = (st.data.to(self.device), decode_e8m0(st.scale.to(self.device))) if ok else None
        return self._gemv[name]

    def stacked_gemv_weight(self, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP8-stored weights ``names`` with the same input width as one weight for the decode GEMV (codes and
        decoded 128x128 scales stacked along the rows; each weight's rows a multiple of 128, so no scale block
        straddles two weights), kept on the device; None where :meth:`gemv_weight` would give None for one of them
        or a row count is not a multiple of 128."""
        key = "+".join(names)
        if key not in self._gemv:
            parts = [self.gemv_weight(n) for n in names]
            ok = all(p is not None and p[0].shape[0] % 128 == 0 for p in parts)
            self._gemv[key] = tuple(torch.cat(t) for t in zip(*parts, strict=True)) if ok else None
            for n in names if ok else ():  # the stacked copy serves these weights from now on
                self._gemv.pop(n, None)
        return self._gemv[key]

    def stacked_bf16(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """The bf16-stored weights ``names`` as one [sum of rows, in] bf16 tensor on the device, for one decode GEMV
        over all of them (op ``fp32_linear``: a layer's weights that read the attention input,
        ``ProductionSession.input_projection``); None where that path does not run (no GPU kernels, or a weight not
        stored in bf16)."""
        key = "+".join(names)
        if key not in self._gemv:
            stored = [self.ckpt.stored(n) for n in names] if self._gemv_ready() else None
            ok = stored is not None and all(st.data.dtype == torch.bfloat16 for st in stored)
            self._gemv[key] = torch.cat([st.data for st in stored]).to(self.device) if ok else None
        return self._gemv[key]

    def input_stack(self, i: int) -> tuple[torch.Tensor, tuple[str, ...], list[int]] | None:
        """Layer i's bf16 weights that read the attention input (``_input_weights``) stacked for one GEMV, with their
        names in stacking order and their row counts (the output's split sizes), kept; None where that path does not
        run (no such weight, no GPU kernels, or one not stored in bf16)."""
        key = f"input stack {i}"
        if key not in self._gemv:
            names = _input_weights(i, self.cfg.ratio(i))
            stacked = self.stacked_bf16(names) if names else None
            self._gemv[key] = None if stacked is None else (stacked, names, self.rows(names))
        return self._gemv[key]

    def rows(self, names: tuple[str, ...]) -> list[int]:
        """The stored row counts (output widths) of the weights ``names``."""
        return [self.ckpt.stored(n).data.shape[0] for n in names]

    def stored_experts(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
        """Layer i's routed experts as stored, for ``fp4_picked_linear`` / ``grouped_expert``: ((packed codes uint8
        [E, out, in/2], 1x32 scales as stored: e8m0 bytes uint8 [E, out, in/32], which the kernels make into fp32
        powers of two) for w1, w2, w3, then w1 and w3 stacked [E, 2 out, ...]), kept on the device once; w1 and w3
        are views of the stacked pair (one launch can run both). None where that path does not run (no GPU kernels,
        or experts not stored in FP4)."""
        key = f"layers.{i}.experts:fp4"
        if key not in self._gemv:
            stacks = None
            if self._gemv_ready():
                names = [[f"layers.{i}.ffn.experts.{e}.{m}.weight" for e in range(self.cfg.n_routed_experts)]
                         for m in ("w1", "w2", "w3")]
                stored = [[self.ckpt.stored(n) for n in group] for group in names]
                if all(st.fmt == "fp4" for group in stored for st in group):
                    stacks = [(torch.stack([st.data.view(torch.uint8).to(self.device) for st in group]),
                               torch.stack([_e8m0_bytes(st.scale, name).to(self.device)
                                            for st, name in zip(group, group_names, strict=True)]))
                              for group, group_names in zip(stored, names, strict=True)]
                    n = stacks[0][0].shape[1]
                    w13 = tuple(torch.cat((a, b), dim=1) for a, b in zip(stacks[0], stacks[2], strict=True))
                    stacks = ((w13[0][:, :n], w13[1][:, :n]), stacks[1], (w13[0][:, n:], w13[1][:, n:]), w13)
            self._gemv[key] = stacks
        return self._gemv[key]

    def _gemv_ready(self) -> bool:
        return self.device.type == "cuda" and kernels.available()

    def session(self, recorder: Recorder | None = None) -> ProductionSession:
        return ProductionSession(self, recorder)

    def expert_stack(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's routed experts' (w1, w2, w3) stacked [n_routed, out, in] as ``w`` reads them, so that a
        device-side expert id picks the weights (graph decode). Built once per layer, not through ``w``'s
        cache."""
        stack = self._expert_stacks.get(i)
        if stack is None:
            names = [[f"layers.{i}.ffn.experts.{e}.{m}.weight" for e in range(self.cfg.n_routed_experts)]
                     for m in ("w1", "w2", "w3")]
            stack = self._expert_stacks[i] = tuple(
                torch.stack([self.ckpt[n].to(self.device) for n in group]) for group in names)
        return stack

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, recorder: Recorder | None = None) -> torch.Tensor:
        """One prefill of input_ids [T] -> fp32 logits [T, vocab]."""
        return self.session(recorder).prefill(input_ids)


class ProductionSession:
    """Caches for one sequence; ``prefill`` once, then ``step`` per token."""

    head_rows_free = True  # a prefill whose caller reads the last row may run the head on fewer rows (not a pipeline)

    def __init__(self, model: ProductionModel, recorder: Recorder | None = None, own: range | None = None):
        """``own``: the layers this session runs and holds caches for (default: all; a pipeline stage: its range)."""
        self.model, self.cfg, self.profile, self.rec = model, model.cfg, model.profile, recorder
        self.own = range(self.cfg.n_layers) if own is None else own
        self.layers = [LayerCache(self.cfg, i, self.profile, model.max_context, model.device) if i in self.own else None
                       for i in range(self.cfg.n_layers)]
        self.pos = 0
        self.calls = 0
        self.kept: list[torch.Tensor] = []  # only the ``decode-buffer-kept`` fault ever appends here
        self.in_prefill = False  # a prefill (chunk) takes the prefill paths, even for one token
        self.last_only = False  # this prefill's caller reads its last row's logits alone (``prefill``)
        self.key_range_end: int | None = None  # only the ``batch-key-range`` fault reads it
        self.counts: Counts = {}  # this session's implementations, kernel fallbacks and routes (call_counts)
        self.res_dtypes = [torch.float32 if self.profile.residual_fp32(i) else BF16 for i in range(self.cfg.n_layers)]
        self.fused = self.profile.norm_fusion == "fused"
        # weight name -> its product with this layer call's input, made in one launch with other weights reading the
        # same input before its reader asks (``stacked_linears``, ``input_projection``); emptied after ``attn_core``
        self._made: dict[str, torch.Tensor] = {}

    def emit(self, template: str, layer: int | None, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Record ``tensor`` at the site ``template`` of ``layer`` (None outside the layers) if the recorder wants
        it (a callable is evaluated only then)."""
        record(self.rec, template, layer, tensor)

    def op(self, name: str):
        """The registered implementation of op ``name`` for this session's device (registry.implementation)."""
        return implementation(name, self.model.device)

    def cache_bytes(self) -> int:
        return sum(sum(c.nbytes().values()) for c in self.layers if c is not None)

    # ---- public ----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Prompt tokens at positions pos.. -> logits [n, vocab]. The official model prefills once at position 0;
        here a prompt may also come in chunks (each continues at ``pos``), computed as the whole prefill computes
        them (up to the rounding of GEMMs over a different number of rows). ``last_only``: the caller reads the last
        row alone, returned as [1, vocab]; the head then multiplies only that row and those the recorder keeps of
        ``logits`` (:meth:`logit_rows`), as the official prefill reads the last position alone."""
        ids = self._check(input_ids, prefill=True)
        self.in_prefill, self.last_only = True, last_only
        try:
            logits = self._run(ids, torch.arange(self.pos, self.pos + len(ids), device=self.model.device))
        finally:
            self.in_prefill = self.last_only = False
        return logits[-1:] if last_only else logits

    @torch.no_grad()
    def step(self, token_id: int | torch.Tensor) -> torch.Tensor:
        ids = self._check(torch.as_tensor([int(token_id)]), prefill=False)
        return self._run(ids, torch.tensor([self.pos], device=self.model.device))[0]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode token after a prefill, else a prefill (chunk)."""
        ids = torch.as_tensor(input_ids).flatten()
        if self.pos == 0 or len(ids) > 1:
            return self.prefill(ids)
        return self.step(ids[0])[None]

    def _check(self, input_ids: torch.Tensor, prefill: bool, to_device: bool = True) -> torch.Tensor:
        """The ids [n] checked (count, position, context, vocabulary), on the model's device unless not
        ``to_device``."""
        ids = torch.as_tensor(input_ids).long().flatten()
        n, vocab = ids.numel(), self.cfg.vocab_size
        if n == 0:
            raise ValueError("input_ids: expected at least one token, found 0")
        if not prefill and (self.pos == 0 or n != 1):
            raise ValueError(f"decode: expected one token after a prefill, found {n} token(s) at position {self.pos}")
        if self.pos + n > self.model.max_context:
            raise ContextError(f"context: {self.pos} + {n} tokens exceeds max_context {self.model.max_context}; "
                               "build the model with a larger max_context")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"input_ids: expected ids in [0, {vocab}), found [{int(ids.min())}, {int(ids.max())}]")
        return ids.to(self.model.device) if to_device else ids

    def _run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rec is not None:
            self.rec.step = self.calls
        with counting(self.counts):
            logits = self._forward(ids, positions)
        self.pos += len(ids)
        self.calls += 1
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [n] at positions [n] (device tensors) -> fp32 logits [n, vocab]; updates the caches, not ``pos``."""
        x = self.embed(ids)
        for i in range(self.cfg.n_layers):
            x = self.block(i, x, positions, ids)
        return self.head(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> the mHC streams entering layer 0 [n, hc, dim] (the embedding repeated, layer 0's dtype)."""
        x = self.model.w("embed.weight")[ids].to(BF16)
        self.emit("embed", None, x)
        return x.unsqueeze(1).repeat(1, self.cfg.hc_mult, 1).to(self.res_dtypes[0])

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The streams leaving the last layer [n, hc, dim] -> fp32 logits [n, vocab] (hc_head, norm, LM head); in a
        prefill read at its last row, [len(rows), vocab] of :meth:`logit_rows` alone."""
        w, cfg = self.model.w, self.cfg
        y = self.op("hc_head")(x, w("hc_head_fn"), w("hc_head_scale"), w("hc_head_base"), cfg.norm_eps,
                               cfg.hc_eps)
        y = self.op("rms_norm")(y, w("norm.weight"), cfg.norm_eps)
        self.emit("final", None, y)
        rows = self.logit_rows(len(y)) if self.last_only and self.head_rows_free else None
        logits = (y if rows is None else y.index_select(0, rows)).float() @ self.model.w_as("head.weight",
                                                                                             torch.float32).T
        if rows is None:
            self.emit("logits", None, logits)
        elif self.rec is not None and self.rec.wants("logits"):  # the kept rows come first, the last row last
            self.rec("logits", logits[: len(self.rec.kept_rows("logits"))], kept=True)
        return logits

    def logit_rows(self, n: int) -> torch.Tensor | None:
        """The rows of a call's n whose logits are read when the caller takes the last row alone: those the recorder
        keeps of ``logits`` (``Recorder.kept_rows``), then the last row if not among them; None where the recorder
        keeps every row."""
        kept = torch.zeros(0, dtype=torch.long)
        if self.rec is not None and self.rec.wants("logits"):
            kept = self.rec.kept_rows("logits")
            if kept is None:
                return None
        kept = kept.cpu()
        rows = kept if len(kept) and int(kept[-1]) == n - 1 else torch.cat((kept, torch.tensor([n - 1])))
        return rows.to(self.model.device)

    # ---- one block ---------------------------------------------------------------------------
    def block(self, i: int, x: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w = self.model.w
        y, post, comb = self.mhc_pre(i, "attn", x)
        h = self.norm(y, w(f"layers.{i}.attn_norm.weight"))
        self.emit("L{i}.attn.in", i, _plain(h))
        f = self.attention(i, h, positions)
        self.emit("L{i}.attn.out", i, f)
        x = self.op("hc_post")(f, x, post, comb, self.res_dtypes[i])
        y, post, comb = self.mhc_pre(i, "ffn", x)
        h = self.norm(y, w(f"layers.{i}.ffn_norm.weight"))
        self.emit("L{i}.moe.in", i, _plain(h))
        f = self.moe(i, h, ids)
        self.emit("L{i}.moe.out", i, f)
        x = self.op("hc_post")(f, x, post, comb, self.res_dtypes[i])
        self.emit("L{i}.residual", i, x)
        return x

    def mhc_pre(self, i: int, which: str, x: torch.Tensor):
        w, cfg, p = self.model.w, self.cfg, f"layers.{i}.hc_{which}_"
        y, pre, post, comb = self.op("hc_pre")(x, w(p + "fn"), w(p + "scale"), w(p + "base"), cfg.norm_eps,
                                               cfg.hc_sinkhorn_iters, cfg.hc_eps)
        self.emit(MHC_SITES[which, "pre"], i, pre)
        self.emit(MHC_SITES[which, "post"], i, post)
        self.emit(MHC_SITES[which, "comb"], i, comb)
        return y, post, comb

    # ---- norms and the GEMMs they feed ---------------------------------------------------------
    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | Fp8Input:
        """RMSNorm of a GEMM input [n, d]: bf16 y (op ``rms_norm``), or under ``norm_fusion = "fused"`` with FP8
        GEMM inputs an :class:`Fp8Input` (op ``rms_norm_act_quant``: y and its FP8 GEMM input from one kernel)."""
        if not (self.fused and self.profile.gemm_act == "fp8"):
            return self.op("rms_norm")(x, weight, self.cfg.norm_eps)
        return Fp8Input(*self.op("rms_norm_act_quant")(x, weight, self.cfg.norm_eps))

    def linear(self, x: torch.Tensor | Fp8Input, weight: str | torch.Tensor, act: str | None = None) -> torch.Tensor:
        """An FP8/FP4 GEMM (``act_linear``'s signature; ``act`` defaults to the profile's) on a weight tensor or a
        weight's name. A named FP8 weight multiplying at most ``ops.GEMV_ROWS`` rows with FP8 activations is read
        as stored (op ``fp8_weight_linear``: codes and block scales, where the model holds them; on a GPU). An
        :class:`Fp8Input` is otherwise multiplied as already quantized (``ops.quantized_linear``), a tensor through
        op ``act_linear``."""
        act = act or self.profile.gemm_act
        if isinstance(weight, str):
            stored = self.model.gemv_weight(weight) if x.shape[0] <= ops.GEMV_ROWS and act == "fp8" else None
            if stored is not None:
                return self.op("fp8_weight_linear")(x.xq if isinstance(x, Fp8Input) else x, *stored, act)
            weight = self.model.w_as(weight, torch.float32)  # FP8 / FP4 read as fp32 already; bf16 converted once
        if isinstance(x, Fp8Input):
            return ops.quantized_linear(x.xq, weight)
        return self.op("act_linear")(x, weight, act)

    def kv_path(self, x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                freqs: torch.Tensor) -> torch.Tensor:
        """The wkv output [n, hd] -> window KV [n, hd] bf16: kv_norm, RoPE, the FP8 round of the nope dims; one op
        (``kv_norm_rope_fp8``) under ``norm_fusion = "fused"``, else the reference's three."""
        cfg, fmt = self.cfg, self.profile.kv_nope
        if self.fused:
            return self.op("kv_norm_rope_fp8")(x, weight, cfg.norm_eps, positions, freqs, fmt,
                                               self.profile.kv_scale_floor)
        kv = self.op("apply_rope")(self.op("rms_norm")(x, weight, cfg.norm_eps), positions, freqs)
        return self.op("kv_round")(kv, cfg.rope_head_dim, fmt, self.profile.kv_scale_floor)

    # ---- attention ---------------------------------------------------------------------------
    def attention(self, i: int, h: torch.Tensor | Fp8Input, positions: torch.Tensor) -> torch.Tensor:
        """h: the attention norm's output [n, dim] (an :class:`Fp8Input` under a fused profile) -> bf16 [n, dim]:
        the projections (:meth:`attn_project`), this sequence's caches (:meth:`attn_core`), the output
        projection (:meth:`attn_out`). A batched forward (``batch.forward_batch``) runs the first and last over
        every sequence's rows and the core per sequence."""
        qr, q, kv = self.attn_project(i, h, positions)
        o = self.attn_core(i, _plain(h), qr, q, kv, positions)
        return self.attn_out(i, o, positions)

    def rope_freqs(self, i: int, device: torch.device) -> torch.Tensor:
        """Layer i's RoPE inverse frequencies (fault ``yarn-on-swa``: the compressed layers' YaRN ones on SWA)."""
        ratio = self.cfg.ratio(i)
        if ratio == 0 and on("yarn-on-swa"):
            return rope_inv_freq(self.cfg, 4).to(device)
        return self.model.freqs[ratio]

    def attn_project(self, i: int, h: torch.Tensor | Fp8Input, positions: torch.Tensor):
        """Rows [n] at their positions -> (qr [n, q_lora] (an :class:`Fp8Input` under a fused profile), q [n,
        heads, hd] after RoPE, window kv [n, hd] bf16); no cache is read or written."""
        w, cfg, pre = self.model.w, self.cfg, f"layers.{i}.attn."
        freqs = self.rope_freqs(i, positions.device)
        a, kv_in = self.stacked_linears(h, (pre + "wq_a.weight", pre + "wkv.weight"))
        qr = self.norm(a, w(pre + "q_norm.weight"))
        if cfg.ratio(i) == 4:  # the indexer's wq_b reads qr too: stacked with wq_b, its product kept for index_query
            q, index_q = self.stacked_linears(qr, (pre + "wq_b.weight", pre + "indexer.wq_b.weight"), lazy=1)
            if index_q is not None:
                self._made[pre + "indexer.wq_b.weight"] = index_q
        else:
            q = self.linear(qr, pre + "wq_b.weight")
        q = q.unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = self.op("apply_rope")(self.op("rms_norm_weightless")(q, cfg.norm_eps), positions, freqs)
        kv = self.kv_path(kv_in, w(pre + "kv_norm.weight"), positions, freqs)
        self.emit("L{i}.attn.q", i, q)
        self.emit("L{i}.attn.kv", i, kv)
        return qr, q, kv

    def stacked_linears(self, x: torch.Tensor | Fp8Input, names: tuple[str, ...], lazy: int | None = None
                        ) -> tuple[torch.Tensor | None, ...]:
        """x @ w^T for FP8-stored weights ``names`` that read the same x [n, in] -> one [n, out_w] tensor per name. A
        few rows with FP8 activations read them as stored in one ``fp8_weight_linear`` over their stacked rows (one
        launch instead of one each; within the op's contract, the k slices may differ from a GEMV of one weight),
        the output split at each weight's row count; else one :meth:`linear` each, except that names from index
        ``lazy`` on are then left to their reader (None)."""
        act = self.profile.gemm_act
        stacked = self.model.stacked_gemv_weight(names) if x.shape[0] <= ops.GEMV_ROWS and act == "fp8" else None
        if stacked is None:
            return tuple(self.linear(x, n) if lazy is None or k < lazy else None for k, n in enumerate(names))
        y = self.op("fp8_weight_linear")(x.xq if isinstance(x, Fp8Input) else x, *stacked, act)
        return tuple(y.split(self.model.rows(names), dim=-1))

    def attn_core(self, i: int, x: torch.Tensor, qr, q: torch.Tensor, kv: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """This sequence's attention at ``self.pos``: caches written (window ring, compressed entries, indexer
        keys) and read -> o [n, heads, hd] bf16 (before the inverse RoPE)."""
        try:
            if self.in_prefill:
                o = self.attend_prefill(i, x, qr, q, kv, positions)
            else:
                o = self.attend_decode(i, x, qr, q, kv, positions)
        finally:
            self._made = {}
        self.emit("L{i}.attn.core", i, o)
        return o

    def input_projection(self, i: int, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...] | None:
        """x [n, dim], layer i's attention input, times the bf16 weights ``names`` (of ``_input_weights``) -> fp32
        [n, out] each. For a few rows on the GEMV path every such weight of the layer goes through one
        ``fp32_linear`` over their stacked rows (one launch on a GPU) at the first ask of the call, the others' kept
        for their readers; None where that path does not run (more rows, no GPU kernels, a weight not stored in
        bf16)."""
        if x.shape[0] > ops.GEMV_ROWS:
            return None
        if names[0] not in self._made:
            stack = self.model.input_stack(i)
            if stack is None:
                return None
            stacked, order, rows = stack
            self._made.update(zip(order, self.op("fp32_linear")(x, stacked).split(rows, dim=-1), strict=True))
        return tuple(self._made.pop(n) for n in names)

    def attn_out(self, i: int, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o [n, heads, hd] -> bf16 [n, dim]: the inverse RoPE, the grouped wo_a, wo_b."""
        cfg, pre = self.cfg, f"layers.{i}.attn."
        if not on("no-inverse-rope"):
            o = self.op("apply_rope")(o, positions, self.rope_freqs(i, o.device), inverse=True)
        stored = self.model.gemv_weight(pre + "wo_a.weight") if o.shape[0] <= ops.GEMV_ROWS else None
        if stored is not None:  # the FP8-stored wo_a read as stored; bf16 o as given, as grouped_out
            o = self.op("fp8_weight_linear")(o.flatten(1), *stored, "bf16", cfg.o_groups)
        else:
            o = ops.grouped_out(o, self.model.w_as(pre + "wo_a.weight", BF16), cfg.o_groups)
        return self.linear(o, pre + "wo_b.weight")

    def compressor(self, i: int, index: bool, x: torch.Tensor | None = None):
        """(:class:`CompressorWeights`, fp32 carry, ratio, RoPE freqs) of layer i's main or indexer
        compressor; with this call's input x, its projections where :meth:`input_projection` gives them."""
        w, cache, ratio = self.model.w, self.layers[i], self.cfg.ratio(i)
        pre = f"layers.{i}.attn.indexer.compressor." if index else f"layers.{i}.attn.compressor."
        fp32 = torch.float32  # the compressor GEMMs run in fp32: the converted weights are kept
        projected = None if x is None else self.input_projection(i, x, (pre + "wkv.weight", pre + "wgate.weight"))
        weights = CompressorWeights(self.model.w_as(pre + "wkv.weight", fp32),
                                    self.model.w_as(pre + "wgate.weight", fp32), w(pre + "ape"), w(pre + "norm.weight"),
                                    projected)
        carry = cache.index_carry if index else cache.carry
        if on("compressor-no-used-length") and self.pos > 0:  # fault: no used length, so nothing carried over
            carry.kv.zero_()
            carry.score.fill_(float("-inf"))
        return weights, carry, 4 if index else ratio, self.model.freqs[ratio]

    def round_entries(self, entries: torch.Tensor, index: bool) -> torch.Tensor:
        """New compressed entries as their cache stores them: indexer keys Hadamard-rotated and rounded to the
        profile's format, main entries with FP8-rounded nope dims."""
        if not index:
            return self.op("kv_round")(entries, self.cfg.rope_head_dim, self.profile.kv_nope,
                                       self.profile.kv_scale_floor)
        rotate = self.profile.hadamard == "on" and not on("hadamard-q-only")
        entries = self.op("indexer_round")(entries, self.profile.indexer_qk, rotate)
        if on("indexer-key-width"):
            entries = entries.clone()
            entries[:, -self.cfg.rope_head_dim :] = 0
        return entries

    def compress(self, i: int, x: torch.Tensor, positions: torch.Tensor, index: bool) -> torch.Tensor | None:
        """New compressed entries (main: FP8-rounded nope dims; indexer: Hadamard + FP4), written to the caches."""
        cache = self.layers[i]
        weights, carry, ratio, freqs = self.compressor(i, index, x)
        if self.in_prefill:
            entries, first = compress_prefill(x, weights, carry, ratio, freqs, self.cfg.norm_eps, self.pos)
        else:
            entries, first = compress_decode(x, self.pos, weights, carry, ratio, freqs, self.cfg.norm_eps)
        if entries is None:
            return None
        entries = self.round_entries(entries, index)
        if index:
            stored = entries
            if self.in_prefill and on("indexer-key-stride"):
                stored = _at_kv_stride(entries, self.cfg.head_dim // self.cfg.index_head_dim)
            cache.keys.write(slice(first, first + len(entries)), stored)
        else:
            cache.kv.write(slice(cache.window + first, cache.window + first + len(entries)), entries)
        return entries

    def attend_prefill(self, i, x, qr, q, kv, positions) -> torch.Tensor:
        """A prefill chunk at positions start..start+t-1 (start = self.pos; 0 for the official prefill). The
        attention table holds the earlier window rows still needed (from the ring buffer), the chunk's rows, then
        every compressed entry so far; window indices point into it in position order."""
        cfg, cache = self.cfg, self.layers[i]
        ratio, win, t, start = cfg.ratio(i), cfg.window_size, len(positions), self.pos
        before = min(start, win - 1)  # earlier positions start-before .. start-1 that the chunk's window reaches
        earlier = cache.kv.read(torch.arange(start - before, start, device=kv.device) % win)
        tail = kv[-win:]
        slots = torch.arange(start + t - len(tail), start + t, device=kv.device) % win
        cache.kv.write(slots, tail)
        self.emit_kv_cache(i, kv, slots)
        table = torch.cat((earlier, kv)) if before else kv
        offset = len(table)
        comp = None
        if ratio:
            new = self.compress(i, x, positions, index=False)
            self.emit("L{i}.attn.compressed_kv", i, new if new is not None else kv.new_zeros((0, cfg.head_dim)))
            n_entries = (start + t) // ratio
            if n_entries:
                table = torch.cat((table, cache.kv.read(slice(win, win + n_entries))))
            comp = self.index_prefill(i, x, qr, positions) if ratio == 4 else \
                _hca_prefill_idx(t, ratio, start, x.device)
        idx = _window_prefill_idx(t, win, start, x.device)
        self.emit("L{i}.attn.visible", i, lambda: _visible(idx, comp, positions, win, prefill=True))
        rows = idx - (start - before)  # token positions -> table rows (a position before the table: none)
        idx = torch.where((idx >= 0) & (rows >= 0), rows, -1)
        if comp is not None:
            idx = torch.cat((idx, torch.where(comp >= 0, comp + offset, -1)), dim=1)
        sink, scale = self.model.w(f"layers.{i}.attn.attn_sink"), cfg.head_dim**-0.5
        attend = self.op("sparse_attention")
        fmha = self.profile.fmha
        return torch.cat([attend(q[s : s + QUERY_CHUNK], table, idx[s : s + QUERY_CHUNK], sink, scale, fmha)
                          for s in range(0, t, QUERY_CHUNK)])

    def attend_decode(self, i, x, qr, q, kv, positions) -> torch.Tensor:
        """One decode token at ``t = self.pos``. Every slot is gathered in place, a -1 slot as row 0, which the
        attention never reads, so no host sync sizes the gather; rows stored packed FP8 are attended in place
        (:meth:`attend_packed`) unless the profile rounds the FMHA inputs. The slots and the gathered rows go into the
        layer's preallocated ``slots`` / ``gather`` buffers (``LayerCache.decode_buffers``); what still allocates
        here is eager mode's small temporaries (masks, the FP8 dequantization), which graph decode replays without
        allocating."""
        cfg, cache = self.cfg, self.layers[i]
        slot = self.window_slot(cache.window)
        cache.kv.write(slot, kv)
        self.emit_kv_cache(i, kv, slot)
        if on("cache-concat-growth"):
            cache.spill.append(kv.clone())
        comp = self.decode_compressed(i, x, qr, positions) if cfg.ratio(i) else None
        idx = self.decode_window_idx(cache.window, x.device)
        self.emit("L{i}.attn.visible", i, lambda: _visible(idx, comp, positions, cache.window, prefill=False))
        win, k = idx.shape[1], idx.shape[1] + (0 if comp is None else comp.shape[1])
        slots, buf = cache.decode_buffers(k)
        slots[:, :win] = idx
        if comp is not None:
            torch.add(comp, cache.window, out=slots[:, win:])
            slots[:, win:].masked_fill_(comp < 0, -1)
        if cache.kv.fmt == "fp8" and self.profile.fmha == "bf16" and not on("decode-buffer-kept"):
            return self.attend_packed(i, q, slots)
        if on("decode-buffer-kept"):
            buf = torch.zeros(cache.kv.capacity, cfg.head_dim, dtype=torch.bfloat16, device=x.device)[:k]
            self.kept.append(buf)
        cache.kv.read_into(slots[0].clamp(min=0), buf)  # window + selected rows
        local = torch.where(slots >= 0, torch.arange(k, device=x.device), -1)
        sink, scale = self.model.w(f"layers.{i}.attn.attn_sink"), cfg.head_dim**-0.5
        return self.op("sparse_attention")(q, buf, local, sink, scale, self.profile.fmha)

    def attend_packed(self, i: int, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Decode attention on layer i's packed FP8 KV rows (op ``sparse_attention_fp8kv``; on an H100 / H200 the
        584 B layout's kernel reads the rows in place, with no gather or dequantization pass): slots [1, k], the
        cache slots the token sees, -1 masked (a paged cache's slots go to the op as storage rows, -1 kept). Same
        bits as dequantizing the gathered rows into bf16 first."""
        sink, scale = self.model.w(f"layers.{i}.attn.attn_sink"), self.cfg.head_dim**-0.5
        kv = self.layers[i].kv
        return self.op("sparse_attention_fp8kv")(q, kv.packed, kv.physical_slots(slots), sink, scale,
                                                 self.cfg.rope_head_dim)

    def window_slot(self, win: int) -> slice:
        """The ring-buffer slot of the decode token (host int position)."""
        return slice(self.pos % win, self.pos % win + 1)

    def decode_window_idx(self, win: int, device: torch.device) -> torch.Tensor:
        return _window_decode_idx(self.pos, win, device)

    def decode_compressed(self, i: int, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Compress the decode token, then the compressed entries it sees [1, k]: the indexer's picks (CSA) or
        every entry j < (t+1)//ratio (HCA)."""
        ratio, t = self.cfg.ratio(i), self.pos
        new = self.compress(i, x, positions, index=False)
        self.emit("L{i}.attn.compressed_kv", i, new if new is not None else x.new_zeros((0, self.cfg.head_dim)))
        if ratio == 4:
            return self.index_decode(i, x, qr, positions)
        n_vis = (t + 1) // ratio + (1 if on("causal-off-by-one") and (t + 1) % ratio else 0)
        return torch.arange(n_vis, device=x.device)[None]

    # ---- indexer -----------------------------------------------------------------------------
    def index_query(self, i: int, x: torch.Tensor, qr: torch.Tensor | Fp8Input, positions: torch.Tensor):
        w, cfg, prof = self.model.w, self.cfg, self.profile
        pre = f"layers.{i}.attn.indexer."
        q = self._made.pop(pre + "wq_b.weight", None)
        q = self.linear(qr, pre + "wq_b.weight") if q is None else q
        q = self.op("apply_rope")(q.unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim)), positions,
                                  self.model.freqs[4])
        q = self.op("indexer_round")(q, prof.indexer_qk, prof.hadamard == "on")
        self.emit("L{i}.indexer.q", i, lambda: _unrotated(q, prof))
        projected = self.input_projection(i, x, (pre + "weights_proj.weight",))
        logits = projected[0].to(BF16) if projected else x @ w(pre + "weights_proj.weight").to(BF16).T  # bf16 GEMM
        weights = logits * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        self.emit("L{i}.indexer.weights", i, weights)
        return q, weights

    def emit_kv_cache(self, i: int, kv: torch.Tensor, slots: torch.Tensor | slice) -> None:
        """Site ``L{i}.attn.kv_cache`` where the window KV is stored packed (``kv_storage = "fp8"``): the call's
        rows kv [n, hd] as the cache holds them, read back from the window ``slots`` just written
        (``KVStore.stored_bytes``)."""
        store = self.layers[i].kv
        if store.fmt == "fp8":
            self.emit("L{i}.attn.kv_cache", i, lambda: store.stored_bytes(slots, kv))

    def emit_keys(self, i: int, new: torch.Tensor | None) -> None:
        if new is None:
            new = torch.zeros(0, self.cfg.index_head_dim, device=self.model.device)
        self.emit("L{i}.indexer.keys", i, lambda: _unrotated(new, self.profile))

    def keys_visible(self, end: int) -> int:
        """The indexer keys a call whose tokens end at position ``end`` (exclusive) scores: those of the blocks
        completed before ``end``. Fault ``batch-key-range``: the end another sequence of a batched call gives
        (``key_range_end``, set by ``batch.BatchedCall``)."""
        if on("batch-key-range") and self.key_range_end is not None:
            end = self.key_range_end
        return end // 4

    def _scorer(self, store: KeyStore, n: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Scores (q [m, h, d], weights [m, h]) -> [m, n] against the first n cached keys: straight from the packed
        FP4 codes and scales (op ``index_scores_fp4``), else on the bf16 rows (``index_scores``)."""
        dtype = torch.float32 if self.profile.index_scores == "fp32" else BF16
        packed = store.fp4_slices(n)
        if packed is not None:
            op = self.op("index_scores_fp4")
            return lambda q, weights: op(q, *packed, weights, dtype)
        keys, op = store.read(slice(0, n)), self.op("index_scores")
        return lambda q, weights: op(q, keys, weights, dtype)

    def index_prefill(self, i: int, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg, cache = self.cfg, self.layers[i]
        q, weights = self.index_query(i, x, qr, positions)
        new = self.compress(i, x, positions, index=True)
        self.emit_keys(i, new)
        t = len(positions)
        n = self.keys_visible(self.pos + t)
        score = self._scorer(cache.keys, n)
        k = min(_topk_cap(cfg.index_topk), n)
        first = self.pos // 4 if on("indexer-chunk-local") else 0  # fault: keys written before this call unseen
        out = []
        for s in range(0, t, QUERY_CHUNK):
            sl = slice(s, s + QUERY_CHUNK)
            scores = score(q[sl], weights[sl])  # as the op returns them (bf16): no fp32 copy of the logits
            limit = ((positions[sl] + 1) // 4 + (1 if on("causal-off-by-one") else 0))[:, None]
            j = torch.arange(n, device=x.device)[None]
            scores = scores.masked_fill((j >= limit) | (j < first), float("-inf"))
            self.emit("L{i}.indexer.scores", i, scores.float)
            picks = stable_topk(scores, k)
            out.append(torch.where((picks >= limit) | (picks < first), -1, picks))
        picks = torch.cat(out)
        self.emit("L{i}.indexer.topk", i, _pad(picks, cfg.index_topk))
        return picks

    def index_decode(self, i: int, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg, cache, t = self.cfg, self.layers[i], self.pos
        q, weights = self.index_query(i, x, qr, positions)
        new = self.compress(i, x, positions, index=True)
        self.emit_keys(i, new)
        n = self.keys_visible(t + 1)
        scores = self._scorer(cache.keys, n)(q, weights)
        self.emit("L{i}.indexer.scores", i, scores.float)
        picks = stable_topk(scores, min(_topk_cap(cfg.index_topk), n))
        self.emit("L{i}.indexer.topk", i, lambda: _pad(picks, cfg.index_topk))
        return picks

    # ---- MoE -----------------------------------------------------------------------------------
    def route(self, i: int, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate: (routing weights [n, k] fp32, expert ids [n, k])."""
        w, cfg, p = self.model.w, self.cfg, f"layers.{i}.ffn."
        hashed = cfg.is_hash_layer(i)
        weights, experts = self.op("gate")(x.float(), self.model.w_as(p + "gate.weight", torch.float32),
                                           None if hashed else w(p + "gate.bias"),
                                           _tid2eid(w(p + "gate.tid2eid")) if hashed else None, ids, cfg)
        if on("routing-bias-in-weights") and not hashed:
            weights = _biased_weights(x, w(p + "gate.weight"), w(p + "gate.bias"), experts, cfg.route_scale)
        if not hashed:
            self.emit("L{i}.moe.scores", i, lambda: _selection_scores(x, w(p + "gate.weight"), w(p + "gate.bias")))
        self.emit("L{i}.moe.experts", i, experts)
        self.emit("L{i}.moe.weights", i, weights)
        return weights, experts

    def shared_expert(self, i: int, h: torch.Tensor | Fp8Input) -> torch.Tensor:
        """The shared expert's output bf16 [n, dim]."""
        q = f"layers.{i}.ffn.shared_experts."
        w1, w3 = q + "w1.weight", q + "w3.weight"
        stored = h.shape[0] <= ops.GEMV_ROWS and self.profile.gemm_act == "fp8"
        pair = self.model.stacked_gemv_weight((w1, w3)) if stored else None

        linear = self.linear
        if pair is not None:  # w1 and w3 in one FP8 GEMV over their stacked rows (expert_cuda uses it)
            def linear(x, w, act):
                return self.linear(x, w, act)

            linear.pair = lambda x, act: self.op("fp8_weight_linear")(
                x.xq if isinstance(x, Fp8Input) else x, *pair, act).split(pair[0].shape[0] // 2, dim=-1)
        return self.op("expert")(h, w1, q + "w2.weight", w3, self.cfg.swiglu_limit, None, self.profile.gemm_act, linear)

    def moe(self, i: int, h: torch.Tensor | Fp8Input, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts in ascending expert id, then the shared expert; fp32 sum -> bf16 [n, dim]. h: the ffn
        norm's output (an :class:`Fp8Input` under a fused profile, which the experts' first GEMMs read). A few
        tokens on a GPU read the FP4 experts as stored (``routed_on_stored``), more tokens too, in one grouped GEMM
        per weight (``routed_grouped``)."""
        w, cfg, act, x = self.model.w, self.cfg, self.profile.gemm_act, _plain(h)
        weights, experts = self.route(i, x, ids)
        few = x.shape[0] <= ops.GEMV_ROWS
        stacks = self.model.stored_experts(i) if not few or act == "fp8" else None
        if stacks is not None:
            routed = self.routed_on_stored if few else self.routed_grouped
            return _moe_sum(routed(h, weights, experts, stacks), self.shared_expert(i, h))
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        expert = self.op("expert")
        for e, rows, slot in _by_expert(experts):
            q = f"layers.{i}.ffn.experts.{e}."
            y[rows] += expert(h[rows], w(q + "w1.weight"), w(q + "w2.weight"), w(q + "w3.weight"),
                              cfg.swiglu_limit, weights[rows, slot, None], act, self.linear).float()
        y += self.shared_expert(i, h).float()
        return y.to(BF16)


    def routed_on_stored(self, h: torch.Tensor | Fp8Input, weights: torch.Tensor, experts: torch.Tensor,
                         stacks) -> torch.Tensor:
        """The routed experts of a few tokens [n, k] on the stored FP4 weights (op ``fp4_picked_linear``: the
        expert ids stay on the device, no weight is copied): each token's expert outputs bf16 [n, k, dim] in
        ascending expert id, the order ``moe`` adds them in. No host sync (graph decode runs it too)."""
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
        id, the order ``moe`` adds them in."""
        picked, order = experts.sort(dim=1)  # a token's k expert ids are distinct: no ties to order
        xq = h.xq if isinstance(h, Fp8Input) else h
        return self.op("grouped_expert")(xq, weights.gather(1, order).float(), picked, *stacks[3], *stacks[1],
                                         self.cfg.swiglu_limit, self.profile.gemm_act, isinstance(h, Fp8Input))


def _input_weights(i: int, ratio: int) -> tuple[str, ...]:
    """The bf16 weights of layer i that read the attention input (``input_projection``): the compressor's wkv and
    wgate (compressed layers), the indexer compressor's and weights_proj (CSA layers)."""
    pre = f"layers.{i}.attn."
    names = (pre + "compressor.wkv.weight", pre + "compressor.wgate.weight") if ratio else ()
    if ratio == 4:
        names += (pre + "indexer.compressor.wkv.weight", pre + "indexer.compressor.wgate.weight",
                  pre + "indexer.weights_proj.weight")
    return names


def _e8m0_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A stored FP4 weight's 1x32 scales (float8_e8m0fnu, or their uint8 bits) as the uint8 e8m0 bytes the routed
    expert kernels read (a view, no copy); other dtypes raise naming the weight."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"{name}: expected FP4 scales as e8m0 bytes (float8_e8m0fnu or uint8), found {scale.dtype}")
    return scale.view(torch.uint8)


def _moe_sum(out: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Routed slot outputs bf16 [n, k, dim] and the shared expert's [n, dim] summed by op ``moe_sum`` (one launch
    on a GPU, the same bits as the emulation's loop)."""
    return implementation("moe_sum", out.device)(out, shared)


def _by_expert(experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
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


def _repeat_rows(h: torch.Tensor | Fp8Input, k: int) -> torch.Tensor | Fp8Input:
    """Each row of h [n, d] k times in a row [n k, d]: one token's as a stride-0 view (no copy; the GEMV kernels
    read it as it is), several tokens' copied."""
    if isinstance(h, Fp8Input):
        return Fp8Input(_repeat_rows(h.y, k), _repeat_rows(h.xq, k))
    return h.expand(k, -1) if h.shape[0] == 1 else h.repeat_interleave(k, dim=0)


def _plain(h: torch.Tensor | Fp8Input) -> torch.Tensor:
    """The bf16 activation of ``h`` (itself, or an :class:`Fp8Input`'s y)."""
    return h.y if isinstance(h, Fp8Input) else h


def _unrotated(x: torch.Tensor, prof: Profile) -> torch.Tensor:
    """Indexer q / keys as emitted at their sites: the quantized values taken back out of the Hadamard domain
    (H is orthonormal and self-inverse), so they compare with the oracle's and dot products are unchanged."""
    return hadamard(x.float()) if prof.hadamard == "on" else x


def _topk_cap(topk: int) -> int:
    topk = topk_width(topk)
    return topk // 2 if on("topk-cap-half") else topk


def _tid2eid(table: torch.Tensor) -> torch.Tensor:
    """The hash-routing table as the gate reads it (fault ``tid2eid-bf16``: cast through bf16, as a blanket
    weight-dtype conversion does; ids above 256 move to a bf16 neighbour)."""
    return table.to(BF16).to(table.dtype) if on("tid2eid-bf16") else table


def _selection_scores(x, gate_w, bias) -> torch.Tensor:
    """fp32 [n, n_routed]: the sqrt-softplus gate scores plus the routing bias, what the top-k selects from."""
    return torch.nn.functional.softplus(x.float() @ gate_w.float().T).sqrt() + bias


def _biased_weights(x, gate_w, bias, experts, route_scale) -> torch.Tensor:
    """Fault ``routing-bias-in-weights``: weights gathered from the biased scores."""
    w = _selection_scores(x, gate_w, bias).gather(1, experts)
    return w / w.sum(-1, keepdim=True) * route_scale


def _pad(picks: torch.Tensor, width: int) -> torch.Tensor:
    """picks [n, k] padded with -1 to ``width`` columns; a wider selection (fault ``index-topk-hardcoded``) is
    recorded whole."""
    return torch.nn.functional.pad(picks, (0, max(0, width - picks.shape[1])), value=-1)


def _window_prefill_idx(t: int, win: int, start: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Prefill window TOKEN POSITIONS [t, min(start + t, win)] of the chunk's queries start..start+t-1: query p
    sees max(0, p-win+1) .. p, valid first (the official prefill: start 0); built on ``device``."""
    base = torch.arange(start, start + t, device=device)[:, None]
    idx = (base - win + 1).clamp(min=0) + torch.arange(min(start + t, win), device=device)[None]
    idx = torch.where(idx > base, -1, idx)
    if on("window-127"):
        idx = torch.where(idx == base - win + 1, -1, idx)
    if on("window-no-self"):
        idx = torch.where(idx == base, torch.where(base >= win, base - win, -1), idx)
    return idx


def _window_decode_idx(t: int, win: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Official decode window indices [1, win] into the ring buffer, oldest first (built on ``device``)."""
    if t >= win - 1:
        s = t % win
        idx = ((torch.arange(win, device=device) + s + 1) % win)[None]
        if on("window-127"):
            idx[0, 0] = -1
    else:
        idx = torch.nn.functional.pad(torch.arange(t + 1, device=device), (0, win - t - 1), value=-1)[None]
    if on("window-no-self"):
        idx = torch.where(idx == t % win, -1, idx)
    return idx


def _hca_prefill_idx(t: int, ratio: int, start: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """All entries j < (p+1)//ratio per query p of the chunk [t, (start+t)//ratio], -1 otherwise, built on
    ``device`` (at 1M context a 16K-token chunk's table is 1 GB of int64: no host copy)."""
    j = torch.arange((start + t) // ratio, device=device)[None]
    limit = (torch.arange(start + 1, start + t + 1, device=device) // ratio)[:, None] + \
        (1 if on("causal-off-by-one") else 0)
    return torch.where(j >= limit, -1, j)


def _visible(window_idx: torch.Tensor, comp: torch.Tensor | None, positions: torch.Tensor, win: int,
             prefill: bool) -> torch.Tensor:
    """The ``L{i}.attn.visible`` site: window token positions then compressed entry ids (-1 padding)."""
    if prefill:
        window_pos = window_idx
    else:
        t = positions[:1]  # on the device: no host read (graph decode records this site from a captured step)
        slot_pos = t - ((t - torch.arange(win, device=window_idx.device)) % win)  # token position in each slot
        window_pos = torch.where(window_idx >= 0, slot_pos[window_idx.clamp(min=0)], -1)
    window_pos = torch.nn.functional.pad(window_pos, (0, win - window_pos.shape[1]), value=-1)
    if comp is None:
        return window_pos
    return torch.cat((window_pos, comp), dim=1)


def _at_kv_stride(entries: torch.Tensor, r: int) -> torch.Tensor:
    """Fault ``indexer-key-stride``: a prefill call's new keys [n, d] as its key slots hold them when the writer
    steps one KV row (head_dim) per key and the reader one key row (index_head_dim): key s in slot s * r (r =
    head_dim / index_head_dim), the keys whose slot falls past the call's n lost, the other slots zero."""
    out = torch.zeros_like(entries)
    out[::r] = entries[: -(-len(entries) // r)]
    return out
