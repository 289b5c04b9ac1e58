"""Deployment: one model on one profiled group, with the byte table and per-layout KV pools.

The cost model, switch cost, policy and simulator all need the same four things (model dims, θ,
per-layer bytes, each layout's per-rank pool in tokens); this bundles them once so every caller
derives the pools the same way: ``layout.footprints`` over the profile's memory, mem_fraction and
reserve, less ``other_weight_bytes_per_rank`` (MLP / experts / embeddings).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from splash_rollout.layout import (AttentionBytes, Layout, LayoutFootprint, RankBudget, footprints,
                                   other_weight_bytes_per_rank)
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

    @classmethod
    def build(cls, model: ModelConfig | str, profile: HardwareProfile | str, weight_dtype: str = "fp8",
              kv_format: str = "fp8-flashmla", page_size: int = 64) -> "Deployment":
        model, profile = resolve_model(model), load_profile(profile)
        sizes = AttentionBytes.from_model(model, weight_dtype, kv_format)
        t = profile.world_size
        budget = RankBudget(profile.memory_bytes, profile.mem_fraction, profile.reserve_bytes,
                            other_weight_bytes_per_rank(model, t, weight_dtype))
        return cls(model, profile, sizes, footprints(sizes, t, budget, page_size), page_size, weight_dtype, kv_format)
