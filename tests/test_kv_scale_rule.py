"""The FP8 KV scale-floor rule (profile field ``kv_scale_floor``) and the stored-cache site ``L{i}.attn.kv_cache``.

The official rule floors the block amax at 1e-4 before dividing by 448 (``max(amax, 1e-4) / 448``), FlashMLA's floors
the scale (``max(amax / 448, 1e-4)``); both then round up to a power of two. They give the same bytes for every block
with amax above 448 * 2^-14 (0.0273) and different scale bytes below it. Checked here: the rules against an
independent float64 / ml_dtypes computation, the share of byte-identical random rows, the bytes-follow-a-rule test,
the production decoder under ``kv_scale_floor=scale`` against the oracle, and a trace holding its packed rows:
judged with its own rule it passes, with the default rule it fails at ``attn.kv_cache`` naming the rule, and a layout
bug (scale bytes swapped between rows) fails there too.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fidelity
from fidelity.decoders.production import ops
from fidelity.decoders.production.kv_layout import pack, row_bytes, unpack
from fidelity.decoders.profiles import get_profile
from fidelity.decoders.trace import TraceDecoder
from fidelity.harness.thresholds import kv_scale_floor
from fidelity.model import formats as F
from fidelity.model.checkpoint import Checkpoint, StoredTensor
from fidelity.model.config import ModelConfig
from fidelity.model.synthesize import synthesize
from fidelity.outputs.rundir import read_run
from probes.kv_cache import decode_kv_rows, kv_storage

AGREE_ABOVE = 448 * 2.0**-14  # 0.02734375: the rules' scales are equal for every amax above it
SMALL_LAYERS = (0, 1, 2)  # layers whose kv_norm weight is scaled down so the KV nope blocks have amax ~0.01


def _log_uniform_rows(n: int, width: int, lo: float = -6.0, hi: float = 3.0, seed: int = 0) -> torch.Tensor:
    """bf16 [n, width]: normal rows scaled so that each row's amax is 10^U(lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    amax = 10 ** (lo + (hi - lo) * torch.rand(n, 1, generator=g))
    return (x / x.abs().amax(1, keepdim=True) * amax).to(torch.bfloat16)


# ---- the two rules ----------------------------------------------------------------------------------------------


