"""Feed-forward blocks: the dense SiLU MLP and the DeepSeek/GLM mixture of experts.

Routing (DeepSeek-V3 "noaux_tc"): sigmoid scores; the choice uses scores + e_score_correction_bias,
restricted to the best ``topk_group`` of ``n_group`` groups (a group's score is the sum of its two
best experts); the weights are the plain sigmoid scores of the chosen experts, normalised over the
top-k when ``norm_topk_prob``, times ``routed_scaling_factor``. Shared experts always run.
Router weight and bias stay float32 in every model dtype, as in transformers.
Experts are separate modules (``experts.{e}.gate_proj`` ...), the names real checkpoints ship, so
expert parallelism can hand out whole modules.

Routing capture and replay (``routing_context``): inside the context every router call of a forward
records the experts it chose (capture) and/or takes its choice from a given table (replay), MoE
layer by MoE layer in call order -- one forward calls each MoE layer's router once. Replay keeps the
gating weights a function of the current router (sigmoid scores of the replayed experts), so the
router still learns; only the discrete choice is pinned, e.g. to the rollout engine's, so a routing
flip between rollout and training cannot change the trained distribution.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from splash_rollout.models.config import ModelConfig
from splash_rollout.models.numerics import Linear, linear, partial_dtype
from splash_rollout.native.routed_experts import routed_experts


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        """``keep``: return the down projection unrounded (float64 in reproducible numerics), for a
        caller that adds it to other partial sums first."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), keep=keep)


