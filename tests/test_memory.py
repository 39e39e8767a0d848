"""Analytic cache sizes (``fidelity.decoders.production.cache_sizes``) equal what ``ProductionSession`` allocates,
byte for byte; the Flash / Pro figures at 1M context are pinned to hand-derived numbers."""

from __future__ import annotations

import pytest

from fidelity.decoders.production import ProductionModel, get_profile
from fidelity.decoders.production.cache import decode_gathers
from fidelity.decoders.production.cache_sizes import cache_bytes, format_memory, memory_main, profile_formats
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from tests.flash_heads import FLASH_HEADS, TINY

PROFILES = ("reference", "fp8-kv-storage", "fp4-indexer-packed", "fp8-indexer:indexer_storage=packed",
            "fp8-fmha:kv_storage=fp8")  # the last gathers its packed FP8 rows (its FMHA rounds the inputs)
CONTEXTS = (1, 3, 4, 127, 128, 129, 130, 1000, 4097)
GiB = 1 << 30


@pytest.mark.parametrize("cfg", [TINY, FLASH_HEADS], ids=["tiny", "flash-heads"])
@pytest.mark.parametrize("profile", PROFILES)
def test_analytic_sizes_equal_the_session_allocation(cfg: ModelConfig, profile: str):
    ckpt = synthesize(cfg, seed=0, lazy=True)  # sessions allocate caches without reading weights
    prof = get_profile(profile)
    kv_fmt, index_fmt = profile_formats(prof)
    for n in CONTEXTS:
        session = ProductionModel(ckpt, prof, max_context=n).session()
        report = cache_bytes(cfg, n, kv_fmt, index_fmt, decode_gathers(prof))
        assert session.cache_bytes() == report.total(), f"{profile}, max_context {n}"
        for i, layer in enumerate(session.layers):
            m = report.layers[cfg.layer_kinds[i]]
            got = layer.nbytes()
            assert set(got) <= {"kv", "gather", "indexer_keys", "compressor_state"}
            assert got["kv"] == m.window + m.compressed_kv, f"layer {i}, max_context {n}"
            assert got["gather"] == m.gather
            assert got.get("indexer_keys", 0) == m.indexer_keys
            assert got.get("compressor_state", 0) == m.compressor_state


def test_row_sizes_and_formats():
    assert [cache_bytes(FLASH_HEADS, 8, kv, ix).kv_row for kv, ix in [("bf16", "bf16"), ("fp8", "fp4")]] == [1024, 584]
    assert [cache_bytes(FLASH_HEADS, 8, "fp8", ix).key_row for ix in ("bf16", "fp4", "fp8")] == [256, 68, 129]
    assert profile_formats(get_profile("fp8-indexer")) == ("bf16", "bf16")  # fp8 values, bf16 rows
    assert profile_formats(get_profile("reference:kv_storage=fp8,indexer_storage=packed")) == ("fp8", "fp4")
    with pytest.raises(ValueError, match=r"kv_fmt: expected one of \('bf16', 'fp8'\), found 'fp4'"):
        cache_bytes(TINY, 8, "fp4")
    with pytest.raises(ValueError, match="index_fmt: expected one of"):
        cache_bytes(TINY, 8, "bf16", "int8")
    with pytest.raises(ValueError, match="max_context: expected a positive integer, found 0"):
        cache_bytes(TINY, 0)


