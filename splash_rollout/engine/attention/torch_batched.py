"""Batched paged attention in plain torch: one layer for every request of the step in a few tensor ops.

No Python loop over requests. Two shapes of work:

* **selected keys** (a DSA top-k selection): every row gathers its own selected positions through
  the block table -- ``[N, K]`` slots, ``K`` the widest selection -- and attends over them.
* **dense causal**: requests are padded to a common query and key length and attended as
  ``[C, Q, H, S]`` chunks (``ForwardBatch.padded_chunks``: decode requests and prefill chunks
  apart, sorted by length, each chunk's gathered keys and logits under ``chunk_elements``), so
  memory stays bounded at B = 1,024 and long histories.

Keys a row must not see -- past its position, stored on another rank, padding -- are zeroed
before use and masked to -inf, so unused (even NaN-filled) pages never reach the result.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.attention.base import AttentionBackend, selected_keys
from splash_rollout.models.attention_math import softmax_attention
from splash_rollout.models.numerics import acc_dtype

CHUNK_ELEMENTS = 1 << 24
"""Most elements of one chunk's gathered keys plus its logits (64 MiB in float32)."""


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        self.chunk_elements = chunk_elements

    def forward(self, layer, q_nope_abs, q_pe, pool, batch, selected: torch.Tensor | None, scale,
                partial: bool = False):
        n, h, r = q_nope_abs.shape
        acc = acc_dtype(q_nope_abs.dtype)
        cache = pool.kv[layer]  # [num_pages, page_size, r + rope]
        rows = cache.view(-1, cache.shape[-1])  # [slots, r + rope]
        out = q_nope_abs.new_zeros((n, h, r), dtype=acc)
        lse = q_nope_abs.new_full((n, h), float("-inf"), dtype=acc)
        if n:
            if selected is not None:
                self._selected(q_nope_abs, q_pe, rows, batch, selected, scale, out, lse)
            else:
                self._dense(q_nope_abs, q_pe, cache, batch, scale, out, lse)
        if partial:
            return out, lse
        return out.to(q_nope_abs.dtype), lse.float()

    # ---- DSA: per-row gathered keys ----------------------------------------------------------------
    def _selected(self, q, q_pe, rows, batch, selected, scale, out, lse) -> None:
        r = q.shape[-1]
        stored = batch.key_stored()  # [B, S]
        allowed = selected & stored.index_select(0, batch.row_seq)  # [N, S]: selected and stored here
        index, valid = selected_keys(batch, allowed)  # [N, K] positions, [N, 1, K]
        pages = batch.block_table[batch.row_seq[:, None], index // batch.page_size]  # [N, K]
        slots = (pages * batch.page_size + index % batch.page_size).clamp(min=0)
        keys = rows[slots]  # [N, K, r + rope]
        keys = torch.where(valid[:, 0, :, None], keys, torch.zeros_like(keys))  # hidden keys: exact zeros
        o, l = softmax_attention(q, q_pe, keys[..., :r], keys[..., r:], valid, scale, "nhr,nkr->nhk")
        out.copy_(o)
        lse.copy_(l)

    # ---- dense causal: requests padded to [C, Q, S] ---------------------------------------------
    def _dense(self, q, q_pe, cache, batch, scale, out, lse) -> None:
        r = q.shape[-1]
        per_key = q.shape[1] + cache.shape[-1]  # logits per head and the gathered key row
        for chunk in batch.padded_chunks(per_key, self.chunk_elements):
            keys = chunk.gather(cache)  # [C, S, r + rope], hidden positions zero
            visible = chunk.visible(batch.positions)[:, :, None, :]  # [C, Q, 1, S]
            o, l = softmax_attention(q[chunk.q_rows], q_pe[chunk.q_rows], keys[..., :r], keys[..., r:], visible,
                                     scale, "bqhr,bsr->bqhs")  # [C, Q, H, r], [C, Q, H]
            out[chunk.rows] = chunk.real(o)
            lse[chunk.rows] = chunk.real(l)
