"""Production compressor (official ``Compressor.forward``): fp32 projections and pooling, carry state for
decode, then ``norm(kv.to(bf16))`` and RoPE at the block's first position, in bf16 (spec §4-§5)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fidelity.decoders.production.cache import CompressorCarry
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.ops import rows_mm
from fidelity.decoders.production.registry import implementation
from fidelity.decoders.production.sublayer import Model, Session, SubLayer

BF16 = torch.bfloat16


class CompressorWeights(NamedTuple):
    """A compressor's weights: wkv, wgate [coff * d, dim] held in fp32 (their exact bf16 values), ape fp32
    [ratio, coff * d], the RMSNorm weight [d]; ``projected``: this call's (kv, score) fp32 [n, coff * d] where the
    layer computed them with its other projections of the same input (``SubLayer.input_projection``: one GEMV
    over the stacked bf16 weights), else None."""

    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor
    projected: tuple[torch.Tensor, torch.Tensor] | None = None


def _project(x: torch.Tensor, weights: CompressorWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, dim] -> (kv, score) fp32 [n, coff * d]: ``x.float() @ W^T`` for wkv and wgate (the fp32 GEMMs), or
    the call's ``projected`` ones."""
    if weights.projected is not None:
        return weights.projected
    xf = x.float()
    return rows_mm(xf, weights.wkv.float().T), rows_mm(xf, weights.wgate.float().T)


def _overlap(t: torch.Tensor, ratio: int, d: int, fill: float) -> torch.Tensor:
    """[b, r, 2d] -> [b, 2r, d]: previous block's first half, then this block's second half."""
    out = t.new_full((t.shape[0], 2 * ratio, d), fill)
    out[:, ratio:] = t[:, :, d:]
    out[1:, :ratio] = t[:-1, :, :d]
    return out


def _finish(pooled: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
            eps: float) -> torch.Tensor:
    """pooled fp32 [b, d] -> bf16 entries: RMSNorm of the bf16 rows, RoPE at the block starts (ops ``rms_norm`` and
    ``apply_rope`` as the registry resolves them for the device: the kernels on a GPU)."""
    dev = pooled.device
    y = implementation("rms_norm", dev)(pooled.to(BF16), norm, eps)
    return implementation("apply_rope", dev)(y, positions, freqs)


def compress_prefill(x: torch.Tensor, weights: CompressorWeights, carry: CompressorCarry, ratio: int,
                     freqs: torch.Tensor, eps: float, start: int = 0) -> tuple[torch.Tensor | None, int]:
    """A prefill chunk x [T, dim] at positions start..start+T-1 -> (the entries its tokens complete [k, d] bf16 or
    None, the first one's id).

    A chunk continues the carry: the unfinished block's tokens (positions start - start % ratio .. start - 1) are
    pooled with the chunk's, and with overlap (ratio 4) the previous complete block fills the first half of the
    first new entry. The carry is left as decode expects it: the last complete block (overlap) and the tokens of
    the unfinished block. ``start = 0`` is the official prefill."""
    ape, norm = weights.ape, weights.norm
    d, overlap, t = norm.numel(), ratio == 4, x.shape[0]
    offset = ratio if overlap else 0
    kv, score = _project(x, weights)
    score = score + ape[(torch.arange(start, start + t, device=x.device) % ratio)]
    carried = start % ratio  # tokens of the unfinished block already in the carry
    kv = torch.cat((carry.kv[offset : offset + carried], kv))
    score = torch.cat((carry.score[offset : offset + carried], score))
    first, total = start // ratio, carried + t
    remainder = total % ratio
    cutoff = total - remainder
    previous = (carry.kv[:ratio].clone(), carry.score[:ratio].clone()) if overlap else None
    if overlap and cutoff >= ratio:
        carry.kv[:ratio] = kv[cutoff - ratio : cutoff]
        carry.score[:ratio] = score[cutoff - ratio : cutoff]
    if remainder:
        carry.kv[offset : offset + remainder] = kv[cutoff:]
        carry.score[offset : offset + remainder] = score[cutoff:]
    if cutoff == 0:
        return None, first
    kv, score = kv[:cutoff].unflatten(0, (-1, ratio)), score[:cutoff].unflatten(0, (-1, ratio))
    if overlap:
        kv, score = _overlap(kv, ratio, d, 0.0), _overlap(score, ratio, d, float("-inf"))
        if first > 0:  # the block before this chunk's first: kept in the carry
            kv[0, :ratio], score[0, :ratio] = previous[0][:, :d], previous[1][:, :d]
    pooled = (kv * score.softmax(dim=1)).sum(dim=1)
    starts = (torch.arange(kv.shape[0], device=x.device) + first) * ratio
    starts = starts + (ratio - 1 if on("compressed-rope-last") else 0)
    return _finish(pooled, norm, freqs, starts, eps), first


def compress_decode(x: torch.Tensor, t: int, weights: CompressorWeights, carry: CompressorCarry, ratio: int,
                    freqs: torch.Tensor, eps: float) -> tuple[torch.Tensor | None, int]:
    """One token x [1, dim] at position t -> (the entry completed at t [1, d] or None, its id t // ratio). Before the
    block completes only the carry slot is written (``compressor_decode``'s first step, the same bits: a copy and
    one fp32 add), so the pool runs once per block."""
    if (t + 1) % ratio:
        ape = weights.ape
        kv, score = _project(x, weights)
        slot = t % ratio + (ratio if ratio == 4 else 0)
        carry.kv[slot], carry.score[slot] = kv[0], (score + ape[t % ratio])[0]
        return None, 0
    entry = compress_decode_on_device(x, torch.tensor([t], device=x.device), weights, carry, ratio, freqs, eps)
    return entry, t // ratio


