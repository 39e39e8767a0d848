"""A tiny model with V4-Flash's head widths: 512-d KV rows (584 B in FP8), 128-d indexer keys (68 B in FP4) and
top-512 selection, at a hidden size of 128 (layers as the tiny preset: CSA at 2 and 4)."""

from fidelity.model.config import ModelConfig

TINY = ModelConfig.preset("tiny")
FLASH_HEADS = TINY.replace(
    vocab_size=256, dim=128, head_dim=512, n_heads=2, o_groups=1, q_lora_rank=128, o_lora_rank=128,
    moe_inter_dim=128, n_routed_experts=2, n_activated_experts=1, index_n_heads=2, index_head_dim=128,
    index_topk=512,
)  # fmt: skip
