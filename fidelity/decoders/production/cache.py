"""Preallocated caches, sized once from ``max_context`` (spec §5): no per-step growth.

Per layer: the attention KV buffer ``[window | ceil(max_context/ratio) compressed entries]`` (the official
``kv_cache`` layout), stored as bf16 rows or as packed FP8 rows (e4m3 nope codes, bf16 rope dims, ue8m0 1x64
scales, pad: 584 bytes/token at head_dim 512, ``kv_layout``); the indexer key cache
``[ceil(max_context/4), index_head_dim]`` as bf16 or packed (FP4 codes + ue8m0 1x32 scales, or e4m3 + ue8m0
scales); the compressors' fp32 carry state ``[coff*ratio, coff*d]``; and the decode's cache slots for window +
selected rows, with a bf16 gather buffer for them where decode gathers (:func:`decode_gathers`).

Layout (profile field ``kv_cache``): flat, logical row (slot) s at storage row s; or paged:<block>, the rows in
physical blocks of ``block`` rows addressed through the store's block table (int64 [n_blocks] on its device): slot s
at row ``table[s // block] * block + s % block`` (:meth:`_RowStore.physical`), the storage rounded up to whole
blocks. The table is the fixed permutation :func:`block_table` (blocks in reverse order), so code that addresses a
paged store by the flat slot reads other rows; each session allocates its own blocks (none shared; a fork copies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fidelity.decoders.production import kv_layout
from fidelity.decoders.production.faults import on
from fidelity.decoders.production.profiles import Profile
from fidelity.decoders.production.registry import implementation
from fidelity.decoders.production.topk import topk_width
from fidelity.model.config import ModelConfig
from fidelity.model.formats import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

BF16 = torch.bfloat16


def block_table(n_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A paged store's block table, int64 [n_blocks]: logical block b at physical block ``n_blocks - 1 - b`` (the
    reversed order: never the identity for two blocks or more)."""
    return torch.arange(n_blocks - 1, -1, -1, dtype=torch.long, device=device)


