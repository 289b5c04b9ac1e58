"""CP: every history is spread over the ranks by page (page p on rank p mod T); projections are
replicated. Each rank attends every row over the positions it stores and returns (partial output,
log-sum-exp); the partials are gathered and merged exactly (DESIGN.md §3).

DSA needs one top-k over the whole history: each rank scores its own positions, the scores are
all-gathered, and every rank selects from the full matrix exactly as a single rank would, then
keeps the columns it stores. Row splitting of long prefill chunks for the projections (an
optimisation) is not done yet: every rank projects every row.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import AttentionExecutor
from splash_rollout.engine.executors.single import DSA_SCRATCH_KEY
from splash_rollout.engine.forward_batch import ForwardBatch, SeqInfo
from splash_rollout.models.attention_math import indexer_scores, indexer_select, merge_partial_attention


def positions_on_rank(seq: SeqInfo, rank: int, world_size: int, page_size: int) -> torch.Tensor:
    """[S_rank] int64: the history positions of ``seq`` that ``rank`` stores under CP."""
    pos = torch.arange(seq.seq_len, dtype=torch.int64)
    return pos[(pos // page_size) % world_size == rank]


class CPExecutor(AttentionExecutor):
    def __init__(self, rank_state) -> None:
        self.s = rank_state

    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, layer = self.s, attn.layer_idx
        shard = s.shards[layer]  # all heads
        q_nope, q_pe, q_a = shard.project_q(attn, x, batch.positions)  # [N, H, nope], [N, H, rope]
        c_kv, k_pe = attn.project_kv(x, batch.positions)
        s.pool.write_kv(layer, batch.out_slots, c_kv, k_pe)  # only the positions stored here
        allowed = self._dsa_allowed(attn, x, q_a, batch)
        out, lse = s.backend.forward(layer, shard.absorb(attn, q_nope), q_pe, s.pool, batch, allowed,
                                     attn.softmax_scale, partial=True)  # over local keys: [N, H, r], [N, H]
        n, t = out.shape[0], s.view.world_size
        outs = s.comm.all_gather_uneven(out.reshape(n, -1), [n] * t, tag="step/attn").view(t, *out.shape)
        lses = s.comm.all_gather_uneven(lse, [n] * t, tag="step/attn").view(t, *lse.shape)
        merged = merge_partial_attention(list(outs), list(lses), x.dtype)  # [N, H, r], the same on every rank
        return shard.output(attn, merged)

    def _dsa_allowed(self, attn, x, q_a, batch: ForwardBatch) -> list[torch.Tensor] | None:
        """Per request Bool [num_new, S_local]: this rank's columns of the global top-k selection."""
        indexer = getattr(attn, "indexer", None)
        if indexer is None:
            if getattr(attn, "uses_shared_topk", False):
                return batch.scratch[DSA_SCRATCH_KEY]
            return None
        s, layer = self.s, attn.layer_idx
        t, rank, ps = s.view.world_size, s.view.rank, batch.page_size
        index_q, index_w = indexer.index_q(x, q_a, batch.positions)  # [N, Hi, D], [N, Hi]
        s.pool.write_index_k(layer, batch.out_slots, indexer.index_k(x, batch.positions))
        local = []
        for seq in batch.seqs:
            keys = s.pool.read_index_k(layer, seq.slots).to(index_q.dtype)  # [S_local, D]
            rows = slice(seq.row_start, seq.row_end)
            local.append(indexer_scores(index_q[rows], index_w[rows], keys).flatten())  # [n * S_local]
        where = [[positions_on_rank(seq, q, t, ps) for seq in batch.seqs] for q in range(t)]
        sizes = [sum(seq.num_new * p.numel() for seq, p in zip(batch.seqs, where[q])) for q in range(t)]
        mine = torch.cat(local) if local else torch.empty(0)
        everyone = s.comm.all_gather_uneven(mine, sizes, tag="step/attn")  # rank-major flat scores
        allowed, offset = [], 0
        full = [torch.empty(seq.num_new, seq.seq_len) for seq in batch.seqs]
        for q in range(t):
            for seq, pos, scores in zip(batch.seqs, where[q], full):
                k = seq.num_new * pos.numel()
                scores[:, pos] = everyone[offset: offset + k].view(seq.num_new, pos.numel())
                offset += k
        for i, (seq, scores) in enumerate(zip(batch.seqs, full)):
            causal = torch.arange(seq.seq_len)[None, :] <= torch.arange(seq.start_pos, seq.seq_len)[:, None]
            chosen = indexer_select(scores, causal, indexer.topk, getattr(indexer, "tie_break", "position"))
            allowed.append(chosen[:, where[rank][i]].to(x.device))
        batch.scratch[DSA_SCRATCH_KEY] = allowed
        return allowed