def test_flash_at_1m_context_pinned():
    """Flash: 2 SWA, 21 CSA, 20 HCA layers; 1M = 2^20 tokens -> 262144 CSA entries, 8192 HCA entries.

    bf16: CSA 1024/4 + 256/4 = 320 B/token/layer, HCA 1024/128 = 8 -> 21*320 + 20*8 = 6880 B/token.
    FP8 KV (the 584 B packed row: 448 codes + 128 rope + 7 scales + 1 pad) + FP4 keys: CSA 584/4 + 68/4 = 163,
    HCA 584/128 = 4.5625 -> 21*163 + 20*4.5625 = 3423 + 91.25 = 3514.25 B/token (padded the same). FP8 keys (129 B,
    padded 132): 3834.5 / 3850.25.
    Totals add the window (128 rows), the fp32 carry (CSA 65536 + 16384, HCA 524288 B) and the decode's slots per
    visible row (CSA 128+512, HCA 128+8192, SWA 128 rows): an 8 B slot, plus a 1024 B bf16 gather row with bf16
    KV (packed FP8 rows are attended in place).
    """
    cfg, n = ModelConfig.preset("flash"), 1 << 20
    bf16, fp8 = cache_bytes(cfg, n, "bf16", "bf16"), cache_bytes(cfg, n, "fp8", "fp4")
    assert (bf16.per_token("csa"), bf16.per_token("hca"), bf16.per_token()) == (6720.0, 160.0, 6880.0)
    assert (fp8.per_token("csa"), fp8.per_token("hca"), fp8.per_token()) == (3423.0, 91.25, 3514.25)
    assert fp8.per_token(padded=True) == 3514.25
    assert cache_bytes(cfg, n, "fp8", "fp8").per_token() == 3834.5
    assert cache_bytes(cfg, n, "fp8", "fp8").per_token(padded=True) == 3850.25
    # per layer: SWA 128*1024 + 128*1032; CSA 131072 + 2^28 + 2^26 + 81920 + 640*1032; HCA 131072 + 2^23 + 2^19 +
    # 8320*1032
    assert bf16.total() == 2 * 263168 + 21 * 336417792 + 20 * 17630208 == 7417904128  # 6.91 GiB
    # FP8: SWA 74752 + 1024; CSA 74752 + 262144*584 + 262144*68 + 81920 + 5120; HCA 74752 + 8192*584 + 524288 +
    # 66560
    assert fp8.total() == 2 * 75776 + 21 * 171079680 + 20 * 5449728 == 3701819392  # 3.45 GiB
    assert fp8.total(padded=True) == fp8.total()  # 584 B KV rows and 68 B FP4 keys need no padding


def test_pro_at_1m_context_pinned():
    """Pro: 30 CSA, 31 HCA (layers 0-1 are HCA), top-1024. bf16 30*320 + 31*8 = 9848 B/token; FP8 + FP4:
    30*163 + 31*584/128 = 5031.4375 B/token (padded the same)."""
    cfg, n = ModelConfig.preset("pro"), 1 << 20
    bf16, fp8 = cache_bytes(cfg, n, "bf16", "bf16"), cache_bytes(cfg, n, "fp8", "fp4")
    assert "swa" not in bf16.layers and bf16.layers["hca"].layers == 31 and bf16.layers["csa"].layers == 30
    assert (bf16.per_token(), fp8.per_token(), fp8.per_token(padded=True)) == (9848.0, 5031.4375, 5031.4375)
    assert bf16.total() == 30 * 336946176 + 31 * 17630208 == 10654921728  # 9.92 GiB
    assert fp8.total() == 30 * 171083776 + 31 * 5449728 == 5301454848  # 4.94 GiB


def test_format_and_main():
    text = memory_main("flash", None, 1 << 20)
    assert "43 layers (2 swa, 21 csa, 20 hca)" in text
    assert "KV fp8 (584 B/row, padded 584), indexer keys fp4 (68 B/row, padded 68)" in text
    assert "6880.00" in text and "3514.25" in text
    assert "6.91 GiB" in text and "3.45 GiB" in text
    assert format_memory(cache_bytes(TINY, 300)).count("\n") >= 5
    with pytest.raises(ValueError, match="not both"):
        memory_main("flash", "config.json", 8)
    with pytest.raises(ValueError, match="--context: expected a positive integer"):
        memory_main("pro", None, 0)


FULL_SHAPE_1M = {"flash": 3701819392, "pro": 5301454848}  # FP8 KV + FP4 keys at 1M: 3.45 / 4.94 GiB (pinned above)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_full_shape_session_at_1m_tokens_allocates_the_analytic_cache(preset: str):
    """Every layer of V4-Flash (43) / V4-Pro (61) at 1,048,576 tokens, FP8 KV rows + packed FP4 indexer keys, the
    weights lazy (never read): the session's cache tensors hold exactly the analytic bytes, layer by layer. Allocates
    3.45 / 4.94 GiB of host memory for a few seconds."""
    cfg, n = ModelConfig.preset(preset), 1 << 20
    prof = get_profile("reference:kv_storage=fp8,indexer_storage=packed")
    assert profile_formats(prof) == ("fp8", "fp4") and not decode_gathers(prof)
    report = cache_bytes(cfg, n, "fp8", "fp4", decode_gathers(prof))
    session = ProductionModel(synthesize(cfg, seed=0, lazy=True), prof, max_context=n).session()
    assert len(session.layers) == cfg.n_layers
    for i, layer in enumerate(session.layers):
        m = report.layers[cfg.layer_kinds[i]]
        got = layer.nbytes()
        assert got["kv"] == m.window + m.compressed_kv, f"layer {i}"
        assert got.get("indexer_keys", 0) == m.indexer_keys and got["gather"] == m.gather, f"layer {i}"
    assert session.cache_bytes() == report.total() == FULL_SHAPE_1M[preset]