def _independent(x: np.ndarray, floor_on: str) -> tuple[np.ndarray, np.ndarray]:
    """Codes (uint8) and scale bytes of one 1x64 row of blocks from float64 math and ml_dtypes alone."""
    codes, scales = [], []
    for blk in x.astype(np.float64).reshape(-1, 64):
        amax = float(np.abs(blk).max())
        v = max(amax, 1e-4) / 448 if floor_on == "amax" else max(amax / 448, 1e-4)
        e = math.ceil(math.log2(v))
        e += 1 if 2.0**e < v else 0  # log2 rounding guards
        e -= 1 if 2.0 ** (e - 1) >= v else 0
        codes.append(np.clip(blk / 2.0**e, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
        scales.append(e + 127)
    return np.concatenate(codes), np.array(scales, dtype=np.uint8)


@pytest.mark.parametrize("floor_on", ["amax", "scale"])
def test_each_rule_matches_an_independent_float64_and_ml_dtypes_computation(floor_on):
    x = _log_uniform_rows(400, 448, seed=1)
    codes, scales = F.quantize_fp8(x, 64, floor_on)
    for r in range(len(x)):
        want_codes, want_scales = _independent(x[r].float().numpy(), floor_on)
        assert np.array_equal(codes[r].view(torch.uint8).numpy(), want_codes), r
        assert np.array_equal(scales[r].numpy(), want_scales), r
    assert torch.equal(F.fake_quant_fp8(x, 64, floor_on), F.dequantize_fp8(codes, scales, 64).to(torch.bfloat16))


def test_the_rules_give_the_same_scale_above_448_times_2_pow_minus_14_and_a_coarser_one_below():
    amax = torch.cat((torch.logspace(-9, 4, 200_001, dtype=torch.float64).float(),
                      torch.tensor([0.0, 1e-4, AGREE_ABOVE, 0.0448, 448e-4])))
    amax = torch.cat((amax, torch.nextafter(amax, torch.tensor(math.inf)), torch.nextafter(amax, torch.tensor(0.0))))
    official = F.ue8m0_scale(amax, F.FP8_MAX, F.FP8_AMAX_FLOOR)
    flash = F.ue8m0_scale(amax, F.FP8_MAX, F.FP8_AMAX_FLOOR, floor_on="scale")
    above = amax > AGREE_ABOVE
    assert torch.equal(official[above], flash[above])
    assert bool((official[~above] < flash[~above]).all())  # below: FlashMLA's stays 2^-13, the official shrinks
    assert bool((flash[~above] == 2.0**-13).all()) and float(official.min()) == 2.0**-22
    assert bool((amax >= 0.0448)[above].any()) and bool(above[amax >= 0.0448].all())  # the 0.0448 is inside
    with pytest.raises(ValueError, match=r"floor_on: expected one of \('amax', 'scale'\), found 'sclae'"):
        F.ue8m0_scale(amax, F.FP8_MAX, F.FP8_AMAX_FLOOR, "sclae")


def test_byte_identical_rows_are_exactly_those_whose_every_block_is_above_the_agreement_amax():
    """584 B rows (head_dim 512, rope 64) of random rows with amax log-uniform over 1e-6..1e3: a row's bytes agree
    between the rules iff every one of its 7 blocks has amax > 448 * 2^-14. The share measured (printed) depends on
    how the rows are drawn; the issue reported 54%."""
    kv = _log_uniform_rows(20_000, 512, seed=2)
    a, b = pack(kv, 64, "amax"), pack(kv, 64, "scale")
    assert a.shape[1] == row_bytes(512, 64) == 584
    same = (a == b).all(1)
    block_amax = kv[:, :448].float().abs().unflatten(1, (7, 64)).amax(-1)
    assert torch.equal(same, (block_amax > AGREE_ABOVE).all(1))
    assert torch.equal(unpack(a, 512, 64)[same], unpack(b, 512, 64)[same])
    one_block = _log_uniform_rows(20_000, 64, seed=3)
    same_block = (F.quantize_fp8(one_block, 64)[1] == F.quantize_fp8(one_block, 64, "scale")[1]).flatten()
    expected = (3 - math.log10(AGREE_ABOVE)) / 9  # the log-uniform share of amax above the agreement point
    assert abs(float(same_block.float().mean()) - expected) < 0.015
    print(f"byte-identical: {float(same.float().mean()):.4f} of 584 B rows, {float(same_block.float().mean()):.4f} "
          f"of single blocks (log-uniform expectation {expected:.4f})")


def test_stored_bytes_are_recognised_as_the_rule_that_wrote_them():
    x = _log_uniform_rows(5_000, 128, seed=4)
    for rule, other in (("amax", "scale"), ("scale", "amax")):
        codes, scales = F.quantize_fp8(x, 64, rule)
        assert bool(F.fp8_scale_follows_rule(codes, scales, 64, rule).all())
        again = F.quantize_fp8(F.fake_quant_fp8(x, 64, rule), 64, rule)  # re-quantized: a block may move to s / 2
        assert bool(F.fp8_scale_follows_rule(*again, 64, rule).all())
        small = x.float().abs().unflatten(1, (2, 64)).amax(-1) < 0.02  # distinguishable: amax well below 0.0273
        assert not bool(F.fp8_scale_follows_rule(codes, scales, 64, other)[small].any())
    # codes of values a quarter as large under the same scale: the rule would have chosen a smaller one (a power of
    # two more or less on scale and codes together stays self-consistent: that only the values show, rows_mismatch)
    codes, scales = F.quantize_fp8(x, 64)
    quarter = F.round_fp8_e4m3(x.float() / F.decode_e8m0(scales).repeat_interleave(64, 1) / 4)
    above_floor = x.float().abs().unflatten(1, (2, 64)).amax(-1) > 1e-3
    assert not bool(F.fp8_scale_follows_rule(quarter.to(torch.float8_e4m3fn), scales, 64, "amax")[above_floor].any())
    nan = scales.clone()
    nan[:, 0] = 0xFF
    assert not bool(F.fp8_scale_follows_rule(codes, nan, 64, "scale")[:, 0].any())


def test_the_probe_decodes_the_layout_and_tells_a_rule_from_a_bug():
    kv = _log_uniform_rows(64, 512, seed=5)
    packed = pack(kv, 64, "scale")
    rows = unpack(packed, 512, 64)
    assert torch.equal(decode_kv_rows(packed, 512, 64)[0], rows)  # the probe's own cut agrees with kv_layout's
    got = {k: int(v) for k, v in kv_storage(packed, rows, 512, 64, "scale").items()}
    assert got["rows_mismatch"] == got["rule_mismatch"] == got["other_rule_rows"] == 0 and got["rule_rows"] > 10
    wrong = {k: int(v) for k, v in kv_storage(packed, rows, 512, 64, "amax").items()}
    assert wrong["other_rule_rows"] == got["rule_rows"] and wrong["rule_mismatch"] == wrong["rows_mismatch"] == 0
    swapped = packed.clone()
    swapped[[0, 1], 576:583] = packed[[1, 0], 576:583]  # scale bytes of two rows exchanged
    assert int(kv_storage(swapped, rows, 512, 64, "scale")["rows_mismatch"]) == 2


def test_the_profile_field_is_validated_and_the_kernels_leave_the_flashmla_rule_to_the_emulation():
    assert get_profile("reference").kv_scale_floor == "amax"
    flash_profile = get_profile("fp8-kv-storage:kv_scale_floor=scale")
    assert flash_profile.changes() == {"kv_storage": "fp8", "kv_scale_floor": "scale"}
    with pytest.raises(ValueError, match=r"kv_scale_floor: expected one of \('amax', 'scale'\), found 'flash'"):
        get_profile("reference:kv_scale_floor=flash")
    assert kv_scale_floor({"name": "engine", "precision": "quantized"}) == "amax"
    with pytest.raises(ValueError, match=r"profile 'engine': kv_scale_floor: expected one of"):
        kv_scale_floor({"name": "engine", "kv_scale_floor": "flash"})
    kv = torch.cat((_log_uniform_rows(32, 64, seed=6), torch.randn(32, 64).to(torch.bfloat16)), dim=1)
    flash = ops.kv_round(kv, 64, "fp8", "scale")
    assert torch.equal(flash[:, :64], F.fake_quant_fp8(kv[:, :64], 64, "scale"))
    assert torch.equal(flash[:, 64:], kv[:, 64:])
    assert not torch.equal(flash, ops.kv_round(kv, 64, "fp8"))
    pytest.importorskip("triton")
    from fidelity.decoders.production.kernels._common import SCALE_FLOOR_FALLBACK
    from fidelity.decoders.production.kernels.act_quant import takes_kv_round
    from fidelity.decoders.production.kernels.kv_path import takes_kv_norm_rope_fp8

    assert takes_kv_round(kv, 64, "fp8", "scale") == SCALE_FLOOR_FALLBACK
    x, pos = torch.zeros(2, 512, dtype=torch.bfloat16), torch.arange(2)
    assert takes_kv_norm_rope_fp8(x, torch.ones(512), 1e-6, pos, torch.ones(32), "fp8", "scale") == SCALE_FLOOR_FALLBACK


# ---- a live run and its trace -------------------------------------------------------------------------------------

FLASH = "reference:kv_storage=fp8,kv_scale_floor=scale"


@pytest.fixture(scope="module")
def small_kv():
    """The tiny model with the nope half of kv_norm's weight scaled by 2^-8 in SMALL_LAYERS (window KV nope amax
    ~0.01: the rules' bytes differ there, their values hardly)."""
    cfg = ModelConfig.preset("tiny")
    ckpt = synthesize(cfg, seed=0)
    tensors = {name: ckpt.stored(name) for name in ckpt.names()}
    for i in SMALL_LAYERS:
        name = f"layers.{i}.attn.kv_norm.weight"
        w = tensors[name].data.clone()
        w[: cfg.head_dim - cfg.rope_head_dim] *= 2.0**-8
        tensors[name] = StoredTensor.plain(w)
    return Checkpoint.from_tensors(cfg, tensors)


@pytest.fixture(scope="module")
def flash_trace(small_kv, tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-rule")
    res = fidelity.run("production", small_kv, prompt=40, decode_steps=3, modes=("layer", "op"), out=root,
                       run_id="live", profile=FLASH, trace=root / "trace")
    return res, root


def test_the_production_decoder_under_the_flashmla_rule_passes_and_reports_its_stored_rows(flash_trace):
    res, _ = flash_trace
    assert res.verdict == "PASS", res.first_divergence
    df = read_run(res.run_dir)[0]
    kv = df[df["site"].str.endswith("attn.kv_cache")]
    assert set(kv["layer"]) == set(range(6)) and set(kv["step"]) == {0, 1, 2, 3}
    per_metric = kv.groupby("metric")["value"].sum()
    assert per_metric["rows_mismatch"] == per_metric["rule_mismatch"] == per_metric["other_rule_rows"] == 0
    rule_rows = kv[kv["metric"] == "rule_rows"].groupby("layer")["value"].sum()
    assert (rule_rows[list(SMALL_LAYERS)] > 0).all() and (rule_rows.drop(list(SMALL_LAYERS)) == 0).all()


def _judge(trace, ckpt, out, run_id):
    return fidelity.run(TraceDecoder(trace), ckpt, modes=("op",), out=out / "runs", run_id=run_id)


def _copy(trace, to):
    to.mkdir(parents=True)
    for f in trace.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_a_trace_packed_with_the_flashmla_rule_passes_with_its_rule_and_fails_naming_it_under_the_default(
        flash_trace, small_kv, tmp_path):
    _, root = flash_trace
    manifest = json.loads((root / "trace" / "trace.json").read_text())
    assert manifest["profile"]["kv_scale_floor"] == "scale"
    assert any(s.endswith("attn.kv_cache") for s in manifest["events"][0]["sites"])
    assert load_file(str(root / "trace" / manifest["events"][0]["call"]))["L0.attn.kv_cache"].dtype == torch.uint8
    own = _judge(root / "trace", small_kv, tmp_path, "own-rule")
    assert own.verdict == "PASS", own.first_divergence
    default = _copy(root / "trace", tmp_path / "traces" / "default-rule")
    manifest["profile"].pop("kv_scale_floor")  # an engine's profile that names no rule: the official one
    (default / "trace.json").write_text(json.dumps(manifest))
    res = _judge(default, small_kv, tmp_path, "default-rule")
    assert res.verdict == "FAIL"
    div = str(res.first_divergence)
    assert "L0.attn.kv_cache other_rule_rows" in div and "kv_scale_floor" in div and "FlashMLA" in div, div
    assert "not a bug" in div
    df = read_run(res.run_dir)[0]
    failing = df[(df["metric"] == "other_rule_rows") & (df["value"] > 0)]
    assert set(failing["layer"]) == set(SMALL_LAYERS)
    assert df[df["metric"].isin(["rows_mismatch", "rule_mismatch"])]["value"].sum() == 0


def test_a_layout_bug_in_the_stored_rows_fails_at_the_site(flash_trace, small_kv, tmp_path):
    """Scale bytes exchanged between two rows of the prefill's stored cache (a layer where they differ)."""
    _, root = flash_trace
    bugged = _copy(root / "trace", tmp_path / "traces" / "bugged")
    name = json.loads((root / "trace" / "trace.json").read_text())["events"][0]["call"]
    tensors = load_file(str(bugged / name))
    scale_at = 64 + 2 * 64  # tiny: 64 nope codes, 64 rope dims as bf16, then the scale byte
    layer, pair = next((i, (r, s)) for i in range(6) for c in [tensors[f"L{i}.attn.kv_cache"][:, scale_at]]
                       for r in range(len(c)) for s in range(r) if c[r] != c[s])
    rows = tensors[f"L{layer}.attn.kv_cache"]
    rows[list(pair), scale_at] = rows[list(pair[::-1]), scale_at]
    save_file(tensors, str(bugged / name))
    res = _judge(bugged, small_kv, tmp_path, "bugged")
    assert res.verdict == "FAIL"
    assert f"step 0 (prefill), L{layer}.attn.kv_cache rows_mismatch 2 > 0" in str(res.first_divergence)
    assert "layout" in str(res.first_divergence)


@pytest.mark.parametrize("block", [0, 2])
def test_the_store_reads_back_a_calls_rows_as_packed_with_its_rule(block):
    """``KVStore.stored_bytes`` (what the production decoder reports at ``attn.kv_cache``): the rows just written read
    back through the block table, the ones a prefill longer than the window never keeps packed as a write packs
    them; all of them the FlashMLA rule's bytes under ``scale_floor="scale"``."""
    from fidelity.decoders.production.cache import KVStore

    store = KVStore(4, 128, 64, "fp8", block=block, scale_floor="scale")
    kv = ops.kv_round(_log_uniform_rows(6, 128, seed=7), 64, "fp8", "scale")
    slots = torch.tensor([2, 3, 0, 1])  # positions 2..5 of a 6-token prefill in a 4-row ring
    store.write(slots, kv[2:])
    assert torch.equal(store.stored_bytes(slots, kv), pack(kv, 64, "scale"))
    assert torch.equal(store.read(torch.tensor([2])), kv[2:3])
