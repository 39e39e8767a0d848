"""The KV cache as a decoder stores it (site ``L{i}.attn.kv_cache``), judged against the decoder's own window KV
(``L{i}.attn.kv``) and the FP8 scale rule its profile names (``kv_scale_floor``); no oracle is involved.

A row is ``[nope e4m3 codes | rope dims as raw bf16 | nope/64 ue8m0 scale bytes | zero pad to a multiple of 8]``
(spec §5 with FP8 nope dims; 448 + 128 + 7 + 1 = 584 bytes at head_dim 512 / rope 64). The rows are cut here from
that description (not with the production decoder's ``kv_layout``, whose bugs this is meant to show) and decoded
exactly with ``formats.dequantize_fp8``.
"""

from __future__ import annotations

import torch

from fidelity.model.formats import SCALE_FLOORS, dequantize_fp8, fp8_scale_follows_rule

KV_BLOCK = 64  # nope dims per ue8m0 scale byte


def decode_kv_rows(cache: torch.Tensor, head_dim: int, rope_dims: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """Packed rows uint8 [n, row_bytes] -> (bf16 rows [n, head_dim]: codes x 2^(b-127) rounded to bf16, then the
    rope dims as stored; e4m3 codes uint8 [n, nope]; scale bytes uint8 [n, nope/64])."""
    nope = head_dim - rope_dims
    codes = cache[:, :nope].contiguous()
    rope = cache[:, nope : nope + 2 * rope_dims].contiguous().view(torch.bfloat16)
    scales = cache[:, nope + 2 * rope_dims : nope + 2 * rope_dims + nope // KV_BLOCK].contiguous()
    values = dequantize_fp8(codes, scales, KV_BLOCK).to(torch.bfloat16)
    return torch.cat((values, rope), dim=1), codes, scales


def kv_storage(cache: torch.Tensor, kv: torch.Tensor | None, head_dim: int, rope_dims: int,
               scale_floor: str) -> dict[str, torch.Tensor]:
    """Metrics of one call's stored rows ``cache`` (integer [n, row_bytes]: bytes) against the decoder's window KV
    ``kv`` (float [n, head_dim], None when not reported) under the profile's scale rule ``scale_floor`` ("amax"
    official, "scale" FlashMLA's; ``formats.ue8m0_scale``):

    * ``rows_mismatch``: rows whose decoded values differ from ``kv`` bit for bit (as fp32 bits, so a sign of
      zero counts; NaN equals NaN): what the cache holds is not what the decoder computed (a layout or store bug).
    * ``rule_mismatch``: rows with a block whose ue8m0 scale neither rule gives for its codes
      (``formats.fp8_scale_follows_rule``): a quantizer or layout bug.
    * ``other_rule_rows``: rows the profile's rule cannot have written and the other rule can: the engine quantizes
      with the other rule (a profile that names the wrong ``kv_scale_floor``, not a numerical bug).
    * ``rule_rows`` (informational): rows that one rule can have written and the other not, i.e. where the choice
      of rule shows in the bytes (blocks with amax below 448 * 2^-14).
    """
    if scale_floor not in SCALE_FLOORS:
        raise ValueError(f"kv_scale_floor: expected one of {SCALE_FLOORS}, found {scale_floor!r}")
    cache = cache.view(torch.uint8) if cache.dtype == torch.int8 else cache.to(torch.uint8)
    rows, codes, scales = decode_kv_rows(cache, head_dim, rope_dims)
    other = next(r for r in SCALE_FLOORS if r != scale_floor)
    own = fp8_scale_follows_rule(codes, scales, KV_BLOCK, scale_floor).all(-1)
    alt = fp8_scale_follows_rule(codes, scales, KV_BLOCK, other).all(-1)
    out = {"rule_mismatch": (~own & ~alt).sum(), "other_rule_rows": (~own & alt).sum(), "rule_rows": (own ^ alt).sum()}
    if kv is not None:
        a, b = rows.float(), kv.to(rows.device).float()
        same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
        out = {"rows_mismatch": (~same.all(-1)).sum(), **out}
    return out
