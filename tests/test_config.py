"""ModelConfig: presets per spec §1, both config.json spellings, validation errors that name the field."""

import json

import pytest

from fidelity.model.config import ConfigError, ModelConfig

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)


def test_flash_preset_matches_the_spec_table():
    c = ModelConfig.preset("flash")
    shape = (c.dim, c.n_layers, c.n_heads, c.head_dim, c.rope_head_dim, c.q_lora_rank)
    assert shape == (4096, 43, 64, 512, 64, 1024)
    assert (c.n_routed_experts, c.n_activated_experts, c.route_scale, c.index_topk) == (256, 6, 1.5, 512)
    assert (c.compress_rope_theta, c.original_seq_len, c.rope_factor, c.swiglu_limit) == (160000.0, 65536, 16.0, 10.0)
    kinds = c.layer_kinds
    assert kinds[:2] == ("swa", "swa") and kinds.count("csa") == 21 and kinds.count("hca") == 20
    assert len(c.compress_ratios) == 44 and c.compress_ratios[-1] == 0  # MTP entry


def test_pro_preset_bootstraps_with_two_hca_layers():
    c = ModelConfig.preset("pro")
    shape = (c.dim, c.n_layers, c.n_heads, c.q_lora_rank, c.o_groups, c.n_routed_experts)
    assert shape == (7168, 61, 128, 1536, 16, 384)
    assert (c.route_scale, c.index_topk, c.moe_inter_dim) == (2.5, 1024, 3072)
    kinds = c.layer_kinds
    assert kinds[:2] == ("hca", "hca") and kinds.count("csa") == 30 and kinds.count("hca") == 31


def test_tiny_preset_is_structure_faithful_and_width_reduced():
    c = ModelConfig.preset("tiny")
    kinds = c.layer_kinds
    assert kinds.count("swa") == 2 and kinds.count("csa") >= 2 and kinds.count("hca") >= 2
    assert (c.window_size, c.hc_mult, c.hc_sinkhorn_iters, c.rope_head_dim) == (128, 4, 20, 64)
    assert c.n_hash_layers >= 1 and c.original_seq_len > 0
    assert 256 <= c.dim <= 512 and 4 <= c.n_heads <= 8 and c.head_dim == 128
    assert 4 <= c.index_n_heads <= 8 and c.index_head_dim == 64 and 32 <= c.index_topk <= 64
    assert 8 <= c.n_routed_experts <= 16 and c.n_activated_experts == 2
    for name in ("dim", "q_lora_rank", "moe_inter_dim", "o_lora_rank"):
        assert getattr(c, name) % 128 == 0


def test_one_error_names_every_bad_field():
    with pytest.raises(ConfigError) as err:
        ModelConfig.preset("tiny").replace(rope_head_dim=256, index_head_dim=96, compress_ratios=(0, 4, 64))
    text = str(err.value)
    assert "rope_head_dim: expected <= head_dim (128), found 256" in text
    assert "index_head_dim: expected a power of two (Hadamard transform), found 96" in text
    assert "compress_ratios: expected entries in (0, 4, 128), found [64]" in text
    assert "compress_ratios: expected one entry per layer (6" in text and "found 3" in text
    assert len(err.value.problems) == 5


@pytest.mark.parametrize("change, fragment", [
    ({"n_heads": 4, "o_groups": 3}, "o_groups: expected a divisor of n_heads (4), found 3"),
    ({"dim": 200}, "dim: expected a multiple of 128"),
    ({"n_activated_experts": 9}, "n_activated_experts: expected <= n_routed_experts (8), found 9"),
    ({"score_func": "relu"}, "score_func: expected one of"),
    ({"n_hash_layers": 7}, "n_hash_layers: expected <= n_layers (6), found 7"),
    ({"head_dim": 96, "rope_head_dim": 64}, "head_dim - rope_head_dim: expected a multiple of 64"),
    ({"window_size": 0}, "window_size: expected a positive integer, found 0"),
])
def test_invalid_field_is_named_with_expected_and_found(change, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.preset("tiny").replace(**change)


@pytest.mark.parametrize("preset", ["tiny", "flash", "pro"])
def test_both_spellings_round_trip(preset):
    c = ModelConfig.preset(preset)
    assert ModelConfig.from_dict(c.to_official_dict()) == c
    assert ModelConfig.from_dict(c.to_hf_dict()) == c


def test_transformers_config_class_round_trips_our_hf_spelling():
    from transformers import DeepseekV4Config

    c = ModelConfig.preset("flash")
    d = c.to_hf_dict()
    d.pop("model_type")
    d.pop("architectures")
    hf = DeepseekV4Config(**d).to_dict()
    assert ModelConfig.from_dict(hf) == c


def test_legacy_hf_keys_compress_ratios_and_num_hash_layers_are_read():
    raw = {"model_type": "deepseek_v4", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
           "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
           "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "index_n_heads": 4,
           "index_head_dim": 64, "compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1,
           "num_nextn_predict_layers": 0}
    c = ModelConfig.from_dict(raw)
    assert c.compress_ratios == (0, 4, 128, 0) and c.n_hash_layers == 1
    assert c.original_seq_len == 0  # no rope_scaling: no YaRN


def test_official_spelling_rejects_unknown_fields():
    d = ModelConfig.preset("tiny").to_official_dict()
    d["n_expert"] = 3
    with pytest.raises(ConfigError, match=r"unknown field\(s\).*n_expert"):
        ModelConfig.from_dict(d)


def test_mlp_layer_types_must_be_a_hash_prefix():
    d = ModelConfig.preset("tiny").to_hf_dict()
    d["mlp_layer_types"] = ["moe", "hash_moe", "moe", "moe", "moe", "moe"]
    with pytest.raises(ConfigError, match="mlp_layer_types: expected 'hash_moe' for a prefix"):
        ModelConfig.from_dict(d)


def test_from_file_reports_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        ModelConfig.from_file(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(bad)
    bad.write_text(json.dumps({**ModelConfig.preset("tiny").to_official_dict(), "dim": -1}))
    with pytest.raises(ConfigError, match=r"(?s)config.json: .*dim: expected a positive integer, found -1"):
        ModelConfig.from_file(bad)


# ---- where transformers and the official reference differ (spec §6): pinned, not tolerated ----

def test_hf_default_rope_dims_are_head_dim_over_8_so_our_hf_configs_state_them():
    """HF's default partial_rotary_factor is 64/512: with head_dim 128 it would rope only 16 dims.
    The reference always ropes the last rope_head_dim (64) dims; our HF spelling states it explicitly."""
    from transformers import DeepseekV4Config

    assert DeepseekV4Config(head_dim=128).qk_rope_head_dim == 16
    d = ModelConfig.preset("tiny").to_hf_dict()
    assert d["qk_rope_head_dim"] == 64 and d["partial_rotary_factor"] == 0.5


def test_yarn_mscale_other_than_one_is_rejected():
    """The reference applies no YaRN mscale; HF derives 0.1*ln(16)+1 unless attention_factor is 1.0."""
    d = ModelConfig.preset("tiny").to_hf_dict()
    d["rope_parameters"]["compress"]["attention_factor"] = 1.277
    with pytest.raises(ConfigError, match="attention_factor: the reference applies no YaRN mscale"):
        ModelConfig.from_dict(d)
