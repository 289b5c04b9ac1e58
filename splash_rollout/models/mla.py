"""Multi-head latent attention (MLA), absorbed form, with the optional DSA indexer.

Projections are split so the engine can run them piecewise under any layout:
``project_q`` (q_a -> norm -> q_b, or q_proj), ``project_kv`` (kv_a -> latent norm, roped k_pe),
``w_uk`` / ``w_uv`` (views of kv_b_proj), then ``attention_math.absorbed_attention`` and o_proj.
Weight layouts stay HF's: q_b_proj rows head-major [H*(nope+rope)], kv_b_proj rows [H*(nope+v)],
o_proj columns [H*v], so heads can be sliced out of them.
"""
from __future__ import annotations

import torch
from torch import nn

from splash_rollout.models.attention_math import absorbed_attention, indexer_scores, indexer_select
from splash_rollout.models.config import ModelConfig
from splash_rollout.models.indexer import Indexer
from splash_rollout.models.norm import RMSNorm
from splash_rollout.models.numerics import Linear, head_matmul
from splash_rollout.models.rope import RotaryEmbedding, apply_rope, softmax_scale


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.softmax_scale = softmax_scale(config)
        # DeepSeek-V3.2 and GLM-5 always store rope dims interleaved; V3 follows its config flag.
        self.rope_interleave = config.rope_interleave if config.model_type == "deepseek_v3" else True
        h, qk = config.num_heads, config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)  # eps 1e-6 as in transformers, not rms_norm_eps
            self.q_b_proj = Linear(config.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, config.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = Linear(config.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(h * self.v_dim, config.hidden_size, bias=False)
        self.index_topk = config.index_topk if config.has_indexer else 0
        """Keys a query attends at most under DSA (0: no selection)."""
        self.uses_shared_topk = config.has_indexer and config.indexer_type(layer_idx) == "shared"
        self.indexer = Indexer(config, rotary) if config.has_indexer and not self.uses_shared_topk else None
        self._rotary = (rotary,)  # shared across layers, kept out of the module tree

    # ---- pieces the engine calls ---------------------------------------------------------------
    def project_q(self, hidden: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [N, hidden] -> (q_nope [N,H,nope], q_pe [N,H,rope] roped, q_a [N,q_lora] or None)."""
        if self.q_lora_rank is None:
            q_a, q = None, self.q_proj(hidden)
        else:
            q_a = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_a)
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        cos, sin = self._rotary[0].cos_sin(positions, q.dtype)
        q_pe = apply_rope(q[..., self.nope_dim:], cos, sin, self.rope_interleave)
        return q[..., : self.nope_dim], q_pe, q_a

    def project_kv(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] -> (c_kv [N, kv_lora] normed latent, k_pe [N, rope] roped)."""
        kv = self.kv_a_proj_with_mqa(hidden)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        cos, sin = self._rotary[0].cos_sin(positions, kv.dtype)
        k_pe = apply_rope(kv[:, self.kv_lora_rank:], cos, sin, self.rope_interleave)
        return c_kv, k_pe

    def _kv_b(self) -> torch.Tensor:  # [H, nope + v, kv_lora]
        return self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def w_uk(self) -> torch.Tensor:
        """[H, nope, kv_lora] view of kv_b_proj.weight: k_nope[h] = w_uk[h] @ c_kv."""
        return self._kv_b()[:, : self.nope_dim, :]

    def w_uv(self) -> torch.Tensor:
        """[H, kv_lora, v] view of kv_b_proj.weight: v[h] = c_kv @ w_uv[h]."""
        return self._kv_b()[:, self.nope_dim:, :].transpose(1, 2)

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, nope] -> q_nope_abs [N, H, kv_lora]."""
        return head_matmul(q_nope, self.w_uk())

    def output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """out_latent [N, H, kv_lora] -> [N, hidden] (W_UV then o_proj)."""
        v = head_matmul(out_latent, self.w_uv())
        return self.o_proj(v.reshape(v.shape[0], -1))

    # ---- training forward over whole sequences -------------------------------------------------
    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                prev_selected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, S, hidden], positions [S], allowed [B, S, S] bool (causal & valid keys),
        prev_selected [B, S, S] (top-k of the previous full indexer layer; needed on shared layers).
        Returns (out [B, S, hidden], selected [B, S, S] or None without DSA)."""
        b, s, d = hidden.shape
        flat = hidden.reshape(b * s, d)
        pos = positions.repeat(b)
        q_nope, q_pe, q_a = self.project_q(flat, pos)
        c_kv, k_pe = self.project_kv(flat, pos)
        q_abs = self.absorb_q(q_nope)
        selected = None
        if self.indexer is not None:
            with torch.no_grad():
                iq, iw = self.indexer.index_q(flat, q_a, pos)
                ik = self.indexer.index_k(flat, pos)
                selected = torch.stack([
                    indexer_select(indexer_scores(iq[i * s:(i + 1) * s], iw[i * s:(i + 1) * s],
                                                  ik[i * s:(i + 1) * s]), allowed[i], self.indexer.topk,
                                   self.indexer.tie_break)
                    for i in range(b)])
        elif self.uses_shared_topk:
            if prev_selected is None:
                raise ValueError(f"layer {self.layer_idx}: a 'shared' indexer layer needs a previous 'full' layer")
            selected = prev_selected & allowed
        mask = allowed if selected is None else selected
        outs = []
        for i in range(b):
            rows = slice(i * s, (i + 1) * s)
            out, _ = absorbed_attention(q_abs[rows], q_pe[rows], c_kv[rows], k_pe[rows], mask[i],
                                        self.softmax_scale)
            outs.append(out)
        return self.output(torch.cat(outs)).view(b, s, d), selected
