"""DOP: sharded projections, request-owned KV (paper §3).

Each rank projects q and absorbs W_UK for its H/T heads over all N rows; a variable-size
all-to-all sends each request's rows (this rank's head slice) to its owner, which assembles all H
heads, appends its requests' KV and attends; a reverse all-to-all returns head slices; W_UV and
o_proj run sharded and an all-reduce completes the layer. Ranks with zero rows still join.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import ReplicatedRowsExecutor
from splash_rollout.engine.executors.dp import rows_by_owner
from splash_rollout.engine.executors.single import dsa_select
from splash_rollout.engine.forward_batch import ForwardBatch


class DOPExecutor(ReplicatedRowsExecutor):
    fixed_shapes = False  # its collectives are sized by the rows each rank owns

    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, layer = self.s, attn.layer_idx
        t, rank = s.view.world_size, s.view.rank
        shard = s.shards[layer]
        h, r = shard.num_heads, attn.kv_lora_rank
        q_nope, q_pe, q_a = shard.project_q(attn, x, batch.positions)  # [N, h, nope], [N, h, rope]
        q_heads = torch.cat([shard.absorb(attn, q_nope), q_pe], dim=-1)  # [N, h, r + rope]
        order, counts = rows_by_owner(batch, t)
        n_mine = counts[rank]
        # to owners: rank p receives, from every rank, its own requests' rows for that rank's heads
        got = s.comm.all_to_all_uneven(q_heads[order], counts, [n_mine] * t, tag="step/attn")  # [T*n, h, r+rope]
        width = q_heads.shape[-1]
        q_all = got.view(t, n_mine, h, width).transpose(0, 1).reshape(n_mine, t * h, width)  # [n, H, r+rope]
        if n_mine:
            sub, rows = batch.owned_by(rank)
            c_kv, k_pe = attn.project_kv(x[rows], sub.positions)  # [n, r], [n, rope]
            s.pool.write_kv(layer, sub.out_slots, c_kv, k_pe)
            selected = dsa_select(attn, s.pool, x[rows], None if q_a is None else q_a[rows], sub)
            out_all, _ = s.backend.forward(layer, q_all[..., :r].contiguous(), q_all[..., r:].contiguous(),
                                           s.pool, sub, selected, attn.softmax_scale)  # [n, H, r]
        else:
            out_all = q_all.new_zeros((0, t * h, r))
        # back: every rank gets its head slice of every row, in owner order
        send = out_all.view(n_mine, t, h, r).transpose(0, 1).reshape(t * n_mine, h, r)
        back = s.comm.all_to_all_uneven(send, [n_mine] * t, counts, tag="step/attn")  # [N, h, r]
        out_latent = torch.empty_like(back)
        out_latent[order] = back
        return s.comm.all_reduce(shard.output(attn, out_latent), tag="step/attn").to(x.dtype)  # partials may be float64
