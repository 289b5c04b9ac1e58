"""Tiny random HF checkpoints written by transformers' own classes (the parity oracle).

``save_hf_checkpoint(config, path, seed)`` builds ``DeepseekV3ForCausalLM`` / ``DeepseekV32ForCausalLM``
/ ``GlmMoeDsaForCausalLM`` in float32 with eager attention, overwrites every weight with seeded
non-degenerate values (transformers' init zeroes some tensors and uses std 0.02, which makes tiny
models nearly uniform), and calls ``save_pretrained``. Returns the HF model for reference runs.
"""
from __future__ import annotations

import math

import torch

from splash_rollout.models.config import ModelConfig


def hf_classes(model_type: str):
    import transformers

    return {
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
    }[model_type]


def build_hf_model(config: ModelConfig, seed: int = 0):
    cfg_cls, model_cls = hf_classes(config.model_type)
    hf_cfg = cfg_cls(**config.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, std):
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + randn(p.shape, 0.1))
            elif name.endswith("norm.bias"):
                p.copy_(randn(p.shape, 0.1))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(randn(p.shape, 1.0))
            else:
                fan_in = p.shape[-1]
                p.copy_(randn(p.shape, 1.0 / math.sqrt(fan_in)))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(randn(b.shape, 0.05))
    return model


def save_hf_checkpoint(config: ModelConfig, path, seed: int = 0):
    model = build_hf_model(config, seed)
    model.save_pretrained(path)
    return model
