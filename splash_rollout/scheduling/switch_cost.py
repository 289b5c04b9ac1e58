"""Switch cost over θ: a SwitchPlan's per-layer bytes turned into seconds, blocking and overlapped.

A switch moves, per layer, the state the destination lacks (paper §4.1, Figure 3). Blocking runs all
layers' transfers before the step; Splash moves layer i's state while layer i−1 computes, so only the
first layer's transfer and whatever a later transfer exceeds its predecessor's compute stay exposed
(paper Eq. 7, Appendix F "Imperfect overlap"):

    exposed = x_0 + Σ_{i≥1} max(0, x_i − c_{i−1})

with x_i the transfer time of layer i (weights all-gather, then KV all-gather / all-to-all, on the
switch stream) and c_i the compute time of layer i in the destination layout for this step.
Seconds throughout; bytes are those of the busiest rank (sent or received, whichever is larger).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from splash_rollout.layout import Layout, Primitive, SwitchPlan
from splash_rollout.scheduling.profile import HardwareProfile


@dataclass(frozen=True)
class SwitchCost:
    src: Layout
    dst: Layout
    blocking_s: float
    """All layers' transfers serialized before the step."""
    overlapped_s: float
    """Exposed time when layer i's transfer hides behind layer i−1's compute."""
    layer_transfer_s: tuple[float, ...]
    """[num_layers] transfer time of each layer."""
    bytes_per_rank: int
    """Most bytes any rank receives over the whole switch."""
    layer_buffer_bytes: int = 0
    """Eq. 5 headroom: one layer's incoming buffers on the busiest rank."""

    def to_dict(self) -> dict:
        return {"src": self.src.value, "dst": self.dst.value, "blocking_s": self.blocking_s,
                "overlapped_s": self.overlapped_s, "bytes_per_rank": self.bytes_per_rank}


def _move_seconds(primitive: Primitive, sent: Sequence[int], received: Sequence[int], profile: HardwareProfile) -> float:
    if not primitive.moves_bytes:
        return 0.0
    busiest = max(max(sent, default=0), max(received, default=0))
    cost = profile.all_gather if primitive is Primitive.ALL_GATHER else profile.all_to_all
    return cost.time(busiest)


def layer_transfer_seconds(plan: SwitchPlan, profile: HardwareProfile) -> tuple[float, ...]:
    """[num_layers] seconds to move each layer's missing weights and KV."""
    return tuple(_move_seconds(l.weights.primitive, l.weights.bytes_sent, l.weights.bytes_received, profile)
                 + _move_seconds(l.kv.primitive, l.kv.bytes_sent, l.kv.bytes_received, profile)
                 for l in plan.layers)


def overlapped_seconds(transfer_s: Sequence[float], compute_s: Sequence[float] | float) -> float:
    """Eq. 7: the first layer's transfer plus each later layer's excess over its predecessor's compute."""
    if not transfer_s:
        return 0.0
    if isinstance(compute_s, (int, float)):
        compute_s = [float(compute_s)] * len(transfer_s)
    if len(compute_s) != len(transfer_s):
        raise ValueError(f"compute_s: expected {len(transfer_s)} layers, got {len(compute_s)}")
    return transfer_s[0] + sum(max(0.0, x - c) for x, c in zip(transfer_s[1:], compute_s[:-1]))


def switch_cost(plan: SwitchPlan, profile: HardwareProfile, layer_compute_s: Sequence[float] | float) -> SwitchCost:
    """Blocking and overlapped cost of ``plan``; ``layer_compute_s`` is the destination step's per-layer
    compute (``StepCost.layer_seconds``) or one number for every layer."""
    x = layer_transfer_seconds(plan, profile)
    return SwitchCost(plan.src, plan.dst, float(sum(x)), float(overlapped_seconds(x, layer_compute_s)), x,
                      int(plan.max_bytes_received), int(plan.layer_buffer_bytes))
