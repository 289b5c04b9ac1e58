"""Partial rollout across GRPO steps: the groups one step's over-sampled call cut off are finished in
the next step, under the new weights, instead of being thrown away.

With ``grpo.oversample_groups`` the streaming call stops once ``prompts_per_step`` groups pass the
filter; the groups still running then (``batch.aborted``) hold tokens that cost engine time. With
``grpo.partial_rollout: true`` the loop hands them to ``Carry.put``; the next step takes them back
(``Carry.take``) ahead of its fresh prompts and passes them to the same streaming ``generate`` call
(``resume=``): their finished samples are kept, their aborted samples continue under the new weights
(each token keeps the weight version it was sampled under), and the fresh prompts fill the rest of
the step's ``oversample_groups``. A carried group is judged by the filter like any other once its
last sample finishes; it may be cut off again and carried on.

Staleness (``grpo.max_off_policy_steps: k``, null: no bound): a carried group whose oldest token is
more than k weight versions behind the engine's is dropped whole when it is taken back (GRPO needs
every sample of a group) and counted under ``rollout/stale_dropped`` (groups) and
``rollout/stale_dropped_samples``. Every group a step asks for ends in exactly one of: trained
(kept), filtered, carried to the next step, or dropped as stale.

The trainer sees each token's version (``Sample.token_versions``): the per-token rollout logprobs
are those of the policy that sampled the token, so the PPO ratio (or, with ``grpo.rollout_corr``,
the importance weight exp(lp_old - lp_rollout), per token or summed over the sample) is taken
against the right behaviour policy for every token of a mixed-version sample.

The carried groups are part of a run checkpoint (``state_dict`` / ``load_state_dict``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash_rollout.rollout.types import RolloutBatch, SampleGroup


@dataclass(frozen=True)
class PartialRolloutConfig:
    max_off_policy_steps: int | None = 1
    """k: a carried group whose oldest token is more than k weight versions old is dropped; None: no bound."""

    def __post_init__(self) -> None:
        k = self.max_off_policy_steps
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"grpo.max_off_policy_steps: expected an integer >= 0 or null, got {k!r}")


def group_lag(group: SampleGroup, version: int) -> int:
    """Weight versions between ``version`` and the group's oldest token."""
    return max((s.lag(version) for s in group.samples), default=0)


@dataclass
class CarriedGroup:
    data_index: int
    """The prompt's row in the train split (the reward function reads it)."""
    group: SampleGroup
    """The group as the engine returned it (finished samples and aborted ones)."""


@dataclass
class Carry:
    """The groups waiting for the next step (every rank holds the same ones)."""

    config: PartialRolloutConfig
    groups: list[CarriedGroup] = field(default_factory=list)
    last_take: dict[str, float] = field(default_factory=dict)
    """What the latest ``take`` resumed and dropped (its step's records)."""

    def take(self, version: int) -> list[CarriedGroup]:
        """The carried groups to finish under weight ``version``, oldest first; the too-stale ones are
        dropped (and counted in ``last_take``). The carry is empty afterwards."""
        k = self.config.max_off_policy_steps
        fresh, stale = [], []
        for c in self.groups:
            (fresh if k is None or group_lag(c.group, version) <= k else stale).append(c)
        self.groups = []
        self.last_take = {"rollout/resumed_groups": float(len(fresh)),
                          "rollout/stale_dropped": float(len(stale)),
                          "rollout/stale_dropped_samples": float(sum(len(c.group.samples) for c in stale))}
        return fresh

    def put(self, aborted: list[SampleGroup], data_indices: list[int]) -> None:
        """Keep a call's ``batch.aborted`` for the next step; ``data_indices[g]`` is the train row of
        the call's group ``g`` (its ``prompt_index``)."""
        self.groups = [CarriedGroup(data_indices[g.prompt_index], g) for g in aborted]

    def metrics(self, batch: RolloutBatch, version: int) -> dict[str, float]:
        """This step's partial-rollout records: what was resumed, carried on and dropped (call after
        ``put``), and the policy lag of the trained tokens behind ``version`` (the weights the step
        trains)."""
        lags = np.array([version - v for s in batch.samples for v, m in zip(s.versions, s.loss_mask) if m],
                        dtype=np.int64)
        asked = len(batch.groups) + len(batch.filtered) + len(batch.aborted) + self.last_take.get(
            "rollout/stale_dropped", 0.0)
        return {**self.last_take, "rollout/carried_groups": float(len(self.groups)),
                "rollout/asked_groups": float(asked),
                "rollout/resumed_samples": batch.metrics.get("rollout/resumed_samples", 0.0),
                "rollout/off_policy_tokens_frac": float((lags > 0).mean()) if lags.size else 0.0,
                "rollout/max_token_lag": float(lags.max()) if lags.size else 0.0}

    def state_dict(self) -> list[dict[str, Any]]:
        return [{"data_index": c.data_index, "group": c.group} for c in self.groups]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.groups = [CarriedGroup(int(c["data_index"]), c["group"]) for c in state]
