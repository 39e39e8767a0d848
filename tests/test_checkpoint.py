"""Checkpoint I/O: expected tensors (spec §2), exact round trips in every layout, transformers interop,
deterministic synthesis, and one CheckpointError listing every planted problem."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fidelity.model.checkpoint import Checkpoint, CheckpointError, StoredTensor
from fidelity.model.config import ModelConfig
from fidelity.model.layouts import hf_module_source
from fidelity.model.load import load_checkpoint
from fidelity.model.save import save_checkpoint
from fidelity.model.synthesize import synthesize
from fidelity.model.weights import expected_tensors

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

# tiny, structure-faithful: SWA / CSA / HCA / CSA layers, one hash layer, FP8 + FP4 experts
SMALL = ModelConfig.preset("tiny").replace(
    vocab_size=512, n_layers=4, n_hash_layers=1, compress_ratios=(0, 4, 128, 4), n_routed_experts=4, moe_inter_dim=128
)
LAYOUTS = ("deepseek", "official", "transformers")


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    return synthesize(SMALL, seed=0)


@pytest.fixture(scope="module")
def saved(ckpt: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    return {layout: save_checkpoint(ckpt, root / layout, layout) for layout in LAYOUTS}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern for exact comparison (-0.0 != 0.0); bf16 widened to fp32 exactly."""
    return t.float().view(torch.int32) if t.is_floating_point() else t.long()


