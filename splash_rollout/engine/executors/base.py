"""AttentionExecutor: how one attention layer runs for one step under one layout.

The model runner hands an executor the normed hidden rows ``x`` and gets back the attention output
rows. Which rows a rank carries between blocks is the executor's too (``local_rows``): every row,
replicated (TP, DOP, CP), or only the rows of the requests it owns (DP-attention, whose feed-forward
block then gathers its input and reduce-scatters its output). Everything a layout changes -- which
heads a rank projects, where a request's KV lives, which collectives run -- lives behind these
methods, so TP / DP / DOP / CP executors swap in without touching the runner.
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
        """attn: the layer's MLAAttention; x: [n, hidden] (after input_layernorm, the rows
        ``local_rows`` names) → [n, hidden]."""

    def local_rows(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The batch rows whose hidden states this rank carries between blocks: None for every row
        (replicated), else [n] int64, ascending."""
        return None

    def feed_forward(self, mlp: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer's feed-forward block on the rows this rank carries: x [n, hidden] → [n, hidden]."""
        return mlp(x)

    def sample_logits(self, h: torch.Tensor, batch: ForwardBatch, compute_logits, wanted: bool) -> torch.Tensor | None:
        """Logits [R, vocab] of ``batch.sample_rows`` where ``wanted`` (the rank that samples), None
        elsewhere. h: the last layer's output on the rows this rank carries; ``compute_logits``:
        [k, hidden] -> [k, vocab]. Every rank calls it (a layout may split the rows and gather)."""
        return compute_logits(h.index_select(0, batch.sample_rows)) if wanted else None