def compress_decode_on_device(x: torch.Tensor, pos: torch.Tensor, weights: CompressorWeights, carry: CompressorCarry,
                              ratio: int, freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`compress_decode` with the position in a device tensor ``pos`` (int64 [1]) and no host branch, so
    that a decode step can be captured in a CUDA graph: the projections, then op ``compressor_decode`` (the carry
    updated in place, the entry of the block ending at ``pos`` computed every step). Returns the entry [1, d] bf16:
    the compressed entry ``pos // ratio`` where the token completes its block (``pos % ratio == ratio - 1``; the
    caller's ``write_at_block_end``), meaningless (may be NaN) elsewhere."""
    kv, score = _project(x, weights)
    step = implementation("compressor_decode", x.device)
    entry, _, _ = step(kv, score, weights.ape, carry.kv, carry.score, pos, weights.norm, freqs, eps)
    return entry


class Compressor(SubLayer):
    """Layer i's main compressor (``index=False``: entries of ``ratio`` tokens for the attention) or its indexer's
    (``index=True``: keys of 4 tokens), its weights resolved when built. Called with a sequence's session ``s``:
    a prefill chunk pools here, a decode token as the session's decode policy says (``s.decode.compress``)."""

    def __init__(self, model: Model, i: int, index: bool):
        super().__init__(model, i)
        pre = f"layers.{i}.attn.indexer.compressor." if index else f"layers.{i}.attn.compressor."
        self.index, self.names = index, (pre + "wkv.weight", pre + "wgate.weight")
        self.wkv, self.wgate = (model.w_as(n, torch.float32) for n in self.names)  # fp32 GEMMs: converted once
        self.ape, self.norm_weight = model.w(pre + "ape"), model.w(pre + "norm.weight")
        self.ratio = 4 if index else self.cfg.ratio(i)
        self.freqs = model.freqs[self.cfg.ratio(i)]

    def __call__(self, s: Session, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """New entries of the call's tokens x [n, dim] (main: FP8-rounded nope dims; indexer: Hadamard + FP4),
        written to the caches; None where no block completes (a decode policy may always return None)."""
        if s.in_prefill:
            entries, first = compress_prefill(x, self.weights(s, x), self.carry(s), self.ratio, self.freqs,
                                              self.cfg.norm_eps, s.pos)
            return self.store(s, entries, first)
        return s.decode.compress(self, s, x, positions)

    def decode(self, s: Session, x: torch.Tensor) -> torch.Tensor | None:
        """One decode token at ``s.pos`` (host position): the entry it completes [1, d], written, else None."""
        entries, first = compress_decode(x, s.pos, self.weights(s, x), self.carry(s), self.ratio, self.freqs,
                                         self.cfg.norm_eps)
        return self.store(s, entries, first)

    def weights(self, s: Session, x: torch.Tensor) -> CompressorWeights:
        """The weights with this call's projections of x where the layer made them in one launch."""
        projected = self.input_projection(s, x, self.names)
        return CompressorWeights(self.wkv, self.wgate, self.ape, self.norm_weight, projected)

    def carry(self, s: Session) -> CompressorCarry:
        """The sequence's fp32 carry of this compressor (fault ``compressor-no-used-length``: emptied at pos > 0)."""
        cache = s.layers[self.i]
        carry = cache.index_carry if self.index else cache.carry
        if on("compressor-no-used-length") and s.pos > 0:  # fault: no used length, so nothing carried over
            carry.kv.zero_()
            carry.score.fill_(float("-inf"))
        return carry

    def round(self, entries: torch.Tensor) -> torch.Tensor:
        """New entries as their cache stores them: indexer keys Hadamard-rotated and rounded to the profile's
        format, main entries with FP8-rounded nope dims."""
        if not self.index:
            return self.op("kv_round")(entries, self.cfg.rope_head_dim, self.profile.kv_nope,
                                       self.profile.kv_scale_floor)
        rotate = self.profile.hadamard == "on" and not on("hadamard-q-only")
        entries = self.op("indexer_round")(entries, self.profile.indexer_qk, rotate)
        if on("indexer-key-width"):
            entries = entries.clone()
            entries[:, -self.cfg.rope_head_dim :] = 0
        return entries

    def store(self, s: Session, entries: torch.Tensor | None, first: int) -> torch.Tensor | None:
        """Entries ids first.. [k, d] rounded and written to the sequence's key store or compressed KV rows."""
        if entries is None:
            return None
        entries = self.round(entries)
        cache = s.layers[self.i]
        if self.index:
            stored = entries
            if s.in_prefill and on("indexer-key-stride"):
                stored = at_kv_stride(entries, self.cfg.head_dim // self.cfg.index_head_dim)
            cache.keys.write(slice(first, first + len(entries)), stored)
        else:
            cache.kv.write(slice(cache.window + first, cache.window + first + len(entries)), entries)
        return entries


def at_kv_stride(entries: torch.Tensor, r: int) -> torch.Tensor:
    """Fault ``indexer-key-stride``: a prefill call's new keys [n, d] as its key slots hold them when the writer
    steps one KV row (head_dim) per key and the reader one key row (index_head_dim): key s in slot s * r (r =
    head_dim / index_head_dim), the keys whose slot falls past the call's n lost, the other slots zero."""
    out = torch.zeros_like(entries)
    out[::r] = entries[: -(-len(entries) // r)]
    return out
