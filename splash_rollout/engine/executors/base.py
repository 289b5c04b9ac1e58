"""AttentionExecutor: how one attention layer runs for one step under one layout.

The model runner hands an executor the normed hidden rows ``x: [N, hidden]`` (replicated, full
rows) and gets back the attention output rows ``[N, hidden]``. Everything a layout
changes -- which heads a rank projects, where a request's KV lives, which collectives run -- lives
behind this one method, so TP / DP / DOP / CP executors swap in without touching the runner.
Executors take their local sizes from what they are constructed with (a rank view of the layout),
never from the world size.
"""
from __future__ import annotations

import abc

import torch

from splash_rollout.engine.forward_batch import ForwardBatch


class AttentionExecutor(abc.ABC):
    @abc.abstractmethod
    def forward(self, attn: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """attn: the layer's MLAAttention; x: [N, hidden] (after input_layernorm) → [N, hidden]."""