@dataclass
class RoutingState:
    """One forward's routing capture / replay (``routing_context``)."""

    capture: bool = False
    replay: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per MoE layer in call order: (expert ids [N, k] int64, replayed [N] bool). Rows not replayed
    route freely (e.g. a sequence's last token, which the rollout never fed through the model)."""
    captured: list[torch.Tensor] = field(default_factory=list)
    """Per MoE layer called: the expert ids [N, k] int64 it used."""
    calls: int = 0


_ROUTING: RoutingState | None = None


@contextlib.contextmanager
def routing_context(capture: bool = False,
                    replay: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Iterator[RoutingState]:
    """Capture and/or replay the routers' expert choice in the forward(s) run inside; refuses nesting.
    With ``replay`` the forward must call exactly ``len(replay)`` routers."""
    global _ROUTING
    if _ROUTING is not None:
        raise RuntimeError("routing_context: already inside one (one forward at a time)")
    state = RoutingState(capture, replay)
    _ROUTING = state
    try:
        yield state
    finally:
        _ROUTING = None
    if replay is not None and state.calls != len(replay):
        raise ValueError(f"routing replay: got routing for {len(replay)} MoE layers, the forward ran {state.calls}")


@contextlib.contextmanager
def routing_apart() -> Iterator[None]:
    """Routers called inside route on their own, outside any capture or replay around them (the MTP
    module's: not a layer of the rollout's routing, models/mtp.py)."""
    global _ROUTING
    saved, _ROUTING = _ROUTING, None
    try:
        yield
    finally:
        _ROUTING = saved


class Router(nn.Module):
    """HF name ``mlp.gate``: weight [E, hidden] and e_score_correction_bias [E], both float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        if self.num_experts % self.n_group:
            raise ValueError(f"{self.num_experts = } must be divisible by {self.n_group = }")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (topk_idx [N, k] int64, topk_weight [N, k] float32)."""
        scores = linear(x.float(), self.weight.float(), keep=True).sigmoid().float()  # [N, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            best = group_score.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            keep = keep[:, :, None].expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        if _ROUTING is not None:
            idx = self._replay_or_capture(_ROUTING, idx)
        weight = scores.gather(1, idx)
        if self.norm_topk_prob:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return idx, weight * self.routed_scaling_factor

    def _replay_or_capture(self, state: RoutingState, idx: torch.Tensor) -> torch.Tensor:
        """idx [N, k] int64 (this router's choice) -> the ids this forward uses."""
        if state.replay is not None:
            if state.calls >= len(state.replay):
                raise ValueError(f"routing replay: got routing for {len(state.replay)} MoE layers, the forward "
                                 f"calls more routers")
            given, replayed = state.replay[state.calls]
            if given.shape != idx.shape or replayed.shape != idx.shape[:1]:
                raise ValueError(f"routing replay: MoE layer {state.calls} expects ids {tuple(idx.shape)} and a "
                                 f"mask ({idx.shape[0]},), got {tuple(given.shape)} and {tuple(replayed.shape)}")
            used = given[replayed]
            if used.numel() and not (0 <= int(used.min()) and int(used.max()) < self.num_experts):
                raise ValueError(f"routing replay: MoE layer {state.calls} has expert ids outside "
                                 f"[0, {self.num_experts})")
            idx = torch.where(replayed.to(idx.device)[:, None], given.to(idx.device, torch.int64), idx)
        state.calls += 1
        if state.capture:
            state.captured.append(idx.detach())
        return idx


def stack_experts(experts: nn.ModuleList, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the experts' weights out as three stacks on ``device`` -- gate and up [E, I, hidden], down
    [E, hidden, I] -- and make every expert's parameters views of them (its names, values and
    ``requires_grad`` unchanged): what a fused kernel reads with no copy. Meta experts (a rank being
    built) get uninitialised stacks a loader fills through the views; real ones are copied in once."""
    stacks = []
    for part in ("gate_proj", "up_proj", "down_proj"):
        weights = [getattr(e, part).weight for e in experts]
        if weights[0].is_meta:
            stack = torch.empty((len(weights),) + tuple(weights[0].shape), dtype=weights[0].dtype, device=device)
        else:
            stack = torch.stack([w.detach() for w in weights]).to(device)
        for i, (e, w) in enumerate(zip(experts, weights)):
            getattr(e, part).weight = nn.Parameter(stack[i], requires_grad=w.requires_grad)
        stacks.append(stack)
    return stacks[0], stacks[1], stacks[2]


def run_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: nn.ModuleList,
                first_expert: int = 0, stacked: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs. x [N, hidden]; idx, weight [N, k] (global expert
    ids); ``experts`` hold ids [first_expert, first_expert + len); others contribute nothing here
    (expert parallelism sums the ranks' parts); ``stacked``: their weights as ``stack_experts`` laid
    them out (None: not stacked). Returns [N, hidden] in x's dtype, or float64 in reproducible
    numerics (a partial sum: the caller adds the shared expert / other ranks, then rounds).
    Fast numerics: few CPU rows take one native call, CUDA rows over stacked weights two Triton
    launches with no host sync (``triton_moe``); otherwise a torch loop over the experts that got rows."""
    if partial_dtype(x.dtype) == x.dtype:
        fused = routed_experts(x, idx, weight, experts, first_expert)
        if fused is None and stacked is not None and x.is_cuda:
            from splash_rollout.models.triton_moe import fused_experts

            fused = fused_experts(x, idx, weight, *stacked, first_expert=first_expert)
        if fused is not None:
            return fused.to(x.dtype)
    out = torch.zeros(x.shape, dtype=partial_dtype(x.dtype), device=x.device)
    local = idx - first_expert
    mine = (local >= 0) & (local < len(experts))
    for e in torch.unique(local[mine]).tolist():  # one host sync, then only the experts that got tokens
        rows, slot = torch.where(local == e)
        y = experts[e](x[rows], keep=True) * weight[rows, slot, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(DenseMLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = (DenseMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts > 0 else None)

    expert_stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The experts' weights as stacks their parameters view (``stack_experts``; an engine's rank sets
    it), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        idx, weight = self.gate(x)
        out = run_experts(x, idx, weight, self.experts, stacked=self.expert_stacks)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, keep=True)
        return out.to(x.dtype)
