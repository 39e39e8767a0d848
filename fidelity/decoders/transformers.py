"""transformers' ``DeepseekV4ForCausalLM`` as a decoder under test, in any dtype and on any device.

The model keeps its own ``DynamicCache`` for decode. Forward hooks map its modules to the harness's sites, and a
registered attention function (transformers' ``AttentionInterface``, running its own eager attention) reports what
the attention saw: the queries after RoPE, the window and compressed rows, the visible set read from the mask it
was given, and its output before the inverse RoPE. Every site of ``fidelity/model/sites.py`` is reported except the mHC
``pre`` weights (consumed inside the hyper-connection module), so free, layer and op modes all run.

The injected faults of the production catalogue (``fidelity.decoders.production.faults``) that this decoder knows
(``FAULTS``) are planted in the model at call time while ``fidelity.decoders.faults.inject`` holds them: through
the attention function (sink dropped, window of 127 or without self, no inverse RoPE), hooks (comb transposed,
routing bias in the weights, top-k capped at half, compressed-entry causality off by one on HCA layers, the indexer
keys a call writes cut to the nope width or laid out at the KV row stride, in the model's own key cache) and module
attributes (3 Sinkhorn iterations, shared-expert clamp missing, YaRN on SWA layers, the indexer's top-k hard-coded
to twice index_topk, the hash-routing table cast through bf16).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fidelity.decoders.base import BATCH, FORK, ROLLBACK, Call, Decoder, DecoderError
from fidelity.decoders.faults import on
from fidelity.model.checkpoint import Checkpoint
from fidelity.model.config import ModelConfig
from fidelity.model.layouts import hf_module_source
from fidelity.model.load import load_checkpoint
from fidelity.model.sites import MHC_SITES, SITE, SITES, record

ATTENTION = "dsv4-fidelity"  # the name the reporting attention function is registered under
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
FAULTS = ("sink-dropped", "window-127", "window-no-self", "no-inverse-rope", "comb-transposed",
          "routing-bias-in-weights", "topk-cap-half", "causal-off-by-one", "sinkhorn-3-iters",
          "shared-clamp-missing", "yarn-on-swa", "index-topk-hardcoded", "tid2eid-bf16", "indexer-key-width",
          "indexer-key-stride")
NOT_REPORTED = (SITE.mhc_attn_pre, SITE.mhc_ffn_pre)
REQUIREMENT = "transformers>=5.23"
INSTALL = "pip install 'dsv4-fidelity[transformers]' (in a checkout: pip install -e '.[transformers]')"
MARKS = 8  # cache copies kept per sequence, at the starts of its latest calls (fork and rollback points)
# How forward() batches, for the manifest: what transformers' DSv4 cache can hold in one model call.
BATCHING = ("calls of one start and one length share a model call (their caches stacked row by row, no padding); "
            "other calls run in a model call each: transformers' DeepseekV4HCACache / CSACache keep one position "
            "(window length, compressor entry count and buffers) for all rows of a batch, and a padded row's "
            "compressor pools the padding (transformers #45938: a left-padded prompt's logits differ from its own "
            "run by max|diff|/max|logit| 0.54, cos 0.968, tiny fp32)")
ROLLBACK_HOW = ("restores the cache copied at the start of the latest kept call at or before the position and "
                "feeds the remaining tokens again in one call: transformers' DSv4 cache layers are not croppable "
                "(DeepseekV4HCACache.is_croppable is False: crop trims the window keys but keeps the compressor's "
                "buffers, entries, entry count and overlap state, and raises once the window is full)")


class TransformersMissing(ImportError):
    """transformers, or its DeepseekV4ForCausalLM, is not installed; the message says what to install."""


def require_transformers(what: str = "TransformersDecoder") -> None:
    """Raise TransformersMissing (one line: ``what`` needs, what is installed, what to install) unless transformers
    with ``DeepseekV4ForCausalLM`` imports."""
    try:
        import transformers
    except ImportError:
        raise TransformersMissing(f"{what} needs {REQUIREMENT}, which is not installed: {INSTALL}") from None
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        raise TransformersMissing(f"{what} needs {REQUIREMENT} (DeepseekV4ForCausalLM), found transformers "
                                  f"{transformers.__version__}: {INSTALL}") from None


def hf_config(cfg: ModelConfig):
    """transformers' ``DeepseekV4Config`` for ``cfg``."""
    require_transformers()
    from transformers import DeepseekV4Config

    d = cfg.to_hf_dict()
    for key in ("quantization_config", "model_type", "architectures"):
        d.pop(key, None)
    return DeepseekV4Config(**d)


