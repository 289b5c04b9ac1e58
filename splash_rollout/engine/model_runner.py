"""ModelRunner: one forward step of the decoder over a ForwardBatch, with paged KV.

The runner owns the layer loop (embedding → per layer: attention, then the feed-forward block →
logits of the sampled rows). It never looks at the layout: the executor says which rows this rank
carries and runs both blocks' collectives.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import AttentionExecutor
from splash_rollout.engine.forward_batch import ForwardBatch, forward_context


class ModelRunner:
    def __init__(self, model: torch.nn.Module, executor: AttentionExecutor) -> None:
        self.model = model
        self.executor = executor

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, before_layer=None) -> torch.Tensor:
        """→ logits [r, vocab] of the sampled rows this rank samples (``executor.sampling_ranks``),
        in sample order.
        ``before_layer(i)``: called before layer i runs (a live switch installs layer i's state)."""
        return self.logits(self.hidden(batch, before_layer), batch)

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, before_layer=None) -> torch.Tensor:
        """The decoder over the batch: the last layer's output [n, hidden] on the rows this rank carries
        (before the final norm). The part of a decode step a CUDA graph replays."""
        decoder, executor = self.model.model, self.executor
        decoder.rotary_emb.forget()  # the step's angles are computed in the step (what a graph records)
        with forward_context(batch):
            rows = executor.local_rows(batch)
            h = decoder.embed_tokens(batch.input_ids if rows is None else batch.input_ids[rows])  # [n, hidden]
            for i, layer in enumerate(decoder.layers):
                if before_layer is not None:
                    before_layer(i)
                h = h + executor.forward(layer.self_attn, layer.input_layernorm(h), batch)
                h = h + executor.feed_forward(layer.mlp, layer.post_attention_layernorm(h), batch)
            return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden [n, hidden] (``hidden``) → logits [r, vocab] of the rows this rank samples."""
        return self.executor.sample_logits(h, batch, self.model.compute_logits)