def _assert_same(a: Checkpoint, b: Checkpoint, same_dtype: bool = True) -> None:
    assert a.names() == b.names()
    for name in a.names():
        x, y = a[name], b[name]
        assert torch.equal(_bits(x), _bits(y)), name
        if same_dtype:
            assert x.dtype == y.dtype, name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply ``edit(dict)`` to every tensor of a safetensors file and write it back."""
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _problems(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    return str(info.value)


# ---- what a config implies ----------------------------------------------------------------------------------


def test_expected_tensors_match_the_flash_dtype_census() -> None:
    """spec §2 census minus the MTP block: BF16 433-8, F32 417-11, F8_E4M3 375-10, I8 33792-768, I64 3."""
    specs = expected_tensors(ModelConfig.preset("flash"))
    counts: dict[str, int] = {}
    for s in specs.values():
        counts[s.fmt] = counts.get(s.fmt, 0) + 1
    assert counts == {"bf16": 425, "fp32": 406, "fp8": 365, "fp4": 33024, "int64": 3}
    assert specs["layers.0.ffn.gate.tid2eid"].shape == (129280, 6)
    assert "layers.3.ffn.gate.bias" in specs and "layers.2.ffn.gate.bias" not in specs


def test_expected_tensors_match_the_pro_shapes() -> None:
    s = expected_tensors(ModelConfig.preset("pro"))
    assert s["layers.0.attn.wq_a.weight"].shape == (1536, 7168)
    assert s["layers.0.attn.wq_b.weight"].shape == (65536, 1536)
    assert s["layers.0.attn.wo_a.weight"].shape == (16384, 4096)
    assert s["layers.0.attn.wo_b.weight"].shape == (7168, 16384)
    assert s["layers.0.attn.compressor.ape"].shape == (128, 512)  # Pro layers 0, 1 are HCA
    assert s["layers.2.attn.compressor.wkv.weight"].shape == (1024, 7168)
    assert s["layers.2.attn.indexer.wq_b.weight"].shape == (8192, 1536)
    assert s["layers.2.attn.indexer.compressor.ape"].shape == (4, 256)
    assert s["layers.5.ffn.experts.9.w2.weight"].shape == (7168, 3072)


# ---- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bit_exact(ckpt: Checkpoint, saved: dict[str, Path], layout: str) -> None:
    loaded = load_checkpoint(saved[layout])
    assert loaded.layout == layout
    _assert_same(ckpt, loaded, same_dtype=layout != "transformers")
    if layout == "official":
        assert loaded.config == SMALL
    else:  # transformers' spelling; the transformers layout drops quantization_config (weights are fp32)
        assert ModelConfig.from_file(saved[layout] / "config.json").to_hf_dict() == loaded.config.to_hf_dict()
        assert loaded.config.dim == SMALL.dim and loaded.config.compress_ratios == SMALL.compress_ratios


def test_loaded_weights_stay_in_stored_format(saved: dict[str, Path]) -> None:
    ck = load_checkpoint(saved["deepseek"])
    st = ck.stored("layers.0.attn.wq_a.weight")
    assert st.fmt == "fp8" and st.data.dtype == torch.float8_e4m3fn and st.scale.dtype == torch.float8_e8m0fnu
    assert st.scale.shape == (1, 2)
    ex = ck.stored("layers.1.ffn.experts.3.w2.weight")
    assert ex.fmt == "fp4" and ex.data.dtype == torch.int8 and ex.data.shape == (256, 64)
    assert ex.scale.shape == (256, 4)
    assert ck["layers.1.ffn.experts.3.w2.weight"].dtype == torch.float32
    assert ck["layers.0.attn_norm.weight"].dtype == torch.bfloat16
    assert ck["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert load_checkpoint(saved["official"]).stored("layers.0.attn.wo_a.weight").data.dtype == torch.bfloat16


def test_conversion_chain_is_exact(ckpt: Checkpoint, saved: dict[str, Path], tmp_path: Path) -> None:
    """transformers (fp32) -> official -> deepseek re-quantizes the values and still gets them back."""
    from_hf = load_checkpoint(saved["transformers"])
    official = load_checkpoint(save_checkpoint(from_hf, tmp_path / "o", "official"))
    chain = load_checkpoint(save_checkpoint(official, tmp_path / "d", "deepseek"))
    _assert_same(ckpt, chain, same_dtype=False)
    requant = load_checkpoint(save_checkpoint(load_checkpoint(saved["official"]), tmp_path / "r", "deepseek"))
    _assert_same(ckpt, requant)  # wo_a: bf16 in official, re-quantized to FP8 here


def test_sharded_round_trip(ckpt: Checkpoint, tmp_path: Path) -> None:
    path = save_checkpoint(ckpt, tmp_path / "sharded", "deepseek", max_shard_bytes=300_000)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert "layers.0.attn.wq_a.scale" in index["weight_map"]
    loaded = load_checkpoint(path)
    assert loaded.layout == "deepseek"
    _assert_same(ckpt, loaded)


def test_save_refuses_to_overwrite(ckpt: Checkpoint, saved: dict[str, Path], tmp_path: Path) -> None:
    target = _copy(saved["official"], tmp_path / "ck")
    with pytest.raises(FileExistsError, match="not empty"):
        save_checkpoint(ckpt, target, "deepseek")
    save_checkpoint(ckpt, target, "deepseek", overwrite=True)
    assert load_checkpoint(target).layout == "deepseek"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or old dirs left behind


# ---- layouts --------------------------------------------------------------------------------------------------


def test_layout_detection_and_release_aliases(ckpt: Checkpoint, saved: dict[str, Path], tmp_path: Path) -> None:
    assert {layout: load_checkpoint(p).layout for layout, p in saved.items()} == {x: x for x in LAYOUTS}
    path = _copy(saved["deepseek"], tmp_path / "v3_names")

    def v3_names(t: dict[str, torch.Tensor]) -> None:  # model. prefix, weight_scale_inv, e_score_correction_bias
        for k in list(t):
            new = "model." + k.replace(".scale", ".weight_scale_inv").replace(
                "gate.bias", "gate.e_score_correction_bias"
            )
            t[new] = t.pop(k)

    _rewrite(path / "model.safetensors", v3_names)
    loaded = load_checkpoint(path)
    assert loaded.layout == "deepseek"
    _assert_same(ckpt, loaded)


def test_official_accepts_float4_experts_and_ignores_mtp(
    ckpt: Checkpoint, saved: dict[str, Path], tmp_path: Path
) -> None:
    path = _copy(saved["official"], tmp_path / "f4")

    def f4(t: dict[str, torch.Tensor]) -> None:  # what convert.py writes: .view(torch.float4_e2m1fn_x2)
        for k in [k for k in t if ".experts." in k and k.endswith(".weight")]:
            t[k] = t[k].view(torch.float4_e2m1fn_x2)
        t["mtp.0.attn.attn_sink"] = torch.zeros(4)

    _rewrite(path / "model0-mp1.safetensors", f4)
    loaded = load_checkpoint(path)
    assert loaded.layout == "official" and loaded.ignored == ["mtp.0.attn.attn_sink"]
    _assert_same(ckpt, loaded)


# ---- transformers interop -------------------------------------------------------------------------------------


def _hf_value(sd: dict[str, torch.Tensor], name: str, config: ModelConfig) -> torch.Tensor:
    src = hf_module_source(name, config.n_routed_experts, config.moe_inter_dim, config.dim)
    t = sd[src.key]
    if src.index is not None:
        j, start, stop = src.index
        t = t[j, start:stop]
    return t


def test_transformers_layout_loads_in_hf(ckpt: Checkpoint, saved: dict[str, Path]) -> None:
    from transformers import DeepseekV4ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = DeepseekV4ForCausalLM.from_pretrained(saved["transformers"], output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    sd = model.state_dict()
    for name in ckpt.names():
        assert torch.equal(_bits(_hf_value(sd, name, SMALL)), _bits(ckpt[name])), name
    with torch.no_grad():
        logits = model(torch.arange(2, 22)[None]).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_load_what_hf_save_pretrained_writes(tmp_path: Path) -> None:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf = SMALL.to_hf_dict()
    hf.pop("quantization_config")
    hf.update(max_position_embeddings=4096, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**hf))
        model.save_pretrained(tmp_path / "saved")
    sd = model.state_dict()
    # the same weights under the raw module names (fused gate_up_proj / down_proj experts)
    raw = tmp_path / "raw"
    raw.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(raw / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tmp_path / "saved" / "config.json", raw / "config.json")
    for path in (tmp_path / "saved", raw):
        loaded = load_checkpoint(path)
        assert loaded.layout == "transformers" and loaded.config.n_layers == SMALL.n_layers
        for name in loaded.names():
            assert torch.equal(loaded[name], _hf_value(sd, name, SMALL)), name

    def plant(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.1.mlp.experts.down_proj"][:3].clone()
        t["model.layers.2.mlp.experts.gate_up_proj"] = t["model.layers.2.mlp.experts.gate_up_proj"].to(torch.int32)

    _rewrite(raw / "model.safetensors", plant)
    msg = _problems(raw)  # a fused tensor is reported once, not once per expert
    assert "2 problems" in msg
    shape = "wrong shape for fused 'model.layers.1.mlp.experts.down_proj' in model.safetensors: expected [4, 256, 128]"
    assert shape + ", found [3, 256, 128]" in msg
    dtype = "wrong dtype for fused 'model.layers.2.mlp.experts.gate_up_proj' in model.safetensors: expected F32/BF16"
    assert dtype + "/F16, found I32" in msg


# ---- synthesis ------------------------------------------------------------------------------------------------


def _stored_equal(a: StoredTensor, b: StoredTensor) -> bool:
    same = a.fmt == b.fmt and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    return same and (a.scale is None or torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)))


def test_synthesize_is_deterministic(ckpt: Checkpoint) -> None:
    again = synthesize(SMALL, seed=0, lazy=True)  # regenerated tensor by tensor, on access
    other = synthesize(SMALL, seed=1, lazy=True)
    assert all(_stored_equal(ckpt.stored(n), again.stored(n)) for n in ckpt.names())
    differ = [n for n in ckpt.names() if not _stored_equal(ckpt.stored(n), other.stored(n))]
    assert differ == ckpt.names()
    # one tensor does not depend on the others: a deeper model shares its first layers
    deeper = synthesize(SMALL.replace(n_layers=5, compress_ratios=(0, 4, 128, 4, 0)), seed=0, lazy=True)
    assert _stored_equal(ckpt.stored("layers.3.attn.wq_a.weight"), deeper.stored("layers.3.attn.wq_a.weight"))


def test_synthesize_stores_release_formats_and_sane_values(ckpt: Checkpoint) -> None:
    for name, spec in expected_tensors(SMALL).items():
        st = ckpt.stored(name)
        assert st.fmt == spec.fmt and tuple(ckpt[name].shape) == spec.shape, name
    assert ckpt.stored("layers.0.attn.wkv.weight").data.dtype == torch.float8_e4m3fn
    assert ckpt.stored("layers.0.ffn.experts.0.w1.weight").data.dtype == torch.int8
    w = ckpt["layers.0.attn.wq_a.weight"]
    assert 0.8 < float(w.std() * SMALL.dim**0.5) < 1.2
    assert 0.8 < float(ckpt["layers.0.attn_norm.weight"].float().mean()) < 1.2
    assert float(ckpt["layers.0.attn.attn_sink"].abs().min()) > 0
    assert float(ckpt["layers.1.attn.compressor.ape"].abs().max()) > 0.1
    assert float(ckpt["layers.1.ffn.gate.bias"].abs().max()) > 0
    tid = ckpt["layers.0.ffn.gate.tid2eid"]
    assert tid.shape == (SMALL.vocab_size, SMALL.n_activated_experts) and tid.min() >= 0
    assert tid.max() < SMALL.n_routed_experts and (tid[:, 0] != tid[:, 1]).all()


# ---- bad inputs: one error, every problem ---------------------------------------------------------------------


def test_every_tensor_problem_in_one_error(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved["deepseek"], tmp_path / "bad")

    def plant(t: dict[str, torch.Tensor]) -> None:
        del t["layers.1.attn.wq_b.weight"]  # missing tensor (its scale left orphaned)
        t["layers.0.attn.bogus.weight"] = torch.zeros(3)  # unexpected
        t["layers.0.attn_norm.weight"] = t["layers.0.attn_norm.weight"][:100].clone()  # wrong shape
        t["layers.2.attn.attn_sink"] = t["layers.2.attn.attn_sink"].bfloat16()  # wrong dtype
        del t["layers.0.attn.wkv.scale"]  # missing FP8 scale
        t["layers.1.ffn.experts.2.w1.scale"] = t["layers.1.ffn.experts.2.w1.scale"][:, :2].clone()  # bad scale

    _rewrite(path / "model.safetensors", plant)
    msg = _problems(path)
    assert "6 problems" in msg
    assert "missing tensor 'layers.1.attn.wq_b.weight': expected [512, 128] F8_E4M3" in msg
    assert "unexpected tensor 'layers.0.attn.bogus.weight' in model.safetensors: [3] F32" in msg
    assert "wrong shape for 'layers.0.attn_norm.weight'" in msg and "expected [256], found [100]" in msg
    assert "wrong dtype for 'layers.2.attn.attn_sink'" in msg and "expected F32, found BF16" in msg
    assert "missing scale for 'layers.0.attn.wkv.weight': expected 'layers.0.attn.wkv.scale' [1, 2] F8_E8M0" in msg
    assert (
        "wrong shape for scale 'layers.1.ffn.experts.2.w1.scale'" in msg and "expected [128, 8], found [128, 2]" in msg
    )


def test_truncated_and_missing_shards(ckpt: Checkpoint, tmp_path: Path) -> None:
    path = save_checkpoint(ckpt, tmp_path / "sharded", "official", max_shard_bytes=300_000)
    shards = sorted(path.glob("model-*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])  # truncated
    shards[-1].unlink()  # named by the index, gone
    msg = _problems(path)
    assert f"{shards[1].name}: unreadable safetensors file (truncated or corrupt)" in msg
    assert f"names shard '{shards[-1].name}'" in msg and "which does not exist" in msg
    # the tensors of both files in one line, not one line each
    assert f"missing or unreadable file(s) {shards[1].name}, {shards[-1].name}; repair or replace those first" in msg
    assert "missing tensor" not in msg and msg.count("tensors not found") == 1


def test_config_that_disagrees_with_the_weights(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved["official"], tmp_path / "cfg")
    raw = json.loads((path / "config.json").read_text())
    raw.update(dim=384, n_layers=3, compress_ratios=[0, 4, 128])
    (path / "config.json").write_text(json.dumps(raw))
    msg = _problems(path)
    assert "config.json disagrees with the weights: dim = 384, but 'embed.weight' in model0-mp1.safetensors" in msg
    assert "has shape [512, 256] (implies dim = 256)" in msg
    assert "n_layers = 3, but the weights hold layers 0..3 (4 layers)" in msg
    assert "wrong shape for 'layers.0.attn.wq_a.weight'" in msg  # per-tensor detail is listed too
    assert "unexpected tensor 'layers.3.attn.wq_a.weight'" in msg


def test_bad_config_fields_and_tp_shards(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved["official"], tmp_path / "cfg")
    raw = json.loads((path / "config.json").read_text())
    raw.update(score_func="bogus", o_groups=3)
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model0-mp1.safetensors").rename(path / "model0-mp2.safetensors")
    msg = _problems(path)
    assert "config.json: o_groups: expected a divisor of n_heads (4), found 3" in msg
    assert "config.json: score_func: expected one of" in msg and "found 'bogus'" in msg
    assert "model0-mp2.safetensors: tensor-parallel shard (rank 0 of mp=2); TP shards are not supported" in msg


def test_bad_hash_table_values(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(saved["deepseek"], tmp_path / "tid")

    def plant(t: dict[str, torch.Tensor]) -> None:
        t["layers.0.ffn.gate.tid2eid"][7, 1] = SMALL.n_routed_experts

    _rewrite(path / "model.safetensors", plant)
    msg = _problems(path)
    assert (
        "bad values in 'layers.0.ffn.gate.tid2eid'" in msg
        and "expected expert ids in [0, 4), found range [0, 4]" in msg
    )


def test_in_memory_checkpoint_is_checked(ckpt: Checkpoint) -> None:
    tensors = {n: ckpt.stored(n) for n in ckpt.names()}
    del tensors["head.weight"]
    tensors["layers.0.attn.attn_sink"] = StoredTensor.plain(torch.zeros(3))
    with pytest.raises(CheckpointError) as info:
        Checkpoint.from_tensors(SMALL, tensors)
    assert info.value.problems == [
        "missing tensor 'head.weight'",
        "wrong shape for 'layers.0.attn.attn_sink' (fp32): expected [4], found [3]",
    ]
