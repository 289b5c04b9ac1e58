"""The multi-token-prediction (MTP) module of DeepSeek-V3 and GLM-5: the model's own draft of the
token after next.

Why it is here: DeepSeek-V3 and the GLM-4.5/5 family are trained with MTP modules
(``num_nextn_predict_layers``) and ship them in their checkpoints; SGLang and vLLM draft with them
(DeepSeek-V3 reports 85-90 % acceptance of the second token). Module k (k = 1, 2, ...) takes, at
position i, the representation of the depth before it -- the main model's final-normed hidden
state for k = 1 -- and the embedding of token i + k, and predicts token i + k + 1:

    h'_i = eh_proj([enorm(embed(t_{i+k})); hnorm(h_i)])        (embedding first, as the checkpoints are trained)
    h_i^k = DecoderLayer(h'_i)  over positions 0 .. S - k - 1, causal, at position i
    logits_i^k = head(shared_head.norm(h_i^k))

One decoder layer (MLA, and MoE where the model's layers past ``first_k_dense_replace`` are; a DSA
model's MTP layer runs its own indexer), the main model's embedding and LM head (DeepSeek-V3's
files carry copies of both under the module's names; they are the same tensors), and norms of its
own. The DeepSeek-V3 paper writes the concatenation hidden-first; the released weights (and every
serving implementation of them) take the embedding first.

Names: in the model the modules are ``model.mtp_layers.{k-1}.*``; in a checkpoint they are the
layers after the decoder's, ``model.layers.{num_layers + k - 1}.*`` (``checkpoint_name`` /
``model_name`` map between the two), so the decoder's layer loop never meets them.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from splash_rollout.models.config import ModelConfig
from splash_rollout.models.model import DecoderLayer
from splash_rollout.models.norm import RMSNorm
from splash_rollout.models.numerics import Linear
from splash_rollout.models.rope import RotaryEmbedding

MTP_PREFIX = "model.mtp_layers."
SHARED_WITH_MAIN = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""A checkpoint's MTP-module tensor (suffix) -> the main model's tensor it is (not stored twice here)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")


class SharedHeadNorm(nn.Module):
    """``shared_head``: the norm before the (main model's) LM head; named as the checkpoints name it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """MTP module ``depth`` (0-based): a DecoderLayer at index ``num_layers + depth`` with the
    module's own input norms, projection and head norm."""

    def __init__(self, config: ModelConfig, depth: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, config.num_layers + depth, rotary)
        self.depth = depth
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHeadNorm(config)

    def combine(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_embeds [..., hidden] (embeddings of the next tokens), hidden [..., hidden] (the depth
        before's state at the same positions) -> the layer's input [..., hidden]."""
        return self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))

    def predict(self, next_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module over a batch: next_embeds, hidden [B, S', hidden] (``combine``'s inputs), positions
        [S'], allowed [B, S', S'], head [vocab, hidden] (the LM head's weight) -> (its state [B, S',
        hidden], what the next depth reads; its logits [B, S', vocab])."""
        state, _ = self(self.combine(next_embeds, hidden), positions, allowed, None)
        return state, self.head_logits(state, head)

    def head_logits(self, state: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """state [..., hidden] -> logits [..., vocab] through ``shared_head.norm`` and the LM head's weight."""
        return torch.nn.functional.linear(self.shared_head.norm(state), head)


def checkpoint_name(name: str, config: ModelConfig) -> str:
    """``model.mtp_layers.{k}.X`` -> ``model.layers.{num_layers + k}.X``; other names unchanged."""
    m = _MTP.match(name)
    return f"model.layers.{config.num_layers + int(m.group(1))}.{m.group(2)}" if m else name


def model_name(key: str, config: ModelConfig) -> tuple[str | None, int | None]:
    """A checkpoint key -> (the model's name for it, or None when the model holds it elsewhere --
    an MTP module's copy of the embedding or LM head; the MTP depth, or None for a decoder tensor)."""
    m = _LAYER.match(key)
    if not m or int(m.group(1)) < config.num_layers:
        return key, None
    depth, rest = int(m.group(1)) - config.num_layers, m.group(2)
    return (None if rest in SHARED_WITH_MAIN else f"{MTP_PREFIX}{depth}.{rest}"), depth


def is_mtp_name(name: str) -> bool:
    return name.startswith(MTP_PREFIX)
