"""Single-rank attention executor: all heads, every history local (the oracle for every layout).

Per layer and step: project q and the latent kv of the new rows, write ``c_kv | k_pe`` (and the
indexer key on DSA ``full`` layers) into the pool, absorb W_UK into the query, attend over each
request's paged history (causal, or the DSA top-k selection), expand with W_UV, then o_proj.
``shared`` DSA layers reuse the selection the previous ``full`` layer left on the batch.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.attention import AttentionBackend, causal_allowed
from splash_rollout.engine.executors.base import AttentionExecutor
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool
from splash_rollout.models.attention_math import indexer_scores, indexer_select

DSA_SCRATCH_KEY = "dsa_allowed"


class SingleRankExecutor(AttentionExecutor):
    def __init__(self, pool: KVPool, backend: AttentionBackend) -> None:
        self.pool = pool
        self.backend = backend

    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        layer = attn.layer_idx
        positions = batch.positions
        q_nope, q_pe, q_a = attn.project_q(x, positions)  # [N, H, nope], [N, H, rope], [N, q_lora]|None
        c_kv, k_pe = attn.project_kv(x, positions)  # [N, r], [N, rope]
        self.pool.write_kv(layer, batch.out_slots, c_kv, k_pe)
        allowed = self._dsa_allowed(attn, x, q_a, batch)
        q_nope_abs = torch.einsum("nhd,hdr->nhr", q_nope, attn.w_uk())  # [N, H, r]
        out_latent, _ = self.backend.forward(layer, q_nope_abs, q_pe, self.pool, batch, allowed,
                                             attn.softmax_scale)  # [N, H, r]
        o = torch.einsum("nhr,hrv->nhv", out_latent, attn.w_uv())  # [N, H, v]
        return attn.o_proj(o.reshape(o.shape[0], -1))

    def _dsa_allowed(self, attn, x, q_a, batch: ForwardBatch) -> list[torch.Tensor] | None:
        """Per request Bool [num_new, seq_len] of the positions each row attends, or None (causal)."""
        indexer = getattr(attn, "indexer", None)
        if indexer is None:
            if getattr(attn, "uses_shared_topk", False):
                if DSA_SCRATCH_KEY not in batch.scratch:
                    raise RuntimeError(f"layer {attn.layer_idx}: shared DSA layer before any full layer")
                return batch.scratch[DSA_SCRATCH_KEY]
            return None
        layer = attn.layer_idx
        index_q, index_w = indexer.index_q(x, q_a, batch.positions)  # [N, Hi, D], [N, Hi]
        self.pool.write_index_k(layer, batch.out_slots, indexer.index_k(x, batch.positions))
        allowed = []
        for seq in batch.seqs:
            keys = self.pool.read_index_k(layer, seq.slots).to(index_q.dtype)  # [S, D]
            rows = slice(seq.row_start, seq.row_end)
            scores = indexer_scores(index_q[rows], index_w[rows], keys)  # [n, S]
            causal = causal_allowed(seq.start_pos, seq.num_new, seq.seq_len, x.device)
            allowed.append(indexer_select(scores, causal, indexer.topk, getattr(indexer, "tie_break", "position")))
        batch.scratch[DSA_SCRATCH_KEY] = allowed
        return allowed
