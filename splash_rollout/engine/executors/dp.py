"""DP-attention: each rank runs all heads for the rows of the requests it owns, against its own
histories; the output rows are all-gathered back into batch order."""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import AttentionExecutor
from splash_rollout.engine.executors.single import attend_local
from splash_rollout.engine.forward_batch import ForwardBatch


def rows_by_owner(batch: ForwardBatch, world_size: int) -> tuple[torch.Tensor, list[int]]:
    """(order [N] int64: the batch's rows grouped by owner rank, batch order within an owner;
    counts [T]: rows each rank owns)."""
    owners = batch.row_owners
    order = torch.argsort(owners, stable=True)
    counts = torch.bincount(owners, minlength=world_size).tolist() if owners.numel() else [0] * world_size
    return order, counts


class DPExecutor(AttentionExecutor):
    def __init__(self, rank_state) -> None:
        self.s = rank_state

    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = self.s
        sub, rows = batch.owned_by(s.view.rank)
        if rows.numel():
            mine = attend_local(attn, s.shards[attn.layer_idx], s.pool, s.backend, x[rows], sub)  # [n, hidden]
        else:
            mine = x.new_zeros((0, x.shape[1]))
        order, counts = rows_by_owner(batch, s.view.world_size)
        gathered = s.comm.all_gather_uneven(mine, counts, tag="step/attn")  # [N, hidden] in owner order
        out = torch.empty_like(gathered)
        out[order] = gathered
        return out
