"""The attention of one layer (spec §4): q and window KV projections with RoPE, the sequence's caches (window
ring, compressed entries, the indexer's picks on CSA layers), the sparse attention with its sink, the inverse RoPE
and the grouped output projection."""

from __future__ import annotations

import torch

from fidelity.decoders.production import ops
from fidelity.decoders.production.compressor import Compressor
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.indexer import QUERY_CHUNK, Indexer
from fidelity.decoders.production.rope_freqs import rope_inv_freq
from fidelity.decoders.production.shapes import hca_prefill_idx, plain, visible, window_prefill_idx
from fidelity.decoders.production.sublayer import BF16, Model, Session, SubLayer
from fidelity.model.sites import SITE


class Attention(SubLayer):
    """Layer i's attention, its weights resolved when built (the GEMM weights by name: ``SubLayer.linear`` reads
    them as stored on the GEMV path); its compressor (compressed layers) and indexer (CSA layers) as attributes.
    Its methods take the sequence's session ``s`` (caches, position, recorder, policies)."""

    def __init__(self, model: Model, i: int):
        super().__init__(model, i)
        pre, w = f"layers.{i}.attn.", model.w
        self.ratio = self.cfg.ratio(i)
        self.wq_a, self.wkv, self.wq_b, self.wo_a, self.wo_b = (pre + n + ".weight"
                                                                for n in ("wq_a", "wkv", "wq_b", "wo_a", "wo_b"))
        self.q_norm, self.kv_norm, self.sink = w(pre + "q_norm.weight"), w(pre + "kv_norm.weight"), w(pre + "attn_sink")
        self.wo_a_bf16 = model.w_as(self.wo_a, BF16)  # the grouped einsum's bf16 weight
        self.freqs = model.freqs[self.ratio]
        self.scale = self.cfg.head_dim**-0.5
        self.compressor = Compressor(model, i, index=False) if self.ratio else None
        self.indexer = Indexer(model, i) if self.ratio == 4 else None

    def __call__(self, s: Session, h: torch.Tensor | Fp8Input, positions: torch.Tensor) -> torch.Tensor:
        """h: the attention norm's output [n, dim] (an :class:`Fp8Input` under a fused profile) -> bf16 [n, dim]:
        the projections, the sequence's caches (the core, per sequence as the session's ``rows`` policy hands the
        rows out), the output projection."""
        qr, q, kv = self.project(s, h, positions)
        o = s.rows.core(self, s, plain(h), qr, q, kv, positions)
        return self.out(o, positions)

    def rope_freqs(self, device: torch.device) -> torch.Tensor:
        """The RoPE inverse frequencies (fault ``yarn-on-swa``: the compressed layers' YaRN ones on SWA)."""
        if self.ratio == 0 and on("yarn-on-swa"):
            return rope_inv_freq(self.cfg, 4).to(device)
        return self.freqs

    def project(self, s: Session, h: torch.Tensor | Fp8Input, positions: torch.Tensor):
        """Rows [n] at their positions -> (qr [n, q_lora] (an :class:`Fp8Input` under a fused profile), q [n,
        heads, hd] after RoPE, window kv [n, hd] bf16); no cache is read or written."""
        cfg = self.cfg
        freqs = self.rope_freqs(positions.device)
        a, kv_in = self.stacked_linears(h, (self.wq_a, self.wkv))
        qr = self.norm(a, self.q_norm)
        if self.indexer is not None:  # the indexer's wq_b reads qr too: stacked with wq_b, kept for its query
            q, index_q = self.stacked_linears(qr, (self.wq_b, self.indexer.wq_b), lazy=1)
            if index_q is not None:
                s.made[self.indexer.wq_b] = index_q
        else:
            q = self.linear(qr, self.wq_b)
        q = q.unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = self.op("apply_rope")(self.op("rms_norm_weightless")(q, cfg.norm_eps), positions, freqs)
        kv = self.kv_path(kv_in, positions, freqs)
        s.emit(SITE.attn_q, self.i, q)
        s.emit(SITE.attn_kv, self.i, kv)
        return qr, q, kv

    def kv_path(self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """The wkv output [n, hd] -> window KV [n, hd] bf16: kv_norm, RoPE, the FP8 round of the nope dims; one op
        (``kv_norm_rope_fp8``) under ``norm_fusion = "fused"``, else the reference's three."""
        cfg, fmt = self.cfg, self.profile.kv_nope
        if self.fused:
            return self.op("kv_norm_rope_fp8")(x, self.kv_norm, cfg.norm_eps, positions, freqs, fmt,
                                               self.profile.kv_scale_floor)
        kv = self.op("apply_rope")(self.op("rms_norm")(x, self.kv_norm, cfg.norm_eps), positions, freqs)
        return self.op("kv_round")(kv, cfg.rope_head_dim, fmt, self.profile.kv_scale_floor)

    def core(self, s: Session, x: torch.Tensor, qr, q: torch.Tensor, kv: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        """The sequence's attention at ``s.pos``: caches written (window ring, compressed entries, indexer keys)
        and read -> o [n, heads, hd] bf16 (before the inverse RoPE); a decode token as ``s.decode`` attends it."""
        try:
            if s.in_prefill:
                o = self.prefill(s, x, qr, q, kv, positions)
            else:
                o = s.decode.attend(self, s, x, qr, q, kv, positions)
        finally:
            s.made = {}
        s.emit(SITE.attn_core, self.i, o)
        return o

    def out(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o [n, heads, hd] -> bf16 [n, dim]: the inverse RoPE, the grouped wo_a, wo_b."""
        if not on("no-inverse-rope"):
            o = self.op("apply_rope")(o, positions, self.rope_freqs(o.device), inverse=True)
        stored = self.model.gemv_weight(self.wo_a) if o.shape[0] <= ops.GEMV_ROWS else None
        if stored is not None:  # the FP8-stored wo_a read as stored; bf16 o as given, as grouped_out
            o = self.op("fp8_weight_linear")(o.flatten(1), *stored, "bf16", self.cfg.o_groups)
        else:
            o = ops.grouped_out(o, self.wo_a_bf16, self.cfg.o_groups)
        return self.linear(o, self.wo_b)

    def emit_kv_cache(self, s: Session, kv: torch.Tensor, slots: torch.Tensor | slice) -> None:
        """Site ``L{i}.attn.kv_cache`` where the window KV is stored packed (``kv_storage = "fp8"``): the call's
        rows kv [n, hd] as the cache holds them, read back from the window ``slots`` just written
        (``KVStore.stored_bytes``)."""
        store = s.layers[self.i].kv
        if store.fmt == "fp8":
            s.emit(SITE.attn_kv_cache, self.i, lambda: store.stored_bytes(slots, kv))

    def emit_compressed(self, s: Session, new: torch.Tensor | None, like: torch.Tensor) -> None:
        """Site ``L{i}.attn.compressed_kv``: the call's new entries (an empty [0, hd] record where none)."""
        s.emit(SITE.attn_compressed_kv, self.i, new if new is not None else like.new_zeros((0, self.cfg.head_dim)))

    def prefill(self, s: Session, x, qr, q, kv, positions) -> torch.Tensor:
        """A prefill chunk at positions start..start+t-1 (start = s.pos; 0 for the official prefill). The
        attention table holds the earlier window rows still needed (from the ring buffer), the chunk's rows, then
        every compressed entry so far; window indices point into it in position order."""
        cfg, cache = self.cfg, s.layers[self.i]
        ratio, win, t, start = self.ratio, cfg.window_size, len(positions), s.pos
        before = min(start, win - 1)  # earlier positions start-before .. start-1 that the chunk's window reaches
        earlier = cache.kv.read(torch.arange(start - before, start, device=kv.device) % win)
        tail = kv[-win:]
        slots = torch.arange(start + t - len(tail), start + t, device=kv.device) % win
        cache.kv.write(slots, tail)
        self.emit_kv_cache(s, kv, slots)
        table = torch.cat((earlier, kv)) if before else kv
        offset = len(table)
        comp = None
        if ratio:
            self.emit_compressed(s, self.compressor(s, x, positions), kv)
            n_entries = (start + t) // ratio
            if n_entries:
                table = torch.cat((table, cache.kv.read(slice(win, win + n_entries))))
            comp = self.indexer.prefill(s, x, qr, positions) if ratio == 4 else \
                hca_prefill_idx(t, ratio, start, x.device)
        idx = window_prefill_idx(t, win, start, x.device)
        s.emit(SITE.attn_visible, self.i, lambda: visible(idx, comp, positions, win, prefill=True))
        rows = idx - (start - before)  # token positions -> table rows (a position before the table: none)
        idx = torch.where((idx >= 0) & (rows >= 0), rows, -1)
        if comp is not None:
            idx = torch.cat((idx, torch.where(comp >= 0, comp + offset, -1)), dim=1)
        attend, fmha = self.op("sparse_attention"), self.profile.fmha
        return torch.cat([attend(q[j : j + QUERY_CHUNK], table, idx[j : j + QUERY_CHUNK], self.sink, self.scale, fmha)
                          for j in range(0, t, QUERY_CHUNK)])

    def decode(self, s: Session, x, qr, q, kv, positions) -> torch.Tensor:
        """One decode token at ``t = s.pos``, its window slot, window indices and compressed entries as the
        session's decode policy provides them. Every slot is gathered in place, a -1 slot as row 0, which the
        attention never reads, so no host sync sizes the gather; rows stored packed FP8 are attended in place
        (:meth:`packed`) unless the profile rounds the FMHA inputs. The slots and the gathered rows go into the
        layer's preallocated ``slots`` / ``gather`` buffers (``LayerCache.decode_buffers``); what still allocates
        here is eager mode's small temporaries (masks, the FP8 dequantization), which graph decode replays without
        allocating."""
        cfg, cache, policy = self.cfg, s.layers[self.i], s.decode
        slot = policy.window_slot(s, cache.window)
        cache.kv.write(slot, kv)
        self.emit_kv_cache(s, kv, slot)
        if on("cache-concat-growth"):
            cache.spill.append(kv.clone())
        comp = policy.compressed(self, s, x, qr, positions) if self.ratio else None
        idx = policy.window_idx(s, cache.window, x.device)
        s.emit(SITE.attn_visible, self.i, lambda: visible(idx, comp, positions, cache.window, prefill=False))
        win, k = idx.shape[1], idx.shape[1] + (0 if comp is None else comp.shape[1])
        slots, buf = cache.decode_buffers(k)
        slots[:, :win] = idx
        if comp is not None:
            torch.add(comp, cache.window, out=slots[:, win:])
            slots[:, win:].masked_fill_(comp < 0, -1)
        if cache.kv.fmt == "fp8" and self.profile.fmha == "bf16" and not on("decode-buffer-kept"):
            return self.packed(s, q, slots)
        if on("decode-buffer-kept"):
            buf = torch.zeros(cache.kv.capacity, cfg.head_dim, dtype=torch.bfloat16, device=x.device)[:k]
            s.kept.append(buf)
        cache.kv.read_into(slots[0].clamp(min=0), buf)  # window + selected rows
        local = torch.where(slots >= 0, torch.arange(k, device=x.device), -1)
        return self.op("sparse_attention")(q, buf, local, self.sink, self.scale, self.profile.fmha)

    def compressed(self, s: Session, x: torch.Tensor, qr, positions: torch.Tensor) -> torch.Tensor:
        """Compress the decode token (host position), then the compressed entries it sees [1, k]: the indexer's
        picks (CSA) or every entry j < (t+1)//ratio (HCA)."""
        ratio, t = self.ratio, s.pos
        self.emit_compressed(s, self.compressor(s, x, positions), x)
        if ratio == 4:
            return self.indexer.decode(s, x, qr, positions)
        n_vis = (t + 1) // ratio + (1 if on("causal-off-by-one") and (t + 1) % ratio else 0)
        return torch.arange(n_vis, device=x.device)[None]

    def packed(self, s: Session, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Decode attention on the packed FP8 KV rows (op ``sparse_attention_fp8kv``; on an H100 / H200 the 584 B
        layout's kernel reads the rows in place, with no gather or dequantization pass): slots [1, k], the cache
        slots the token sees, -1 masked (a paged cache's slots go to the op as storage rows, -1 kept). Same bits as
        dequantizing the gathered rows into bf16 first."""
        kv = s.layers[self.i].kv
        return self.op("sparse_attention_fp8kv")(q, kv.packed, kv.physical_slots(slots), self.sink, self.scale,
                                                 self.cfg.rope_head_dim)
