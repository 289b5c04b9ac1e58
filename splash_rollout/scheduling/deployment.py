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
decode group that runs DP-attention, and decode overlaps later prompts' prefill. A finished prompt's
KV leaves from the prefill ranks that hold it (``kv_senders``), each over its own link at
``kv_transfer_Bps``; a measured batch also pays a fixed ``batch_overhead_s`` that depends on the
prefill layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
        # the published deployments (SGLang) split the embeddings and the LM head over the vocabulary
        other = other_weight_bytes_per_rank(model, t, weight_dtype, profile.feed_forward, vocab="sharded")
        fps = {}
        for l in ALL_LAYOUTS:
            reserve = profile.reserve_bytes + int(profile.per_layout("workspace_bytes", l.value))
            budget = RankBudget(profile.memory_bytes, profile.mem_fraction, reserve, other)
            fps[l] = footprint(l, sizes, t, budget, page_size)
        return cls(model, profile, sizes, fps, page_size, weight_dtype, kv_format)


def kv_senders(layout: Layout, world_size: int) -> int:
    """Prefill ranks that send one finished prompt's KV to the decode group at the same time: CP
    shards the sequence over the group (every rank sends its slice); a TP prompt is replicated (one
    rank sends) and a DP-attention / DOP prompt lives on its owner."""
    return world_size if layout is Layout.CP else 1


@dataclass(frozen=True)
class Serving:
    """Where prefill and decode run. ``decode is None``: co-located, ``prefill`` does both."""

    prefill: Deployment
    decode: Deployment | None = None
    """The decode group (DP-attention), or None when co-located."""
    kv_transfer_Bps: float = 0.0
    """Bytes per second one sending prefill rank moves KV to the decode group (its own link); a
    prompt held by ``kv_senders`` ranks leaves that many times faster."""
    decode_scale: float = 1.0
    """Correction factor on the decode group's predicted step seconds (fitted)."""
    batch_overhead_s: Mapping[str, float] | float = field(default_factory=dict)
    """Per prefill layout (``tp`` / ``cp`` / ``dp`` / ``dop``): fixed seconds per measured batch
    outside the engine's steps (client, queueing, the layout's start-up per batch); a layout absent
    from it pays 0. A plain number is the same constant for every layout (stored as the mapping)."""

    def __post_init__(self) -> None:
        if self.decode is not None and not self.kv_transfer_Bps > 0:
            raise ValueError(f"kv_transfer_Bps: expected a positive rate with a decode group, got {self.kv_transfer_Bps}")
        raw = self.batch_overhead_s
        if isinstance(raw, Mapping):
            per_layout = {str(k): v for k, v in raw.items()}
        elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
            per_layout = {l.value: raw for l in ALL_LAYOUTS}
        else:
            raise ValueError(f"batch_overhead_s: expected a number or a mapping {{layout: seconds}}, got {raw!r}")
        names = [l.value for l in ALL_LAYOUTS]
        for k, v in per_layout.items():
            if k not in names:
                raise ValueError(f"batch_overhead_s: unknown layout {k!r}; expected one of {names}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"batch_overhead_s[{k!r}]: expected a non-negative number, got {v!r}")
        object.__setattr__(self, "batch_overhead_s", {k: float(v) for k, v in per_layout.items()})
        if self.decode_scale < 0:
            raise ValueError(f"decode_scale: expected a non-negative number, got {self.decode_scale}")

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None

    def batch_seconds(self, layout: Layout | str) -> float:
        """The fixed seconds a measured batch pays with its prefill in ``layout``."""
        return float(self.batch_overhead_s.get(Layout(layout).value, 0.0))
