"""Fit rules: does a batch's KV fit each layout's per-rank pool (paper §2, Appendix B).

With request totals s_i (prompt + reserved output) and a per-rank pool of P tokens:
TP needs sum(s) <= P on every rank (each holds every history); CP needs ceil(sum(s) / T) <= P
(positions spread ideally); DP-attention and DOP need, for every owner, the sum of its requests
<= P. ``rank_demand`` is the busiest rank's token count and is vectorised over leading axes.
"""
from __future__ import annotations

import numpy as np

from splash_rollout.layout.layouts import Layout, Ownership


def round_robin_owners(batch: int, world_size: int) -> np.ndarray:
    """Count-balanced, length-blind owners: request i on rank i mod T. Shape [batch] int64."""
    return np.arange(batch, dtype=np.int64) % world_size


def rank_demand(layout: Layout, lengths: np.ndarray, world_size: int, owners: np.ndarray | None = None) -> np.ndarray:
    """Busiest rank's KV tokens. lengths: [..., B] int64 → [...] int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ownership = layout.ownership
    if ownership is Ownership.EVERY:
        return lengths.sum(axis=-1)
    if ownership is Ownership.POSITIONS:
        return -(-lengths.sum(axis=-1) // world_size)
    batch = lengths.shape[-1]
    owners = round_robin_owners(batch, world_size) if owners is None else np.asarray(owners, dtype=np.int64)
    if owners.shape != (batch,):
        raise ValueError(f"owners: expected shape ({batch},), got {owners.shape}")
    if owners.size and (owners.min() < 0 or owners.max() >= world_size):
        raise ValueError(f"owners: expected ranks in [0, {world_size}), got {owners.min()}..{owners.max()}")
    per_rank = np.zeros(lengths.shape[:-1] + (world_size,), dtype=np.int64)
    for rank in range(world_size):
        per_rank[..., rank] = lengths[..., owners == rank].sum(axis=-1)
    return per_rank.max(axis=-1)


def fits(layout: Layout, lengths, pool_tokens_per_rank: int, world_size: int, owners=None) -> bool:
    """Whether these requests' KV fits the layout's pool on every rank."""
    return bool(rank_demand(layout, np.asarray(lengths), world_size, owners) <= pool_tokens_per_rank)
