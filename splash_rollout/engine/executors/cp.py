"""CP: every history is spread over the ranks by page (page p on rank p mod T); projections are
replicated. Each rank attends every row over the positions it stores and returns (partial output,
log-sum-exp); the partials are gathered and merged exactly.

DSA needs one top-k over the whole history: each rank scores its own positions, the scores are
all-gathered, and every rank selects from the full matrix exactly as a single rank would; the
backend then reads only the selected positions stored here. A rank's positions are every T-th
page, so its columns of the [N, S] score matrix are one strided view, sent without any index
lists. Row splitting of long prefill chunks for the projections (an optimisation) is not done
yet: every rank projects every row.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import ReplicatedRowsExecutor
from splash_rollout.engine.attention.base import DSA_KEYS_SCRATCH_KEY
from splash_rollout.engine.executors.single import DSA_SCRATCH_KEY, index_scores, shared_selection
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.models.attention_math import indexer_select, merge_partial_attention


class CPExecutor(ReplicatedRowsExecutor):
    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, layer = self.s, attn.layer_idx
        shard = s.shards[layer]  # all heads
        q_nope, q_pe, q_a = shard.project_q(attn, x, batch.positions)  # [N, H, nope], [N, H, rope]
        c_kv, k_pe = attn.project_kv(x, batch.positions)
        s.pool.write_kv(layer, batch.out_slots, c_kv, k_pe)  # only the positions stored here
        selected = self._dsa_select(attn, x, q_a, batch)
        out, lse = s.backend.forward(layer, shard.absorb(attn, q_nope), q_pe, s.pool, batch, selected,
                                     attn.softmax_scale, partial=True)  # over local keys: [N, H, r], [N, H]
        n, t = out.shape[0], s.view.world_size
        outs = s.comm.all_gather_uneven(out.reshape(n, -1), [n] * t, tag="step/attn").view(t, *out.shape)
        lses = s.comm.all_gather_uneven(lse, [n] * t, tag="step/attn").view(t, *lse.shape)
        merged = merge_partial_attention(list(outs), list(lses), x.dtype)  # [N, H, r], the same on every rank
        return shard.output(attn, merged)

    def _dsa_select(self, attn, x, q_a, batch: ForwardBatch) -> torch.Tensor | None:
        """Bool [N, S]: the global top-k selection, the same on every rank."""
        indexer = getattr(attn, "indexer", None)
        if indexer is None:
            return shared_selection(attn, batch)
        s, layer = self.s, attn.layer_idx
        t, rank, ps = s.view.world_size, s.view.rank, batch.page_size
        index_q, index_w = indexer.index_q(x, q_a, batch.positions)  # [N, Hi, D], [N, Hi]
        s.pool.write_index_k(layer, batch.out_slots, indexer.index_k(x, batch.positions))
        local = index_scores(s.pool, layer, index_q, index_w, batch)  # [N, S]: valid on this rank's pages
        n, width = local.shape
        blocks = -(-width // (t * ps))  # page rounds of T pages
        padded = local.new_zeros((n, blocks * t * ps))
        padded[:, :width] = local
        mine = padded.view(n, blocks, t, ps)[:, :, rank, :].reshape(n, blocks * ps)  # this rank's pages
        everyone = s.comm.all_gather_uneven(mine, [n] * t, tag="step/attn")  # [T*N, blocks*ps]
        full = everyone.view(t, n, blocks, ps).permute(1, 2, 0, 3).reshape(n, blocks * t * ps)[:, :width]
        selected = indexer_select(full, batch.causal(), indexer.topk, getattr(indexer, "tie_break", "position"))
        batch.scratch[DSA_SCRATCH_KEY] = selected
        batch.scratch[DSA_KEYS_SCRATCH_KEY] = min(indexer.topk, batch.max_seq_len)
        return selected
