"""Deployment: one model on one profiled group, with the byte table and per-layout KV pools; and a
serving setup of one co-located group or a prefill group plus a decode group.

The cost model, switch cost, policy and simulator all need the same four things (model dims, θ,
per-layer bytes, each layout's per-rank pool in tokens); ``Deployment`` bundles them once so every
caller derives the pools the same way: ``layout.footprints`` over the profile's memory, mem_fraction
and reserve, less ``other_weight_bytes_per_rank`` (MLP / experts / embeddings), less the layout's
``workspace_bytes`` (the forward pass's activation peak and graph buffers, which an engine measures
before it sizes the pool and which differ by layout).

``Serving`` is how requests flow through groups. Co-located (RL rollout): one group prefills and
decodes, in whatever layout the policy picks. Disaggregated (how the published sweeps were
measured): a prefill group runs the layout under test, each finished prompt's KV crosses to a
decode group that runs DP-attention, and decode overlaps later prompts' prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from splash_rollout.layout import (AttentionBytes, Layout, LayoutFootprint, RankBudget, footprint,
                                   other_weight_bytes_per_rank)
from splash_rollout.layout.layouts import ALL_LAYOUTS
from splash_rollout.models.config import ModelConfig, resolve_model
from splash_rollout.scheduling.profile import HardwareProfile, load_profile


@dataclass(frozen=True)
class Deployment:
    model: ModelConfig
    profile: HardwareProfile
    sizes: AttentionBytes
    footprints: Mapping[Layout, LayoutFootprint]
    page_size: int = 64
    weight_dtype: str = "fp8"
    kv_format: str = "fp8-flashmla"

    @property
    def world_size(self) -> int:
        return self.profile.world_size

    @property
    def pools(self) -> dict[Layout, int]:
        """Per-rank KV pool in tokens per layout."""
        return {l: f.pool_tokens_per_rank for l, f in self.footprints.items()}

    def chunk_tokens(self, layout: Layout, default: int) -> int:
        """Prefill rows one step may run over the group in ``layout`` (the profile's budget, else
        ``default``)."""
        return int(self.profile.per_layout("chunk_tokens", layout.value, default))

    @classmethod
    def build(cls, model: ModelConfig | str, profile: HardwareProfile | str, weight_dtype: str = "fp8",
              kv_format: str = "fp8-flashmla", page_size: int = 64) -> "Deployment":
        model, profile = resolve_model(model), load_profile(profile)
        sizes = AttentionBytes.from_model(model, weight_dtype, kv_format)
        t = profile.world_size
        other = other_weight_bytes_per_rank(model, t, weight_dtype)
        fps = {}
        for l in ALL_LAYOUTS:
            reserve = profile.reserve_bytes + int(profile.per_layout("workspace_bytes", l.value))
            budget = RankBudget(profile.memory_bytes, profile.mem_fraction, reserve, other)
            fps[l] = footprint(l, sizes, t, budget, page_size)
        return cls(model, profile, sizes, fps, page_size, weight_dtype, kv_format)


@dataclass(frozen=True)
class Serving:
    """Where prefill and decode run. ``decode is None``: co-located, ``prefill`` does both."""

    prefill: Deployment
    decode: Deployment | None = None
    """The decode group (DP-attention), or None when co-located."""
    kv_transfer_Bps: float = 0.0
    """Bytes per second one prompt's KV crosses from the prefill group to the decode group."""
    decode_scale: float = 1.0
    """Correction factor on the decode group's predicted step seconds (fitted)."""
    batch_overhead_s: float = 0.0
    """Fixed seconds per measured batch outside the engine's steps (client, queueing, start)."""

    def __post_init__(self) -> None:
        if self.decode is not None and not self.kv_transfer_Bps > 0:
            raise ValueError(f"kv_transfer_Bps: expected a positive rate with a decode group, got {self.kv_transfer_Bps}")
        if self.decode_scale < 0 or self.batch_overhead_s < 0:
            raise ValueError("decode_scale, batch_overhead_s: expected non-negative numbers")

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None
