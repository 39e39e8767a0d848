"""The FP8 KV cache row (spec §3 ``kv_cache`` with FP8 nope dims): ``[nope e4m3 codes | rope dims as raw bf16 |
nope/64 ue8m0 scale bytes | zero pad to a multiple of 8 bytes]``. At DSv4's head_dim 512 / rope 64 that is
448 + 128 + 7 + 1 = 584 bytes, the layout production engines store (FlashMLA's sm90 decode reads it) and the one
the ``ws`` kernel ``sparse_attention_fp8kv`` reads; narrower models get the same layout at their widths.

Plain torch: the cache (``cache.KVStore``) and the emulation of ``sparse_attention_fp8kv`` both use it.
"""

from __future__ import annotations

import torch

from fidelity.model.formats import KV_SCALE_BLOCK, dequantize_fp8, packed_kv_row_bytes, quantize_fp8

BLOCK = KV_SCALE_BLOCK  # nope dims per ue8m0 scale byte (the in-place act_quant's block)


def row_bytes(head_dim: int, rope_dims: int) -> int:
    """Bytes of one packed row: codes + rope bf16 + scale bytes, padded to a multiple of 8 (584 at 512 / 64)."""
    return packed_kv_row_bytes(head_dim, rope_dims)


def pack(kv: torch.Tensor, rope_dims: int, scale_floor: str = "amax") -> torch.Tensor:
    """kv [m, d] -> uint8 [m, row_bytes(d, rope_dims)]: the e4m3 codes of the d - rope_dims nope dims (1x64 ue8m0
    blocks), the rope dims as raw bf16, the scale bytes, zero pad. The nope dims round as ``ops.kv_round``'s, with
    the scale rule ``scale_floor`` (profile field ``kv_scale_floor``: "amax" official, "scale" FlashMLA's;
    ``formats.ue8m0_scale``)."""
    nope = kv.shape[1] - rope_dims
    if kv.dim() != 2 or nope <= 0 or nope % BLOCK:
        raise ValueError(f"kv: expected [m, d] with d - {rope_dims} rope dims a positive multiple of {BLOCK}, "
                         f"found {list(kv.shape)}")
    codes, scales = quantize_fp8(kv[:, :nope], BLOCK, scale_floor)
    rope = kv[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    width = row_bytes(kv.shape[1], rope_dims)
    pad = torch.zeros((kv.shape[0], width - nope - 2 * rope_dims - nope // BLOCK), dtype=torch.uint8,
                      device=kv.device)
    return torch.cat((codes.view(torch.uint8), rope, scales, pad), dim=1)


def views(packed: torch.Tensor, head_dim: int, rope_dims: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parts of packed rows [m, row_bytes] as views (writes go to ``packed``): e4m3 codes [m, nope], bf16 rope
    [m, rope_dims], scale bytes uint8 [m, nope / 64]."""
    nope = head_dim - rope_dims
    codes = packed[:, :nope].view(torch.float8_e4m3fn)
    rope = packed[:, nope : nope + 2 * rope_dims].view(torch.bfloat16)
    scales = packed[:, nope + 2 * rope_dims : nope + 2 * rope_dims + nope // BLOCK]
    return codes, rope, scales


def unpack(packed: torch.Tensor, head_dim: int, rope_dims: int) -> torch.Tensor:
    """uint8 [m, row_bytes] -> bf16 [m, head_dim]: ``dequantize_fp8`` of the codes (code x 2^(b - 127) in fp32,
    exact; a 0xFF scale byte, the e8m0 NaN, makes its block NaN) rounded to bf16, then the rope dims as stored."""
    codes, rope, scales = views(packed, head_dim, rope_dims)
    return torch.cat((dequantize_fp8(codes, scales, BLOCK).to(torch.bfloat16), rope), dim=1)
