"""TP: each rank runs its H/T heads over every row and every history (each rank stores them all),
o_proj row-sharded, then one all-reduce completes the layer."""
from __future__ import annotations

import torch

from splash_rollout.engine.executors.base import ReplicatedRowsExecutor
from splash_rollout.engine.executors.single import attend_local
from splash_rollout.engine.forward_batch import ForwardBatch


class TPExecutor(ReplicatedRowsExecutor):
    def forward(self, attn, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = self.s
        partial = attend_local(attn, s.shards[attn.layer_idx], s.pool, s.backend, x, batch)  # [N, hidden]
        return s.comm.all_reduce(partial, tag="step/attn").to(x.dtype)  # partials may be float64
