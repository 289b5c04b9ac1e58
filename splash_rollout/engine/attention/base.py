"""AttentionBackend: absorbed MLA attention over paged latent KV, for one layer and one step.

A backend receives the absorbed queries of every row of the step, reads each request's history
from the pool through the batch's block table, and returns the latent attention output. Which
positions a row may see arrives as one ``selected`` mask over history positions (a DSA top-k
selection) or None (causal), so a backend does not know about indexers or layouts; positions
another rank stores are never read (their block-table entry is -1). ``torch_ref`` is the reference
every other backend is checked against (with NaN-filled unused pages).
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splash_rollout.engine.forward_batch import ForwardBatch
    from splash_rollout.engine.kv_pool import KVPool


DSA_KEYS_SCRATCH_KEY = "dsa_keys"
"""Batch scratch: the most keys any row of the step's DSA selection allows (the indexer's top-k, or
fewer keys), recorded by the executor that selected; backends gather selected keys at this fixed
width instead of reading the widest row back from the device."""


def selected_keys(batch: "ForwardBatch", allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """allowed: Bool [N, S] -> (index [N, K] int64 positions, valid [N, 1, K] bool), each row's keys in
    increasing order: at the step's DSA width when recorded (fixed shapes, no host sync), else at the
    widest row's (a selection from elsewhere)."""
    from splash_rollout.models.attention_math import allowed_index, first_allowed

    width = batch.scratch.get(DSA_KEYS_SCRATCH_KEY)
    return allowed_index(allowed) if width is None else first_allowed(allowed, width)


def causal_allowed(start_pos: int, num_new: int, seq_len: int, device=None) -> torch.Tensor:
    """Bool [num_new, seq_len]: row i (position start_pos + i) sees positions <= its own."""
    q_pos = torch.arange(start_pos, start_pos + num_new, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


class AttentionBackend(abc.ABC):
    name: str = "base"
    expands_prefill: bool = False
    """Whether the executors may run long prefill chunks in expanded form (``expanded_prefill``)
    beside this backend, under fast numerics. Off for the reference backends (they are the oracle
    the expanded form is checked against) and for the GPU backends until it is measured there."""

    @abc.abstractmethod
    def forward(self, layer: int, q_nope_abs: torch.Tensor, q_pe: torch.Tensor, pool: "KVPool",
                batch: "ForwardBatch", selected: torch.Tensor | None, scale: float,
                partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope_abs: [N, H, kv_lora_rank]; q_pe: [N, H, qk_rope_head_dim];
        selected: Bool [N, S] (S = ``batch.max_seq_len``) over history positions, or None (causal)
        → (out_latent [N, H, kv_lora_rank], lse [N, H] float32). Only positions this rank stores
        are attended; the lse lets a layout that splits a history over ranks (CP) merge partial
        results exactly; such a caller passes ``partial`` and gets both in the accumulation dtype
        (models/numerics.py) so the merge rounds once. The new tokens' KV must already be in the pool."""