class _RowStore:
    """Row writes and the slot translation shared by the stores: ``_parts(rows)`` pairs each storage tensor with
    the new rows' values; ``block`` rows per block (0: flat) and ``table`` (paged) address them."""

    capacity: int
    block: int = 0
    table: torch.Tensor | None = None

    def _paged_rows(self, capacity: int, block: int, device: torch.device | str) -> int:
        """Sets the layout (block 0: flat) and returns the storage rows: capacity, rounded up to whole blocks."""
        self.block = block
        if not block:
            return capacity
        n_blocks = -(-capacity // block)
        self.table = block_table(n_blocks, device)
        return n_blocks * block

    def _parts(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def parts(self) -> list[torch.Tensor]:
        """The storage tensors, rows [physical rows, ...] each."""
        raise NotImplementedError

    def physical(self, slots: torch.Tensor | slice) -> torch.Tensor | slice:
        """The storage rows of logical ``slots`` (int64 tensor on the store's device, or a slice; in range): the
        slots as given when flat; paged, ``table[s // block] * block + s % block`` (a slice becomes an index
        tensor), computed on the device (no host sync)."""
        if not self.block:
            return slots
        if isinstance(slots, slice):
            slots = torch.arange(*slots.indices(self.capacity), device=self.table.device)
        return self.table[slots // self.block] * self.block + slots % self.block

    def physical_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """:meth:`physical` of slots with -1 (masked) entries kept -1 (the FP8-layout attention's ``idx``)."""
        if not self.block:
            return slots
        return torch.where(slots >= 0, self.physical(slots.clamp(min=0)), -1)

    def write(self, slots: torch.Tensor | slice, rows: torch.Tensor) -> None:
        """Logical ``slots`` set to ``rows`` [k, width]."""
        at = self.physical(slots)
        for store, new in self._parts(rows):
            store[at] = new

    def write_at_block_end(self, pos: torch.Tensor, ratio: int, offset: int, rows: torch.Tensor,
                           ring: int = 0) -> None:
        """``write(pos // ratio + offset, rows)`` where the token at ``pos`` (int64 [1], on the store's device)
        completes a block (``pos % ratio == ratio - 1``), else the rows are left as they are: a write decided on
        the device, with no host sync (graph decode's compressed entries); ``ring`` > 0: at that slot modulo
        ``ring`` (ratio 1, offset 0: the window row of the token, slot ``pos % ring``). One row of a flat store is op
        ``put_at_block_end`` per storage tensor (one launch on a GPU); a paged store translates the slot on the
        device and takes torch's path."""
        for store, new in self._parts(rows):
            if new.shape[0] == 1 and pos.numel() == 1 and not self.block:
                implementation("put_at_block_end", store.device)(store, pos.reshape(1), ratio, offset, new, ring)
                continue
            slot = pos // ratio + offset
            cond, slots = pos % ratio == ratio - 1, self.physical(slot % ring if ring else slot)
            if store.dtype.itemsize == 1 and store.dtype != torch.uint8:  # torch.where has no float8 kernels
                store, new = store.view(torch.uint8), new.view(torch.uint8)
            store[slots] = torch.where(cond.view(-1, *([1] * (new.dim() - 1))), new, store[slots])

    def nbytes(self) -> int:
        """Bytes of the storage (paged: whole blocks)."""
        return sum(t.numel() * t.element_size() for t in self.parts())


class KVStore(_RowStore):
    """Rows [capacity, hd]: bf16, or FP8 packed rows ``packed`` uint8 [capacity, row bytes] (``kv_layout``: e4m3
    nope codes, bf16 rope dims, ue8m0 scale bytes, pad; 584 B at head_dim 512, the layout the FP8-layout attention
    kernel reads), with ``codes`` / ``rope`` / ``scales`` views of their parts. ``block`` > 0: paged (module
    docstring), the storage rounded up to whole blocks; every method takes logical slots."""

    def __init__(self, capacity: int, hd: int, rd: int, fmt: str, device: torch.device | str = "cpu",
                 block: int = 0, scale_floor: str = "amax"):
        self.capacity, self.hd, self.rd, self.fmt = capacity, hd, rd, fmt
        self.scale_floor = scale_floor  # the packed rows' FP8 scale rule (profile field kv_scale_floor)
        n = self._paged_rows(capacity, block, device)
        if fmt == "fp8":
            self.packed = torch.zeros(n, kv_layout.row_bytes(hd, rd), dtype=torch.uint8, device=device)
            self.codes, self.rope, self.scales = kv_layout.views(self.packed, hd, rd)
        else:
            self.rows = torch.zeros(n, hd, dtype=BF16, device=device)

    def _parts(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """rows [k, hd] bf16 whose nope dims are already FP8 values when fmt is fp8 (stored exactly)."""
        if self.fmt == "fp8":
            return [(self.packed, kv_layout.pack(rows, self.rd, self.scale_floor))]
        return [(self.rows, rows)]

    def stored_bytes(self, slots: torch.Tensor | slice, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, row bytes] (fmt fp8): the packed bytes held for the last rows of ``rows`` [n, hd] (the rows
        just written to ``slots``, read back through the block table), the first ``n - len(slots)`` (a prefill
        longer than the window, whose earlier rows the ring never keeps) packed as a write packs them."""
        held = self.packed[self.physical(slots)]
        lost = rows.shape[0] - held.shape[0]
        return torch.cat((kv_layout.pack(rows[:lost], self.rd, self.scale_floor), held)) if lost else held

    def parts(self) -> list[torch.Tensor]:
        return [self.packed if self.fmt == "fp8" else self.rows]

    def read(self, slots: torch.Tensor | slice) -> torch.Tensor:
        """bf16 rows [k, hd]."""
        at = self.physical(slots)
        if self.fmt != "fp8":
            return self.rows[at]
        rope = self.rope[at]
        return self._unpack_into(at, rope.new_empty((rope.shape[0], self.hd)))

    def read_into(self, slots: torch.Tensor | slice, out: torch.Tensor) -> torch.Tensor:
        """The bf16 rows of ``slots`` written into ``out`` [k, hd] (a preallocated workspace): the FP8 nope dims
        dequantized (rounded to bf16 on the copy), the bf16 rope dims as stored."""
        at = slots if on("paged-flat-addressing") else self.physical(slots)  # fault: the block table ignored
        if self.fmt != "fp8":
            return torch.index_select(self.rows, 0, at, out=out)
        return self._unpack_into(at, out)

    def _unpack_into(self, at: torch.Tensor | slice, out: torch.Tensor) -> torch.Tensor:
        """The packed FP8 storage rows ``at`` as bf16 [k, hd] in ``out``."""
        nope = self.hd - self.rd
        out[:, :nope] = dequantize_fp8(self.codes[at], self.scales[at], 64)
        out[:, nope:] = self.rope[at]
        return out


class KeyStore(_RowStore):
    """Indexer keys [capacity, d]: bf16 rows, or packed codes + ue8m0 scales (FP4 1x32 or FP8 1xmin(128, d)).
    ``block`` > 0: paged (module docstring); every method takes logical slots."""

    def __init__(self, capacity: int, d: int, fmt: str, packed: bool, device: torch.device | str = "cpu",
                 block: int = 0):
        self.capacity, self.d, self.fmt, self.packed = capacity, d, fmt, packed
        self.scale_block = 32 if fmt == "fp4" else min(128, d)
        n = self._paged_rows(capacity, block, device)
        if not packed:
            self.rows = torch.zeros(n, d, dtype=BF16, device=device)
        elif fmt == "fp4":
            self.codes = torch.zeros(n, d // 2, dtype=torch.uint8, device=device)
            self.scales = torch.zeros(n, d // 32, dtype=torch.uint8, device=device)
        else:
            self.codes = torch.zeros(n, d, dtype=torch.float8_e4m3fn, device=device)
            self.scales = torch.zeros(n, d // self.scale_block, dtype=torch.uint8, device=device)

    def _parts(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self.packed:
            return [(self.rows, rows)]
        codes, scales = quantize_fp4(rows, 32) if self.fmt == "fp4" else quantize_fp8(rows, self.scale_block)
        return [(self.codes, codes), (self.scales, scales)]

    def parts(self) -> list[torch.Tensor]:
        return [self.codes, self.scales] if self.packed else [self.rows]

    def read(self, slots: torch.Tensor | slice) -> torch.Tensor:
        """bf16 keys [k, d]."""
        at = self.physical(slots)
        if not self.packed:
            return self.rows[at]
        if self.fmt == "fp4":
            return dequantize_fp4(self.codes[at], self.scales[at], 32).to(BF16)
        codes, scales = self.codes, self.scales
        if on("indexer-keys-planar"):
            codes, scales = planar_read_interleaved(codes, scales, self.block or PLANAR_BLOCK)
        return dequantize_fp8(codes[at], scales[at], self.scale_block).to(BF16)

    def fp4_slices(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first n keys' packed FP4 codes [n, d/2] and scale bytes [n, d/32] (views when flat; paged, copies
        gathered through the block table, so the scoring kernel reads them contiguously), or None when the keys are
        not stored packed FP4."""
        if not (self.packed and self.fmt == "fp4"):
            return None
        at = self.physical(slice(0, n))
        return self.codes[at], self.scales[at]


PLANAR_BLOCK = 64  # keys per block of fault ``indexer-keys-planar``'s writer on a flat store (a paged one: its block)


def planar_read_interleaved(codes: torch.Tensor, scales: torch.Tensor, block: int) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """Fault ``indexer-keys-planar``: the e4m3 ``codes`` [n, d] and ue8m0 ``scales`` [n, s] of the stored keys as a
    reader that expects them interleaved per key (key j's d code bytes, then its s scale bytes, at j * (d + s)) parses
    a writer's block-planar bytes (a block's ``block`` keys' code bytes, then their scale bytes). The storage rows are
    zero-padded to whole blocks; the same bytes, permuted: key 0 of a block keeps its codes and reads the next key's
    first code bytes as its scales, later keys drift by s bytes per key."""
    n, d = codes.shape
    s, pad = scales.shape[1], -codes.shape[0] % block
    raw = torch.cat((codes.view(torch.uint8), scales), dim=1)
    raw = torch.cat((raw, raw.new_zeros(pad, d + s)))
    planar = torch.cat((raw[:, :d].reshape(-1, block * d), raw[:, d:].reshape(-1, block * s)), dim=1)
    parsed = planar.reshape(-1, d + s)[:n]
    return parsed[:, :d].contiguous().view(torch.float8_e4m3fn), parsed[:, d:].contiguous()


@dataclass
class CompressorCarry:
    """fp32 ``kv_state`` / ``score_state`` [coff*ratio, coff*d] (init 0 / -inf); overlap: [:r] previous block."""

    kv: torch.Tensor
    score: torch.Tensor

    @classmethod
    def empty(cls, ratio: int, d: int, device: torch.device | str = "cpu") -> CompressorCarry:
        coff = 2 if ratio == 4 else 1
        return cls(torch.zeros(coff * ratio, coff * d, device=device),
                   torch.full((coff * ratio, coff * d), float("-inf"), device=device))

    def nbytes(self) -> int:
        return 2 * self.kv.numel() * self.kv.element_size()


class LayerCache:
    """Everything layer ``i`` keeps between calls, allocated once."""

    def __init__(self, cfg: ModelConfig, i: int, profile: Profile, max_context: int,
                 device: torch.device | str = "cpu"):
        ratio, w = cfg.ratio(i), cfg.window_size
        self.ratio, self.window = ratio, w
        self.n_compressed = math.ceil(max_context / ratio) if ratio else 0
        block = profile.kv_block  # 0: flat
        self.kv = KVStore(w + self.n_compressed, cfg.head_dim, cfg.rope_head_dim, profile.kv_storage, device, block,
                          profile.kv_scale_floor)
        self.carry = CompressorCarry.empty(ratio, cfg.head_dim, device) if ratio else None
        self.keys = self.index_carry = None
        if ratio == 4:
            n_keys = math.ceil(max_context / 4)
            self.keys = KeyStore(n_keys, cfg.index_head_dim, profile.indexer_qk,
                                 profile.indexer_storage == "packed", device, block)
            self.index_carry = CompressorCarry.empty(4, cfg.index_head_dim, device)
        self.index_topk, self.gathers = cfg.index_topk, decode_gathers(profile)  # packed FP8 rows: attended in place
        self._size_decode_buffers(self.visible(), cfg.head_dim, device)
        self.spill: list[torch.Tensor] = []  # only the ``cache-concat-growth`` fault ever appends here

    def visible(self) -> int:
        """The most rows a decode step attends: the window, then the top-k's width (``topk_width``: the fault
        ``index-topk-hardcoded`` as injected now) of the compressed entries (CSA), or all of them (HCA)."""
        if self.ratio == 4:
            return self.window + min(topk_width(self.index_topk), self.n_compressed)
        return self.window + self.n_compressed

    def _size_decode_buffers(self, rows: int, hd: int, device: torch.device | str) -> None:
        """Allocate the decode's ``slots`` [1, rows] (the cache slot of each attended row) and, where decode gathers,
        its bf16 ``gather`` buffer [rows, hd] (else [0, hd])."""
        self.gather = torch.zeros(rows if self.gathers else 0, hd, dtype=BF16, device=device)
        self.slots = torch.zeros(1, rows, dtype=torch.long, device=device)

    def decode_buffers(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``k`` attended rows' ``slots`` [1, k] and ``gather`` rows [k, hd] ([0, hd] where
        decode does not gather). Sized once; re-allocated (to :meth:`visible`) only where ``k`` outgrows them: a
        wider top-k than the session was made with (fault ``index-topk-hardcoded`` injected after)."""
        if k > self.slots.shape[1]:
            self._size_decode_buffers(max(k, self.visible()), self.gather.shape[1], self.slots.device)
        return self.slots[:, :k], self.gather[:k]

    def nbytes(self) -> dict[str, int]:
        out = {"kv": self.kv.nbytes(), "gather": self.gather.numel() * 2 + self.slots.numel() * 8}
        if self.spill:
            out["spill"] = sum(t.numel() * t.element_size() for t in self.spill)
        if self.carry is not None:
            out["compressor_state"] = self.carry.nbytes()
        if self.keys is not None:
            out["indexer_keys"] = self.keys.nbytes()
            out["compressor_state"] += self.index_carry.nbytes()
        return out


def decode_gathers(profile: Profile) -> bool:
    """Does decode gather the visible KV rows into a bf16 workspace? Yes for bf16 rows and for an FMHA profile
    that rounds its inputs; packed FP8 rows with the bf16 FMHA are attended in place (``Attention.packed``)."""
    return not (profile.kv_storage == "fp8" and profile.fmha == "bf16")


def kv_row_bytes(cfg: ModelConfig, fmt: str) -> int:
    """Bytes of one KV row: bf16 2*hd, or the packed FP8 row: (hd - rd) codes + 2*rd rope + (hd - rd)/64 scales,
    padded to a multiple of 8 (``kv_layout.row_bytes``; 584 at head_dim 512)."""
    if fmt == "fp8":
        return kv_layout.row_bytes(cfg.head_dim, cfg.rope_head_dim)
    return 2 * cfg.head_dim


def key_row_bytes(cfg: ModelConfig, fmt: str, packed: bool) -> int:
    """Bytes of one indexer key: bf16 2*d, packed FP4 d/2 + d/32, packed FP8 d + d/min(128, d)."""
    d = cfg.index_head_dim
    if not packed:
        return 2 * d
    return d // 2 + d // 32 if fmt == "fp4" else d + d // min(128, d)
