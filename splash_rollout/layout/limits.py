"""Longest feasible nominal input per layout: the sampled-cohort method of the paper's Appendix B.

For a nominal input length L, each cohort is B requests with inputs uniform on the integers
[floor(L/2), L] and outputs uniform on [512, 1024]; the whole input plus output is reserved and
DP-attention / DOP owners are round-robin. A layout supports L when every rank fits in at least
``target`` of the cohorts. L is found by bisection; each probe re-seeds PCG64 with the same seed
(inputs drawn first, then outputs), so probes share random numbers and feasibility is monotone in
practice. Numbers are in tokens; the paper prints them in k = 1024 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splash_rollout.layout.fit import rank_demand
from splash_rollout.layout.layouts import ALL_LAYOUTS, Layout

DEFAULT_SEED = 20260922
_MAX_ELEMENTS_PER_CHUNK = 8_000_000


@dataclass(frozen=True)
class CohortSpec:
    """How cohorts are sampled and judged."""

    cohorts: int = 200_000
    seed: int = DEFAULT_SEED
    target: float = 0.99
    """Fraction of cohorts in which every rank must fit."""
    output_min: int = 512
    output_max: int = 1024

    def __post_init__(self) -> None:
        if self.cohorts < 1:
            raise ValueError(f"cohorts: expected a positive integer, got {self.cohorts}")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target: expected a fraction in (0, 1], got {self.target}")
        if not 0 <= self.output_min <= self.output_max:
            raise ValueError(f"output range: expected 0 <= min <= max, got [{self.output_min}, {self.output_max}]")


def fraction_fitting(layout: Layout, nominal_input: int, pool_tokens_per_rank: int, world_size: int,
                     batch: int, spec: CohortSpec = CohortSpec()) -> float:
    """Share of sampled cohorts at nominal input L whose KV fits on every rank."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    rows = max(1, _MAX_ELEMENTS_PER_CHUNK // batch)
    fitting, done = 0, 0
    while done < spec.cohorts:
        n = min(rows, spec.cohorts - done)
        inputs = rng.integers(nominal_input // 2, nominal_input + 1, size=(n, batch), dtype=np.int64)
        outputs = rng.integers(spec.output_min, spec.output_max + 1, size=(n, batch), dtype=np.int64)
        fitting += int((rank_demand(layout, inputs + outputs, world_size) <= pool_tokens_per_rank).sum())
        done += n
    return fitting / spec.cohorts


def longest_feasible_input(layout: Layout, pool_tokens_per_rank: int, world_size: int, batch: int,
                           spec: CohortSpec = CohortSpec()) -> int:
    """Largest nominal input L (tokens) that meets the residency target; 0 if even L = 1 does not."""
    if batch < 1:
        raise ValueError(f"batch: expected a positive integer, got {batch}")
    if world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, got {world_size}")

    def ok(length: int) -> bool:
        return fraction_fitting(layout, length, pool_tokens_per_rank, world_size, batch, spec) >= spec.target

    if pool_tokens_per_rank <= 0 or not ok(1):
        return 0
    # the busiest rank holds at least the mean of the cohort's B * (floor(L/2) + output_min) tokens
    # over the T ranks, so any longer L fails in every cohort
    lo = 1
    hi = max(lo, 2 * (pool_tokens_per_rank * world_size // batch - spec.output_min) + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def longest_feasible_inputs(pool_tokens_per_rank: dict[Layout, int], world_size: int, batch: int,
                            spec: CohortSpec = CohortSpec()) -> dict[Layout, int]:
    return {l: longest_feasible_input(l, pool_tokens_per_rank[l], world_size, batch, spec)
            for l in ALL_LAYOUTS if l in pool_tokens_per_rank}
