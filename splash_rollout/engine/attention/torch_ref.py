"""Pure-torch reference attention backend: gather each request's history, attend exactly.

One ``absorbed_attention`` call per request (the model's own math), so correctness does not depend
on padding or packing tricks. Slow but obviously right; every other backend is checked against it.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.attention.base import AttentionBackend
from splash_rollout.models.attention_math import absorbed_attention
from splash_rollout.models.numerics import acc_dtype


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, layer, q_nope_abs, q_pe, pool, batch, selected: torch.Tensor | None, scale,
                partial: bool = False):
        acc = acc_dtype(q_nope_abs.dtype)
        out = q_nope_abs.new_empty(q_nope_abs.shape, dtype=acc if partial else q_nope_abs.dtype)  # [N, H, r]
        lse = torch.empty(q_nope_abs.shape[:2], dtype=acc if partial else torch.float32, device=q_nope_abs.device)
        for seq in batch.seqs:
            c_kv, k_pe = pool.read_kv(layer, seq.slots)  # [S_local, r], [S_local, rope]
            rows = slice(seq.row_start, seq.row_end)
            if selected is None:
                mask = seq.causal_mask(q_pe.device)
            else:
                mask = selected[rows].index_select(1, seq.key_positions.to(selected.device))
            out[rows], lse[rows] = absorbed_attention(q_nope_abs[rows], q_pe[rows], c_kv.to(q_pe.dtype),
                                                      k_pe.to(q_pe.dtype), mask, scale, partial)
        return out, lse
