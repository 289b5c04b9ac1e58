"""DP-attention: each rank runs all heads for the rows of the requests it owns, against its own
histories, and carries only those rows between blocks. The feed-forward block runs on those rows too
(``parallel_mlp.on_owned_rows``): with sharded weights it all-gathers its input rows, runs this
rank's shard on every row and reduce-scatters the partial sums back to the owners (half the bytes of
an all-reduce, and the norms and residual adds run once per row, not once per rank); with
replicated weights it runs the whole block on the rank's own rows, no collective. Each rank
computes the logits of its own sampled rows and samples them."""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import RankExecutor
from splash_rollout.engine.executors.single import attend_local
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.parallel_mlp import on_owned_rows


def rows_by_owner(batch: ForwardBatch, world_size: int) -> tuple[torch.Tensor, list[int]]:
    """(order [N] int64: the batch's rows grouped by owner rank, batch order within an owner;
    counts [T]: rows each rank owns), made on the host. Cached on the batch: every layer of a step asks."""
    key = ("rows_by_owner", world_size)
    if key not in batch.scratch:
        by_rank = [batch.rows_of([b for b, o in enumerate(batch.owners) if o == q]) for q in range(world_size)]
        order = [row for rows in by_rank for row in rows]
        batch.scratch[key] = (torch.tensor(order, dtype=torch.int64).to(batch.device), [len(r) for r in by_rank])
    return batch.scratch[key]


class DPExecutor(RankExecutor):
    fixed_shapes = False  # its collectives are sized by the rows each rank owns

    inputs_stay_local = True  # a rank samples and feeds back only its own requests' tokens

    def local_rows(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.owned_by(self.s.view.rank)[1]

    def local_rows_host(self, batch: ForwardBatch) -> list[int]:
        return batch.rows_of([b for b, o in enumerate(batch.owners) if o == self.s.view.rank])

    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        s = self.s
        sub, rows = batch.owned_by(s.view.rank)
        if not rows.numel():
            return x.new_zeros((0, x.shape[1]))
        return attend_local(attn, s.shards[attn.layer_idx], s.pool, s.backend, x, sub)

    def feed_forward(self, mlp, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        order, counts = rows_by_owner(batch, self.s.view.world_size)
        return on_owned_rows(mlp, x, self.s.comm, order, counts)

    def sampling_ranks(self, batch: ForwardBatch) -> list[int]:
        """Each sampled row's owner: a rank samples the rows it carries (the LM head and the sampler
        split like the attention)."""
        return [batch.owners[b] for b in batch.sample_seqs_host]  # [R]

