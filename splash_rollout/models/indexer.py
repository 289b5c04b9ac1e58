"""DSA lightning indexer (DeepSeek-V3.2, GLM-5): picks the top-k keys each query attends to.

Per token it caches one key ``index_k`` [index_head_dim]; per query it forms ``index_q`` [Hi, D]
from the normed q_a output and per-head weights ``index_w`` [Hi]. Scores and the selection live in
``attention_math`` (shared with the engine). The rope part is the first ``qk_rope_head_dim`` dims of
q and k; DeepSeek-V3.2 ropes them half-split, GLM-5 interleaved (as transformers does).
"""
from __future__ import annotations

import torch
from torch import nn

from splash_rollout.models.config import ModelConfig
from splash_rollout.models.numerics import LayerNorm, Linear
from splash_rollout.models.rope import RotaryEmbedding, apply_rope


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if config.q_lora_rank is None:
            raise ValueError("indexer: DSA needs q LoRA (q_lora_rank is None)")
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.tie_break = "position"  # see attention_math.indexer_select; "torch" = transformers' exact choice
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = config.model_type == "glm_moe_dsa"
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, bias=False)  # kept float32
        # relu(x * a) * b == relu(x) * (a * b) for a > 0: both scales ride on the head weights.
        self.weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5
        self._rotary = (rotary,)  # shared, not a submodule (no parameters, no state_dict entry)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rotary[0].cos_sin(positions, x.dtype)
        rot = apply_rope(x[..., : self.rope_dim], cos, sin, self.interleaved)
        return torch.cat([rot, x[..., self.rope_dim:]], dim=-1)

    def index_q(self, hidden: torch.Tensor, q_a: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden], q_a [N, q_lora] -> (index_q [N, Hi, D], index_w [N, Hi] float32)."""
        q = self.wq_b(q_a).view(-1, self.n_heads, self.head_dim)
        q = self._rope(q, positions)
        w = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float()
        return q, w * self.weight_scale

    def index_k(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> index_k [N, D] (what the cache stores per token)."""
        return self._rope(self.k_norm(self.wk(hidden)), positions)