def hf_model(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A ``DeepseekV4ForCausalLM`` holding ``ckpt``'s weights, built in memory (any layout the loader reads;
    FP8/FP4 weights dequantized exactly), in ``dtype`` as ``from_pretrained(dtype=...)`` leaves it: the modules
    transformers keeps in fp32 and the RoPE frequencies stay fp32."""
    require_transformers()
    from transformers import DeepseekV4ForCausalLM

    cfg = ckpt.config
    model = DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    state = model.state_dict()
    written: set[str] = set()
    with torch.no_grad():
        for name in ckpt.names():
            src = hf_module_source(name, cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim)
            if src.key not in state:
                raise ValueError(f"{name}: no transformers parameter {src.key!r} to hold it")
            target = state[src.key] if src.index is None else state[src.key][src.index[0], src.index[1]:src.index[2]]
            target.copy_(ckpt[name].to(target.dtype))
            written.add(src.key)
    unset = sorted(k for k in state if k not in written and not k.endswith("inv_freq"))
    if unset:
        raise ValueError(f"transformers parameters the checkpoint does not set: {unset[:5]}")
    keep = re.compile("|".join(rf"((^|\.){m}($|\.))" for m in model._keep_in_fp32_modules_strict))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        # what from_pretrained casts: the state dict's float tensors; the RoPE frequencies (not in the state dict)
        # stay fp32, and so do the modules transformers keeps in fp32
        if name in state and t.is_floating_point() and not keep.search(name):
            t.data = t.data.to(dtype)
    return model.to(device)


@dataclass
class _Mark:
    """A sequence's state at a call start: the position, a copy of its cache (None: empty), the hooks' counts."""

    pos: int
    cache: object | None
    entries: dict[str, int]


@dataclass
class _Seq:
    """One sequence: its cache (None until its first call), position, token ids so far, the hooks' per-layer entry
    counts and the marks (state copies) at the starts of its latest calls, oldest first."""

    cache: object | None = None
    pos: int = 0
    ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    entries: dict[str, int] = field(default_factory=dict)
    marks: list[_Mark] = field(default_factory=list)

    def mark_at(self, pos: int) -> _Mark | None:
        """The latest state at or before ``pos`` that can be restored (the empty state at 0 always can)."""
        found = [m for m in self.marks if m.pos <= pos]
        return found[-1] if found else _Mark(0, None, {})


class TransformersDecoder(Decoder):
    """``DeepseekV4ForCausalLM`` under test. ``TransformersDecoder(model)`` for a model in memory;
    ``from_pretrained(dir, dtype, device)`` for a checkpoint directory in any layout the loader reads.

    Several sequences (``forward``, ``fork``, ``rollback``): each has its own ``DynamicCache``; sequence 0 is the
    one ``prefill`` / ``step`` continue and the only one whose sites are recorded. See ``BATCHING`` for how calls
    share model calls, ``ROLLBACK_HOW`` for rollbacks; a fork copies the parent's cache at its position or at the
    start of one of its latest ``MARKS`` calls."""

    def __init__(self, model, config: ModelConfig | None = None):
        require_transformers()
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        self.model = model.eval()
        self.config = config or ModelConfig.from_dict(model.config.to_dict(), source="transformers config")
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        name = {v: k for k, v in DTYPES.items()}.get(self.dtype, str(self.dtype))
        exact = self.dtype in (torch.float32, torch.float64)
        self.label = f"transformers DeepseekV4ForCausalLM ({name})"
        self.profile = {"name": f"transformers-{name}", "precision": "exact" if exact else "bf16"}
        AttentionInterface.register(ATTENTION, _reporting_attention)
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        self.model.set_attn_implementation(ATTENTION)
        self.rec = None
        self.reset()
        self._hook_handles = self._instrument()

    def reset(self) -> None:
        """Sequence 0 alone, at position 0 with no cache, and the per-layer entry counts of the hooks emptied."""
        self.calls = 0
        self._seqs: dict[int, _Seq] = {0: _Seq()}
        self._entries: dict[str, int] = self._seqs[0].entries  # compressed entries / indexer keys emitted so far
        self._layer_entries: dict[int, int] = {}  # compressed entries the attention of a layer sees this call
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._written_keys: dict[int, torch.Tensor] = {}  # a layer's keys as written, where a fault moved them

    @property
    def pos(self) -> int:
        """Sequence 0's position."""
        return self._seqs[0].pos

    @property
    def cache(self):
        """Sequence 0's ``DynamicCache`` (None before its first call)."""
        return self._seqs[0].cache

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | str = torch.bfloat16,
                        device: str | torch.device = "cpu") -> TransformersDecoder:
        ckpt = load_checkpoint(directory)
        return cls.from_checkpoint(ckpt, dtype, device)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype | str = torch.bfloat16,
                        device: str | torch.device = "cpu") -> TransformersDecoder:
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        return cls(hf_model(ckpt, dtype, device), ckpt.config)

    # ---- decoding ---------------------------------------------------------------------------------------------
    def sites(self) -> frozenset[str]:
        return frozenset(SITES) - set(NOT_REPORTED)

    def info(self) -> dict:
        import transformers

        return {"decoder_dtype": str(self.dtype).removeprefix("torch."), "transformers": transformers.__version__,
                "decoder_stop_ids": list(self.stop_ids() or ()), "decoder_batching": BATCHING,
                "decoder_rollback": ROLLBACK_HOW}

    def capabilities(self) -> dict[str, str | None]:
        """Batches, forks and rollbacks are all served (``BATCHING`` and ``ROLLBACK_HOW`` say how)."""
        return {BATCH: None, FORK: None, ROLLBACK: None}

    def stop_ids(self) -> tuple[int, ...] | None:
        """``generation_config.eos_token_id`` (an id or a list), as ``generate()`` would stop; None without one."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return None
        return tuple(int(t) for t in (eos if isinstance(eos, list | tuple) else [eos]))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt tokens at positions pos..: the first call makes the cache, later ones continue it (chunks)."""
        return self._run([0], torch.as_tensor(ids).long().flatten()[None])[0]

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        return self._run([0], torch.tensor([[int(token)]]))[0][0]

    @torch.no_grad()
    def forward(self, calls: list[Call]) -> list[torch.Tensor]:
        """Calls of one start and length run as one batched model call (sequence 0 first, the recorded row), the
        others one model call each; a sequence not seen before starts at 0 with an empty cache."""
        seqs = [c.seq for c in calls]
        if not calls or len(set(seqs)) != len(seqs):
            raise DecoderError(f"{self.label}: forward needs calls of distinct sequences, got sequences {seqs}")
        for c in calls:
            st = self._seqs.get(c.seq)
            have = st.pos if st is not None else 0
            if c.start != have or torch.as_tensor(c.ids).numel() == 0:
                raise DecoderError(f"{self.label}: sequence {c.seq} stands at position {have}; a call of "
                                   f"{torch.as_tensor(c.ids).numel()} tokens starting at {c.start} cannot continue it")
        groups: dict[tuple[int, int], list[Call]] = {}
        for c in sorted(calls, key=lambda c: c.seq != 0):  # sequence 0 first: row 0 is the recorded row
            groups.setdefault((c.start, torch.as_tensor(c.ids).numel()), []).append(c)
        out: dict[int, torch.Tensor] = {}
        for group in groups.values():
            for c in group:
                self._seqs.setdefault(c.seq, _Seq())
            ids = torch.stack([torch.as_tensor(c.ids).long().flatten() for c in group])
            for c, logits in zip(group, self._run([c.seq for c in group], ids), strict=True):
                out[c.seq] = logits
        return [out[s] for s in seqs]

    def fork(self, seq: int, parent: int, pos: int) -> None:
        """A copy of ``parent``'s cache at ``pos``: its position now or the start of one of its kept calls."""
        src = self._seqs.get(parent)
        if src is None or seq == parent:
            raise DecoderError(f"{self.label}: cannot fork sequence {seq} from sequence {parent}: "
                               + ("it is the same sequence" if seq == parent else "there is no such sequence"))
        points = sorted({0, src.pos, *(m.pos for m in src.marks)})
        if pos not in points:
            raise DecoderError(f"{self.label}: cannot fork sequence {parent} at position {pos}: its cache is kept "
                               f"only at positions {points} (now and at the starts of its latest {MARKS} calls)")
        mark = _Mark(src.pos, src.cache, src.entries) if pos == src.pos else src.mark_at(pos)
        self._seqs[seq] = _Seq(cache=copy.deepcopy(mark.cache), pos=pos, ids=src.ids[:pos].clone(),
                               entries=dict(mark.entries), marks=[m for m in src.marks if m.pos < pos])
        if seq == 0:
            self._entries = self._seqs[0].entries

    @torch.no_grad()
    def rollback(self, seq: int, pos: int) -> None:
        """Restore the latest kept call start at or before ``pos`` and feed its tokens up to ``pos`` again."""
        st = self._seqs.get(seq)
        if st is None or not 0 <= pos <= st.pos:
            have = "there is no such sequence" if st is None else f"it stands at position {st.pos}"
            raise DecoderError(f"{self.label}: cannot roll sequence {seq} back to position {pos}: {have}")
        if pos == st.pos:
            return
        mark, ids = st.mark_at(pos), st.ids[:pos]
        st.marks = [m for m in st.marks if m.pos < mark.pos]
        st.cache, st.pos, st.ids = copy.deepcopy(mark.cache), mark.pos, ids[:mark.pos]
        st.entries.clear()
        st.entries.update(mark.entries)
        if pos > mark.pos:
            self._run([seq], ids[mark.pos:][None], replay=True)

    def _run(self, seqs: list[int], ids: torch.Tensor, replay: bool = False) -> list[torch.Tensor]:
        """One model call: ``ids`` [rows, n] continue sequences ``seqs`` (all at one position); row 0's sites are
        recorded when it is sequence 0 (and this is no replay). -> fp32 logits [n, vocab] per row."""
        from transformers import DynamicCache

        states = [self._seqs[s] for s in seqs]
        start = states[0].pos
        for st in states:
            st.marks = [*st.marks, _Mark(st.pos, copy.deepcopy(st.cache), dict(st.entries))][-MARKS:]
        if states[0].cache is None:
            cache = DynamicCache(config=self.model.config)
        else:
            cache = states[0].cache if len(states) == 1 else _stack([st.cache for st in states])
        recording = seqs[0] == 0 and not replay
        saved_rec, saved_entries = self.rec, self._entries
        self.rec = self.rec if recording else None
        self._entries = states[0].entries
        if self.rec is not None:
            self.rec.step = self.calls
        self._positions = torch.arange(start, start + ids.shape[1])
        try:
            with self._faults():
                out = self.model(input_ids=ids.to(self.device), cache=cache, use_cache=True)
        finally:
            self.rec, self._entries = saved_rec, saved_entries
        rows = [out.cache] if len(states) == 1 else _split(out.cache, len(states))
        for st, row in zip(states, rows, strict=True):
            st.cache, st.pos = row, start + ids.shape[1]
        for st, row_ids in zip(states, ids.cpu(), strict=True):
            st.ids = torch.cat([st.ids, row_ids])
            if st is not states[0]:
                st.entries.clear()
                st.entries.update(states[0].entries)
        if seqs[0] == 0 and not replay:
            self.calls += 1
        return [row.float().cpu() for row in out.logits]

    def emit(self, template: str, layer: int | None, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Record ``tensor`` at the site ``template`` of ``layer`` (None outside the layers) if the recorder wants
        it (a callable is evaluated only then)."""
        record(self.rec, template, layer, tensor)

    # ---- hooks ------------------------------------------------------------------------------------------------
    def _instrument(self) -> list:
        """Forward hooks on every module a site comes from; the attention modules know their decoder."""
        inner, handles = self.model.model, []

        def simple(module, template: str, layer: int | None = None, pick=lambda out: out[0]):
            handles.append(module.register_forward_hook(lambda m, args, out: self.emit(template, layer, pick(out))))

        simple(inner.embed_tokens, "embed")
        simple(inner.norm, "final")
        simple(self.model.lm_head, "logits", pick=lambda out: out[0].float())
        for i, layer in enumerate(inner.layers):
            self._instrument_layer(i, layer, simple, handles)
        return handles

    def _instrument_layer(self, i: int, layer, simple, handles: list) -> None:
        attn = layer.self_attn
        attn._fidelity = (self, i)
        simple(layer.input_layernorm, SITE.attn_in, i)
        simple(layer.post_attention_layernorm, SITE.moe_in, i)
        simple(layer.mlp, SITE.moe_out, i)
        simple(layer, SITE.residual, i)
        simple(attn, SITE.attn_out, i, lambda out: out[0][0])
        handles.append(attn.register_forward_pre_hook(self._rope_hook(i), with_kwargs=True))
        for which, hc in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
            handles.append(hc.register_forward_hook(self._hc_hook(i, which)))
        handles.append(layer.mlp.gate.register_forward_hook(self._gate_hook(i)))
        comp = attn.compressor
        if comp is not None:
            handles.append(comp.register_forward_hook(self._compressor_hook(i)))
            indexer = getattr(comp, "indexer", None)
            if indexer is not None:
                handles.append(indexer.register_forward_hook(self._topk_hook(i)))
                handles.append(indexer.scorer.register_forward_pre_hook(self._key_fault_hook(i)))
                handles.append(indexer.scorer.register_forward_hook(self._scorer_hook(i)))

    def _rope_hook(self, i: int):
        def pre(module, args, kwargs):
            cos, sin = kwargs["position_embeddings"][module.rope_layer_type]
            self._rope[i] = (cos, sin)
            self._layer_entries[i] = 0

        return pre

    def _hc_hook(self, i: int, which: str):
        def fn(module, args, out):
            post, comb, collapsed = out
            if which == "attn" and on("comb-transposed"):
                comb = comb.transpose(-1, -2)
            self.emit(MHC_SITES[which, "post"], i, post[0])
            self.emit(MHC_SITES[which, "comb"], i, comb[0])
            return post, comb, collapsed

        return fn

    def _gate_hook(self, i: int):
        def fn(module, args, out):
            logits, weights, indices = out
            if on("routing-bias-in-weights") and hasattr(module, "e_score_correction_bias"):
                biased = (module.score_fn(logits) + module.e_score_correction_bias).gather(1, indices)
                weights = biased / (biased.sum(dim=-1, keepdim=True) + 1e-20) * module.routed_scaling_factor
            if hasattr(module, "e_score_correction_bias"):  # score-routed: what its top-k selects from
                self.emit(SITE.moe_scores, i, (module.score_fn(logits) + module.e_score_correction_bias).float())
            self.emit(SITE.moe_experts, i, indices)
            self.emit(SITE.moe_weights, i, weights)
            return logits, weights, indices

        return fn

    def _new_rows(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """The rows of ``rows`` [T, d] (all entries so far) emitted by this call."""
        old = self._entries.get(key, 0)
        self._entries[key] = rows.shape[0]
        return rows[old:]

    def _compressor_hook(self, i: int):
        def fn(module, args, out):
            compressed, block_bias = out
            self._layer_entries[i] = compressed.shape[2]
            self.emit(SITE.attn_compressed_kv, i, self._new_rows(f"{i}.kv", compressed[0, 0]))
            if on("causal-off-by-one") and block_bias is not None and not hasattr(module, "indexer"):
                block_bias = _one_more_entry(block_bias, self._positions, module.compress_rate)
            return compressed, block_bias

        return fn

    def _topk_hook(self, i: int):
        def fn(module, args, out):
            picks = out
            if on("topk-cap-half"):
                picks = picks.clone()
                picks[..., (self.config.index_topk + 1) // 2:] = -1
            pad = self.config.index_topk - picks.shape[-1]
            self.emit(SITE.indexer_topk, i, torch.nn.functional.pad(picks[0], (0, pad), value=-1))
            return picks

        return fn

    def _key_fault_hook(self, i: int):
        """The indexer key faults, planted in the key cache the scorer is handed (the model's own running tensor,
        changed in place, so later calls read what this call stored): ``indexer-key-width`` zeroes the rope dims
        of the keys this call wrote; ``indexer-key-stride`` (a call of several tokens) moves them to the KV row
        stride. The keys as written are kept for ``L{i}.indexer.keys``."""

        def pre(module, args):
            keys, old = args[1], self._entries.get(f"{i}.keys", 0)
            self._written_keys.pop(i, None)
            if on("indexer-key-width"):
                keys[:, old:, -self.config.rope_head_dim:] = 0
            if on("indexer-key-stride") and len(self._positions) > 1 and keys.shape[1] > old:
                self._written_keys[i] = keys[0, old:].clone()
                keys[:, old:] = _at_kv_stride(keys[:, old:], self.config.head_dim // self.config.index_head_dim)

        return pre

    def _scorer_hook(self, i: int):
        def fn(module, args, out):
            q, keys, hidden = args
            ratio = self.config.compress_ratios[i]
            self.emit(SITE.indexer_q, i, q[0])
            written = self._new_rows(f"{i}.keys", keys[0])
            self.emit(SITE.indexer_keys, i, self._written_keys.pop(i, written))
            weights = module.weights_proj(hidden)[0].float() * module.weights_scaling * module.softmax_scale
            self.emit(SITE.indexer_weights, i, weights)
            future = torch.arange(out.shape[-1], device=out.device)[None] >= \
                ((self._positions.to(out.device) + 1) // ratio)[:, None]
            self.emit(SITE.indexer_scores, i, out[0].masked_fill(future, -math.inf))

        return fn

    @contextmanager
    def _faults(self):
        """Module attributes of the injected faults, set for one call and restored after."""
        with ExitStack() as stack:
            for i, layer in enumerate(self.model.model.layers):
                if on("sinkhorn-3-iters"):
                    stack.enter_context(_attribute(layer.attn_hc, "hc_sinkhorn_iters", 3))
                if on("shared-clamp-missing"):
                    stack.enter_context(_attribute(layer.mlp.shared_experts, "limit", math.inf))
                if on("yarn-on-swa") and self.config.compress_ratios[i] == 0:
                    stack.enter_context(_attribute(layer.self_attn, "rope_layer_type", "compress"))
                indexer = getattr(layer.self_attn.compressor, "indexer", None)
                if on("index-topk-hardcoded") and indexer is not None:
                    stack.enter_context(_attribute(indexer, "index_topk", 2 * self.config.index_topk))
                if on("tid2eid-bf16") and layer.mlp.is_hash:
                    table = layer.mlp.gate.tid2eid
                    stack.enter_context(_attribute(layer.mlp.gate, "tid2eid", table.to(torch.bfloat16).to(table.dtype)))
            yield

    # ---- the attention's view ---------------------------------------------------------------------------------
    def attention_seen(self, i: int, query, key, mask, output) -> None:
        """Sites from one attention call of layer i: q [1, H, S, D], key [1, 1, L, D] (window rows, then
        compressed entries), the additive mask [1, 1, S, L] (None: every row), output [1, S, H, D]."""
        s, length = query.shape[2], key.shape[2]
        entries = self._layer_entries.get(i, 0)
        window_len = length - entries
        self.emit(SITE.attn_q, i, query[0].transpose(0, 1))
        self.emit(SITE.attn_kv, i, key[0, 0, window_len - s:window_len])
        self.emit(SITE.attn_core, i, output[0])
        self.emit(SITE.attn_visible, i, lambda: self._visible(mask, s, window_len, length))

    def _visible(self, mask, s: int, window_len: int, length: int) -> torch.Tensor:
        """[S, window + K]: the window positions, then the compressed entry ids, each query may see."""
        seen = torch.ones((s, length), dtype=torch.bool) if mask is None else (mask[0, 0] == 0).cpu()
        last = int(self._positions[-1])
        col_pos = torch.arange(window_len) + (last - window_len + 1)
        w = self.config.window_size
        win = torch.where(seen[:, :window_len], col_pos, -1).sort(dim=1, descending=True).values[:, :w]
        win = torch.nn.functional.pad(win, (0, max(0, w - win.shape[1])), value=-1).flip(1)
        comp = torch.where(seen[:, window_len:], torch.arange(length - window_len), -1)
        return torch.cat((win, comp.sort(dim=1, descending=True).values.flip(1)), dim=1)

    def fault_mask(self, mask, s: int, window_len: int):
        """The mask with the window faults applied: the oldest window position hidden (window-127) or self."""
        if not (on("window-127") or on("window-no-self")) or mask is None:
            return mask
        mask = mask.clone()
        last = int(self._positions[-1])
        col_pos = torch.arange(window_len, device=mask.device) + (last - window_len + 1)
        q_pos = self._positions.to(mask.device)
        hide = col_pos[None] == (q_pos[:, None] if on("window-no-self") else q_pos[:, None] - (
            self.config.window_size - 1))
        mask[..., :window_len] = mask[..., :window_len].masked_fill(hide, -math.inf)
        return mask


def _stack(caches: list) -> object:
    """One ``DynamicCache`` whose rows are ``caches`` (each of batch 1, all at one position): every tensor of a
    layer's state concatenated on the batch axis, everything else (lengths, entry counts) shared."""
    out = copy.copy(caches[0])
    out.layers = [_merge([c.layers[i].__dict__ for c in caches], layer) for i, layer in enumerate(caches[0].layers)]
    return out


def _merge(states: list[dict], layer) -> object:
    merged = copy.copy(layer)
    merged.__dict__ = _merge_values(states)
    if getattr(layer, "values", None) is getattr(layer, "keys", None):  # K = V: one tensor, as update() keeps it
        merged.values = merged.keys
    return merged


def _merge_values(values: list):
    first = values[0]
    if isinstance(first, dict):
        return {k: _merge_values([v[k] for v in values]) for k in first}
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return torch.cat(values)
    if any(v is not first and v != first for v in values if not isinstance(v, torch.Tensor)):
        raise DecoderError(f"rows at different cache states cannot share a transformers cache: {values}")
    return first


def _split(cache, rows: int) -> list:
    """``_stack`` undone: one ``DynamicCache`` per row."""
    out = []
    for b in range(rows):
        row = copy.copy(cache)
        row.layers = []
        for layer in cache.layers:
            part = copy.copy(layer)
            part.__dict__ = _take(layer.__dict__, b)
            if getattr(layer, "values", None) is getattr(layer, "keys", None):
                part.values = part.keys
            row.layers.append(part)
        out.append(row)
    return out


def _take(value, b: int):
    if isinstance(value, dict):
        return {k: _take(v, b) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return value[b:b + 1].clone()
    return value


def _one_more_entry(block_bias: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """An HCA block bias that also shows entry (t+1)//ratio to query t (the causality rule off by one)."""
    limit = ((positions + 1) // ratio).to(block_bias.device)
    cols = torch.arange(block_bias.shape[-1], device=block_bias.device)
    return block_bias.masked_fill((cols[None] <= limit[:, None])[None, None], 0.0)


@contextmanager
def _attribute(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _reporting_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention, reporting what it saw to the TransformersDecoder that owns ``module``, with
    the decoder's injected attention faults applied."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    owner = getattr(module, "_fidelity", None)
    if owner is None:
        return hf.eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    decoder, i = owner
    window_len = key.shape[2] - decoder._layer_entries.get(i, 0)
    mask = decoder.fault_mask(attention_mask, query.shape[2], window_len)
    with ExitStack() as stack:
        if on("sink-dropped"):
            stack.enter_context(_sinks(module, -math.inf))
        out, weights = hf.eager_attention_forward(module, query, key, value, mask, scaling, dropout, **kwargs)
    decoder.attention_seen(i, query, key, mask, out)
    if on("no-inverse-rope"):  # rotate forward here so that the module's inverse rotation cancels
        cos, sin = decoder._rope[i]
        out = hf.apply_rotary_pos_emb(out.transpose(1, 2), cos, sin).transpose(1, 2)
    return out, weights


@contextmanager
def _sinks(module, value: float):
    saved = module.sinks.data.clone()
    module.sinks.data.fill_(value)
    try:
        yield
    finally:
        module.sinks.data.copy_(saved)


def _at_kv_stride(keys: torch.Tensor, r: int) -> torch.Tensor:
    """Fault ``indexer-key-stride``: keys [b, n, d] a call wrote, as slots read one key row apart hold them when the
    writer stepped one KV row (r key rows) per key: key s at slot s * r, keys past slot n - 1 lost, the rest zero."""
    out = torch.zeros_like(keys)
    kept = keys[:, : -(-keys.shape[1] // r)]
    out[:, ::r] = kept
    return out
