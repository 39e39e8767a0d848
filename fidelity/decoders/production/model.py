"""ProductionModel: the decoder under test, with the official numerics selected by a precision profile.

Mirrors the official ``model.py`` control flow (spec §4-§5): a prefill, then one token per decode step (the
prefill may also come in chunks, an extension the official model lacks, computed as the whole prefill); the
window is a ring buffer written before attention; compressors carry fp32 state; caches are allocated once from
``max_context``. Emits the same sites as the oracle.

``ProductionModel`` holds the weights and builds each layer once (``layer.Layer``: attention, indexer,
compressors, MoE, mHC as objects holding their weights); a ``ProductionSession`` holds one sequence's caches and
position and runs the layers under its policies (``policies``: decode, rows, stage).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fidelity.decoders.base import ContextError
from fidelity.decoders.production import kernels
from fidelity.decoders.production.cache import LayerCache
from fidelity.decoders.production.call_counts import Counts, counting
from fidelity.decoders.production.layer import Layer
from fidelity.decoders.production.ops import rows_mm
from fidelity.decoders.production.policies import EAGER, ONE_SEQUENCE, WHOLE_MODEL, EagerDecode, OneSequence, WholeModel
from fidelity.decoders.production.profiles import Profile, get_profile
from fidelity.decoders.production.registry import implementation
from fidelity.decoders.production.rope_freqs import rope_inv_freq
from fidelity.decoders.production.sublayer import BF16, input_weights
from fidelity.model.formats import decode_e8m0
from fidelity.model.sites import Recorder
from fidelity.model.weights import fp32_nbytes

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
        self._layers: dict[int, Layer] = {}
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
        ``SubLayer.input_projection``); None where that path does not run (no GPU kernels, or a weight not
        stored in bf16)."""
        key = "+".join(names)
        if key not in self._gemv:
            stored = [self.ckpt.stored(n) for n in names] if self._gemv_ready() else None
            ok = stored is not None and all(st.data.dtype == torch.bfloat16 for st in stored)
            self._gemv[key] = torch.cat([st.data for st in stored]).to(self.device) if ok else None
        return self._gemv[key]

    def input_stack(self, i: int) -> tuple[torch.Tensor, tuple[str, ...], list[int]] | None:
        """Layer i's bf16 weights that read the attention input (``sublayer.input_weights``) stacked for one GEMV,
        with their names in stacking order and their row counts (the output's split sizes), kept; None where that
        path does not run (no such weight, no GPU kernels, or one not stored in bf16)."""
        key = f"input stack {i}"
        if key not in self._gemv:
            names = input_weights(i, self.cfg.ratio(i))
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

    def layer(self, i: int) -> Layer:
        """Layer i's objects, built (its weights resolved) at the first ask and kept: a pipeline stage builds only
        its own layers, so it reads only their weights."""
        layer = self._layers.get(i)
        if layer is None:
            layer = self._layers[i] = Layer(self, i)
        return layer

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
    """Caches for one sequence; ``prefill`` once, then ``step`` per token. The layers run under three policies
    (``policies``): ``decode`` (eager: the position on the host), ``rows`` (one sequence) and ``stage`` (the whole
    model), or those given."""

    def __init__(self, model: ProductionModel, recorder: Recorder | None = None, own: range | None = None,
                 decode: EagerDecode | None = None, rows: OneSequence | None = None, stage: WholeModel | None = None):
        """``own``: the layers this session runs and holds caches for (default: all; a pipeline stage: its range)."""
        self.model, self.cfg, self.profile, self.rec = model, model.cfg, model.profile, recorder
        self.decode, self.rows, self.stage = decode or EAGER, rows or ONE_SEQUENCE, stage or WHOLE_MODEL
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
        # weight name -> its product with this layer call's input, made in one launch with other weights reading the
        # same input before its reader asks (``SubLayer.stacked_linears``, ``SubLayer.input_projection``); emptied
        # after each attention core
        self.made: dict[str, torch.Tensor] = {}

    def emit(self, template: str, layer: int | None, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Record ``tensor`` at the site ``template`` of ``layer`` (None outside the layers) if the recorder wants
        it (a callable is evaluated only then), as the rows and decode policies route it."""
        self.rows.emit(self, template, layer, tensor)

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
        """One decode token -> fp32 logits [vocab], as the decode policy runs the step."""
        # the token stays on the host: the decode policy places it (graph decode copies it into its input buffer, so
        # a replayed step allocates nothing but the logits it returns)
        ids = self._check(torch.as_tensor([int(token_id)]), prefill=False, to_device=False)
        return self.decode.step(self, ids)[0]

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
        """One call of ids [n] at positions [n] (device tensors) -> fp32 logits [n, vocab], counted; advances
        ``pos`` and ``calls``."""
        if self.rec is not None:
            self.rec.step = self.calls
        with counting(self.counts):
            logits = self._forward(ids, positions)
        self.pos += len(ids)
        self.calls += 1
        return logits

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [n] at positions [n] (device tensors) -> fp32 logits [n, vocab] through the stage's layers; updates
        the caches, not ``pos``."""
        x = self.stage.enter(self, ids)
        for i in self.stage.layers(self):
            x = self.model.layer(i)(self, x, positions, ids)
        return self.stage.leave(self, x)

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
        rows = self.logit_rows(len(y)) if self.last_only and self.stage.head_rows_free else None
        logits = rows_mm((y if rows is None else y.index_select(0, rows)).float(),
                         self.model.w_as("head.weight", torch.float32).T)
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


def _e8m0_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A stored FP4 weight's 1x32 scales (float8_e8m0fnu, or their uint8 bits) as the uint8 e8m0 bytes the routed
    expert kernels read (a view, no copy); other dtypes raise naming the weight."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"{name}: expected FP4 scales as e8m0 bytes (float8_e8m0fnu or uint8), found {scale.dtype}")
    return scale.view(torch.uint8)
