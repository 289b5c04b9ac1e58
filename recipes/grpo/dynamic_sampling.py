"""Over-sampling with dynamic filtering (DAPO): roll out more prompts than a step trains on, keep the
first groups that carry a learning signal, abort the rest.

A group whose rewards are all equal has zero advantages: it costs a full rollout and trains
nothing. With ``grpo.oversample_groups`` the loop asks the engine for that many prompts, scores each
group the moment its last sample finishes (``GroupScorer`` is the engine's ``on_group``), keeps it
when it passes ``grpo.filter``, and the engine stops the call once ``grpo.prompts_per_step`` groups
are kept -- the long tail of the slowest groups is cut off instead of waited for. The reward of a
kept group is computed once, here, and reused for its advantages.

``grpo.filter``: ``std`` (default: population std of the group's rewards > 0) or ``none`` (keep
every group: over-sampling only cuts the tail).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash_rollout.recipes.grpo.reward_fns import RewardFunction, Rewards
from splash_rollout.rollout.types import RolloutBatch, SampleGroup

FILTERS = ("std", "none")


@dataclass(frozen=True)
class OversampleConfig:
    oversample_groups: int
    """Prompts rolled out per step (>= the groups trained on)."""
    target_groups: int
    """Groups trained on per step (``grpo.prompts_per_step``)."""
    filter: str = "std"
    """std | none (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.filter not in FILTERS:
            raise ValueError(f"grpo.filter: expected one of {FILTERS}, got {self.filter!r}")
        if self.oversample_groups < self.target_groups:
            raise ValueError(f"grpo.oversample_groups: expected >= grpo.prompts_per_step ({self.target_groups}), "
                             f"got {self.oversample_groups}")


def passes(rewards: list[float], kind: str) -> bool:
    """Whether a group with these rewards is kept."""
    return kind == "none" or float(torch.tensor(rewards, dtype=torch.float64).std(unbiased=False)) > 0


class GroupScorer:
    """``on_group`` for one step's streaming ``generate``: scores each finished group with the reward
    function, remembers the scores, and answers whether the group is kept."""

    def __init__(self, reward_fn: RewardFunction, examples: list, tokenizer, kind: str) -> None:
        self.reward_fn, self.examples, self.tokenizer, self.kind = reward_fn, examples, tokenizer, kind
        self.scores: dict[int, Rewards] = {}
        """prompt index -> the rewards of its group's samples."""

    def __call__(self, group: SampleGroup) -> bool:
        ex = self.examples[group.prompt_index]
        scored = self.reward_fn([self.tokenizer.decode(s.response_ids) for s in group.samples],
                                [ex] * len(group.samples), [s.response_ids for s in group.samples])
        self.scores[group.prompt_index] = scored
        return passes(scored.reward, self.kind)

    def rewards_of(self, batch: RolloutBatch) -> Rewards:
        """The scores of ``batch.groups`` (the kept ones), in their order."""
        parts = [self.scores[g.prompt_index] for g in batch.groups]
        keys = sorted({k for p in parts for k in p.extras})
        steps = [x for p in parts for x in (p.steps or [None] * len(p.reward))]
        return Rewards([r for p in parts for r in p.reward], [c for p in parts for c in p.correct],
                       {k: [v for p in parts for v in p.extras.get(k, [float("nan")] * len(p.reward))]
                        for k in keys}, steps if any(x is not None for x in steps) else None)


def oversample_metrics(batch: RolloutBatch) -> dict[str, float]:
    """What the streaming call kept, filtered and cut off (every asked group is in one of them)."""
    keys = ("rollout/kept_groups", "rollout/filtered_groups", "rollout/aborted_groups", "rollout/aborted_samples")
    out = {k: batch.metrics[k] for k in keys if k in batch.metrics}
    out["rollout/asked_groups"] = float(len(batch.groups) + len(batch.filtered) + len(batch.aborted))
    return out
