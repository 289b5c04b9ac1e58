"""Single-rank attention: all heads, every history local (the oracle for every layout).

Per layer and step: project q and the latent kv of the new rows, write ``c_kv | k_pe`` (and the
indexer key on DSA ``full`` layers) into the pool, absorb W_UK into the query, attend over each
request's paged history (causal, or the DSA top-k selection), expand with W_UV, then o_proj.
``shared`` DSA layers reuse the selection the previous ``full`` layer left on the batch.
DP-attention runs exactly this on the requests a rank owns; ``dsa_select``, ``index_scores`` and
``attend_local`` are the pieces the other layouts share.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.attention import AttentionBackend
from splash_rollout.engine.attention.base import DSA_KEYS_SCRATCH_KEY
from splash_rollout.engine.attention.expanded_prefill import expanded_attention, plan_forms
from splash_rollout.engine.executors.base import AttentionExecutor
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool
from splash_rollout.engine.projections import ProjectionShard
from splash_rollout.models.attention_math import indexer_scores, indexer_select

DSA_SCRATCH_KEY = "dsa_selected"
INDEX_CHUNK_ELEMENTS = 1 << 24
"""Most elements of one chunk of indexer work (gathered keys and per-head scores)."""


def shared_selection(attn, batch: ForwardBatch) -> torch.Tensor | None:
    """A ``shared`` DSA layer's selection (the previous full layer's), or None for a layer without DSA."""
    if getattr(attn, "uses_shared_topk", False):
        if DSA_SCRATCH_KEY not in batch.scratch:
            raise RuntimeError(f"layer {attn.layer_idx}: shared DSA layer before any full layer")
        return batch.scratch[DSA_SCRATCH_KEY]
    return None


def index_scores(pool: KVPool, layer: int, index_q: torch.Tensor, index_w: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
    """Indexer scores of every row against the positions this rank stores: [N, S] float32
    (S = ``batch.max_seq_len``). Columns of positions not stored here hold arbitrary values (even
    NaN from an unused page): every caller masks them (causal / stored) before use. index_q: [N, Hi, D];
    index_w: [N, Hi]. Requests are padded and chunked like dense attention (no loop over requests)."""
    cache = pool.index_k[layer]  # [num_pages, page_size, D]
    scores = torch.zeros(batch.num_tokens, batch.max_seq_len, dtype=torch.float32, device=index_q.device)
    per_key = index_q.shape[1] + cache.shape[-1]
    for chunk in batch.padded_chunks(per_key, INDEX_CHUNK_ELEMENTS):
        keys = chunk.gather(cache, zero_hidden=False)  # [C, S, D]; hidden columns are masked below
        part = indexer_scores(index_q[chunk.q_rows], index_w[chunk.q_rows], keys.to(index_q.dtype))  # [C, Q, S]
        scores[chunk.rows, : part.shape[-1]] = chunk.real(part)
    return scores


def dsa_select(attn, pool: KVPool, x: torch.Tensor, q_a: torch.Tensor | None,
               batch: ForwardBatch) -> torch.Tensor | None:
    """Bool [N, S] of the positions each row attends (its DSA top-k), or None (plain causal).

    The request's whole history must be on this rank (TP, DP-attention, DOP owners). Writes this
    step's indexer keys. x, q_a: the batch's rows [N, hidden], [N, q_lora]."""
    indexer = getattr(attn, "indexer", None)
    if indexer is None:
        return shared_selection(attn, batch)
    layer = attn.layer_idx
    index_q, index_w = indexer.index_q(x, q_a, batch.positions)  # [N, Hi, D], [N, Hi]
    pool.write_index_k(layer, batch.out_slots, indexer.index_k(x, batch.positions))
    scores = index_scores(pool, layer, index_q, index_w, batch)
    selected = indexer_select(scores, batch.causal(), indexer.topk, getattr(indexer, "tie_break", "position"))
    batch.scratch[DSA_SCRATCH_KEY] = selected
    batch.scratch[DSA_KEYS_SCRATCH_KEY] = min(indexer.topk, batch.max_seq_len)
    return selected


def attend_local(attn, shard: ProjectionShard, pool: KVPool, backend: AttentionBackend, x: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
    """All of ``shard``'s heads over histories stored here: x [N, hidden] -> [N, hidden] (partial over
    heads when the shard is a slice). Long prefill chunks run in expanded form where the backend
    takes it (``expanded_prefill``), everything else absorbed."""
    layer = attn.layer_idx
    q_nope, q_pe, q_a = shard.project_q(attn, x, batch.positions)  # [N, h, nope], [N, h, rope]
    c_kv, k_pe = attn.project_kv(x, batch.positions)  # [N, r], [N, rope]
    pool.write_kv(layer, batch.out_slots, c_kv, k_pe)
    selected = dsa_select(attn, pool, x, q_a, batch)
    plan = plan_forms(attn, batch, backend.expands_prefill)
    if not plan.expanded:
        out_latent, _ = backend.forward(layer, shard.absorb(attn, q_nope), q_pe, pool, batch, selected,
                                        attn.softmax_scale)  # [N, h, r]
        return shard.output(attn, out_latent)
    values = q_nope.new_empty((batch.num_tokens, shard.num_heads, attn.v_dim))  # [N, h, v]
    if plan.absorbed:
        sub, rows = batch.subset(plan.absorbed)
        sub_selected = None if selected is None else selected[rows, : sub.max_seq_len]
        out_latent, _ = backend.forward(layer, shard.absorb(attn, q_nope[rows]), q_pe[rows], pool, sub,
                                        sub_selected, attn.softmax_scale)
        values[rows] = shard.values(attn, out_latent)
    rows, expanded = expanded_attention(attn, shard.kv_b, pool, q_nope, q_pe, batch, plan.expanded, selected)
    values[rows] = expanded
    return shard.o_project(attn, values)


class SingleRankExecutor(AttentionExecutor):
    def __init__(self, pool: KVPool, backend: AttentionBackend, shards: list[ProjectionShard]) -> None:
        self.pool = pool
        self.backend = backend
        self.shards = shards
        """Per layer: all heads' Q-B / KV-B / O."""

    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return attend_local(attn, self.shards[attn.layer_idx], self.pool, self.backend, x, batch)
