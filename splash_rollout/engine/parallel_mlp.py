"""The feed-forward blocks on T ranks, whatever the attention layout: two placements of their weights.

``sharded`` (the default; the only one that fits a large MoE): dense MLPs run tensor-parallel
(gate/up rows and down columns split over ranks); routed experts are spread over ranks (rank r holds
experts [r*E/T, (r+1)*E/T)) and the shared expert runs tensor-parallel. Every rank runs its shard on
all rows and computes its partial sum; one all-reduce completes the block where hidden states are
replicated between blocks (TP, DOP, CP), and where each rank carries only its own rows
(DP-attention) the block gathers its input rows and reduce-scatters the partials instead.
``shard_feed_forward`` replaces the model's full blocks by these so each rank holds only its share
of the weights.

``replicated``: every rank keeps the whole block (T times the feed-forward bytes of the group). A
DP-attention rank runs it on its own rows with no collective at all; where rows are replicated,
rank r runs it on the r-th contiguous slice of them and one all-gather completes the block. Each row
is computed whole on one rank, so its result is the single-rank result. This wins where the
per-layer collectives cost more than the weight bytes (small models on a few CPU ranks: the waits
of a DP rank on the rank its router sent more rows to); the blocks stay the model's own modules, so
weight updates and routing names are the unsharded ones.

The two ``on_*_rows`` functions are the one owner of that rule; the executors call them with the rows
they carry.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splash_rollout.layout.arith import div_even, even_split
from splash_rollout.layout.footprint import FEED_FORWARD_PLACEMENTS
from splash_rollout.models.moe import DenseMLP, MoE, run_experts
from splash_rollout.models.numerics import linear


class DenseShard(nn.Module):
    """Rows [a, b) of the intermediate dimension of a SiLU MLP. forward gives a partial sum."""

    def __init__(self, mlp: DenseMLP, rank: int, world_size: int) -> None:
        super().__init__()
        width = div_even(mlp.gate_proj.weight.shape[0], world_size)
        a, b = rank * width, (rank + 1) * width
        self.rows = slice(a, b)
        """The intermediate rows this rank holds."""
        self.gate = nn.Parameter(mlp.gate_proj.weight[a:b].clone(), requires_grad=False)  # [I/T, hidden]
        self.up = nn.Parameter(mlp.up_proj.weight[a:b].clone(), requires_grad=False)  # [I/T, hidden]
        self.down = nn.Parameter(mlp.down_proj.weight[:, a:b].clone(), requires_grad=False)  # [hidden, I/T]

    def full_parts(self, prefix: str) -> list[tuple[str, torch.Tensor, tuple]]:
        """(full tensor name, this rank's tensor, the part of the full tensor it holds) for the MLP
        whose names start with ``prefix`` (e.g. ``model.layers.0.mlp``)."""
        return [(f"{prefix}.gate_proj.weight", self.gate, (self.rows,)),
                (f"{prefix}.up_proj.weight", self.up, (self.rows,)),
                (f"{prefix}.down_proj.weight", self.down, (slice(None), self.rows))]

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

    def full_parts(self, prefix: str) -> list[tuple[str, torch.Tensor, tuple]]:
        """As ``DenseShard.full_parts``: the replicated router whole, this rank's experts whole and its
        slice of the shared experts."""
        parts = [(f"{prefix}.gate.{name}", t, ()) for name, t in self.gate.state_dict(keep_vars=True).items()]
        for i, expert in enumerate(self.experts):
            parts += [(f"{prefix}.experts.{self.first_expert + i}.{name}", t, ())
                      for name, t in expert.state_dict(keep_vars=True).items()]
        if self.shared is not None:
            parts += self.shared.full_parts(f"{prefix}.shared_experts")
        return parts

    expert_stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """This rank's experts' weights as stacks their parameters view (``stack_experts``), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> partial [N, hidden]
        idx, weight = self.gate(x)  # [N, k], [N, k]
        out = run_experts(x, idx, weight, self.experts, self.first_expert, self.expert_stacks)
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


def placement_problem(feed_forward: str, return_routing: bool, world_size: int) -> str | None:
    """Why a placement cannot serve these settings (None: it can)."""
    if feed_forward not in FEED_FORWARD_PLACEMENTS:
        return f"feed_forward: expected one of {FEED_FORWARD_PLACEMENTS}, got {feed_forward!r}"
    if feed_forward == "replicated" and return_routing and world_size > 1:
        return ("return_routing needs feed_forward='sharded' on more than one rank: the routing is recorded "
                "on rank 0, and with replicated blocks each rank's router sees only the rows it computes")
    return None


def on_replicated_rows(mlp: nn.Module, x: torch.Tensor, comm) -> torch.Tensor:
    """The block on rows every rank carries (TP, DOP, CP): x [N, hidden] -> [N, hidden], the same on
    every rank."""
    if isinstance(mlp, ParallelFeedForward) or comm.world_size == 1:
        return mlp(x)  # sharded: partial sums and one all-reduce; one rank: the whole block here
    counts = even_split(x.shape[0], comm.world_size)
    a = sum(counts[:comm.rank])
    mine = mlp(x[a:a + counts[comm.rank]])  # [N_r, hidden]: this rank's slice of the rows, computed whole
    return comm.all_gather_uneven(mine, counts, tag="step/mlp")


def on_owned_rows(mlp: nn.Module, x: torch.Tensor, comm, order: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The block on the rows this rank owns (DP-attention): x [n, hidden] -> [n, hidden]. order [N]
    int64: the batch's rows grouped by owner rank; counts [T]: rows each rank owns."""
    if not isinstance(mlp, ParallelFeedForward):  # replicated (or one rank): the whole block is here
        return mlp(x)
    every = comm.all_gather_uneven(x, counts, tag="step/mlp")  # [N, hidden], grouped by owner
    batch_order = torch.empty_like(every)
    batch_order[order] = every  # the shard's router and experts see rows in batch order
    partial = mlp.shard(batch_order)  # [N, hidden]; float64 under reproducible numerics
    return comm.reduce_scatter_uneven(partial[order], counts, tag="step/mlp").to(x.dtype)


def shard_feed_forward(model: nn.Module, rank: int, world_size: int, comm) -> None:
    """Replace every layer's MLP / MoE by this rank's shard (frees the rest of the weights)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        shard = ExpertShard(mlp, rank, world_size) if isinstance(mlp, MoE) else DenseShard(mlp, rank, world_size)
        layer.mlp = ParallelFeedForward(shard, comm)
