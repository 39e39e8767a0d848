"""Random tiny transformers ``DeepseekV4ForCausalLM`` models: the independent implementation the oracle is
checked against. Parameters HF initialises to zero or one (sinks, biases, position biases, hc base/scale,
routing bias, tid2eid) are randomised first so that they are exercised."""

from __future__ import annotations

import torch

from fidelity.model.config import ModelConfig


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    d = cfg.to_hf_dict()
    d.pop("quantization_config", None)
    d.pop("model_type", None)
    d.pop("architectures", None)
    return DeepseekV4Config(**d)


def _randomise(model, cfg: ModelConfig, gen: torch.Generator) -> None:
    """Give every parameter a realistic non-trivial value (HF's init zeroes several of them)."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if leaf in ("sinks",):
            val = torch.randn(shape, generator=gen)
        elif leaf in ("position_bias",):
            val = 0.5 * torch.randn(shape, generator=gen)
        elif leaf == "base" or leaf == "hc_base":
            val = 0.5 * torch.randn(shape, generator=gen)
        elif leaf == "scale" or leaf == "hc_scale":
            val = 0.5 + torch.rand(shape, generator=gen)
        elif leaf == "fn" or leaf == "hc_fn":
            val = torch.randn(shape, generator=gen) * shape[1] ** -0.5
        elif leaf == "weight" and p.ndim == 1:
            val = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            val = torch.randn(shape, generator=gen)
        elif p.ndim >= 2:
            val = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        else:
            val = torch.randn(shape, generator=gen)
        with torch.no_grad():
            p.copy_(val.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        elif name.endswith("tid2eid"):
            rows = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.n_activated_experts]
                                for _ in range(b.shape[0])])
            b.copy_(rows.to(b.dtype))


def random_hf_model(cfg: ModelConfig, seed: int = 0):
    """A float32 ``DeepseekV4ForCausalLM`` for ``cfg`` with every parameter randomised deterministically."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    _randomise(model, cfg, torch.Generator().manual_seed(seed))
    return model
