"""The feed-forward blocks on T ranks, whatever the attention layout.

Dense MLPs run tensor-parallel (gate/up rows and down columns split over ranks); routed experts are
spread over ranks (rank r holds experts [r*E/T, (r+1)*E/T)) and the shared expert runs
tensor-parallel. Every rank runs its shard on all rows and computes its partial sum; one all-reduce
completes the block where hidden states are replicated between blocks (TP, DOP, CP), and under
DP-attention the executor gathers the block's input rows and reduce-scatters the partials instead
(``executors/dp.py``). ``shard_feed_forward`` replaces the
model's full blocks by these so each rank holds only its share of the weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splash_rollout.layout.arith import div_even
from splash_rollout.models.moe import DenseMLP, MoE, run_experts
from splash_rollout.models.numerics import linear


class DenseShard(nn.Module):
    """Rows [a, b) of the intermediate dimension of a SiLU MLP. forward gives a partial sum."""

    def __init__(self, mlp: DenseMLP, rank: int, world_size: int) -> None:
        super().__init__()
        width = div_even(mlp.gate_proj.weight.shape[0], world_size)
        a, b = rank * width, (rank + 1) * width
        self.gate = nn.Parameter(mlp.gate_proj.weight[a:b].clone(), requires_grad=False)  # [I/T, hidden]
        self.up = nn.Parameter(mlp.up_proj.weight[a:b].clone(), requires_grad=False)  # [I/T, hidden]
        self.down = nn.Parameter(mlp.down_proj.weight[:, a:b].clone(), requires_grad=False)  # [hidden, I/T]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> partial [N, hidden] (float64 when reproducible)
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down, keep=True)


class ExpertShard(nn.Module):
    """This rank's routed experts plus its tensor-parallel slice of the shared experts."""

    def __init__(self, moe: MoE, rank: int, world_size: int) -> None:
        super().__init__()
        per_rank = div_even(len(moe.experts), world_size)
        self.first_expert = rank * per_rank
        self.gate = moe.gate  # replicated router (float32 weight and bias)
        self.experts = nn.ModuleList(moe.experts[self.first_expert + i] for i in range(per_rank))
        self.shared = DenseShard(moe.shared_experts, rank, world_size) if moe.shared_experts is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> partial [N, hidden]
        idx, weight = self.gate(x)  # [N, k], [N, k]
        out = run_experts(x, idx, weight, self.experts, self.first_expert)
        if self.shared is not None:
            out = out + self.shared(x)
        return out  # partial: x's dtype, or float64 under reproducible numerics


class ParallelFeedForward(nn.Module):
    """A block's shard plus the all-reduce that completes it."""

    def __init__(self, shard: nn.Module, comm) -> None:
        super().__init__()
        self.shard = shard
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.shard(x), tag="step/mlp").to(x.dtype)  # partials may be float64


def shard_feed_forward(model: nn.Module, rank: int, world_size: int, comm) -> None:
    """Replace every layer's MLP / MoE by this rank's shard (frees the rest of the weights)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        shard = ExpertShard(mlp, rank, world_size) if isinstance(mlp, MoE) else DenseShard(mlp, rank, world_size)
        layer.mlp = ParallelFeedForward(shard, comm)
