"""Process supervision: per-token advantages from per-step rewards (``grpo.supervision=process``).

Outcome supervision gives every token of a sample the same advantage, so a response that goes
wrong at its fourth step pushes its three right steps down with the wrong one. With process
supervision the reward function also scores each step (``"steps"``: ``[(end, reward), ...]`` in
character offsets of the response) and, as in DeepSeekMath's process-supervised GRPO, a group's
step rewards are normalised together and a token's advantage is built from the steps:

    r~_s  = (r_s - mean(R_group)) / (std(R_group) + eps)     R_group: every step reward of the group
    A_t   = r~_{s(t)}                                        credit = "step": the token's own step
    A_t   = sum_{s >= s(t)} r~_s                             credit = "to_go": its step and every later one

``s(t)`` is the first step ending after the token starts; tokens past the last step's end (the end
of sequence) belong to the last step. ``to_go`` is DeepSeekMath's; ``step`` credits each step with
its own reward only, which suits tasks whose steps are each checkable (a right step stays right
whatever follows it).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from splash_rollout.recipes.grpo.loss import group_advantages
from splash_rollout.recipes.grpo.reward_fns import Rewards
from splash_rollout.rollout.types import RolloutBatch

CREDITS = ("step", "to_go")


def token_starts(tokenizer, ids: Sequence[int]) -> list[int]:
    """[num_tokens] the character offset in ``tokenizer.decode(ids)`` where each token's text begins
    (prefix decodes, so a character split over several byte tokens starts at its first)."""
    starts, prev = [], 0
    for t in range(len(ids)):
        starts.append(prev)
        prev = len(tokenizer.decode(list(ids[:t + 1])))
    return starts


def steps_of_tokens(starts: Sequence[int], step_ends: Sequence[int]) -> list[int]:
    """[num_tokens] the index of the step each token belongs to: the first whose end is past the
    token's start, else the last."""
    last = len(step_ends) - 1
    return [min(bisect.bisect_right(step_ends, s), last) for s in starts]


def process_advantages(groups: Sequence[Sequence[Sequence[tuple[int, float]]]],
                       starts: Sequence[Sequence[Sequence[int]]], credit: str = "step",
                       eps: float = 1e-6, normalize_std: bool = True) -> list[list[list[float]]]:
    """``groups[g][i]``: sample i's steps ``[(end, reward)]`` (at least one, ends non-decreasing);
    ``starts[g][i]``: its tokens' start offsets (``token_starts``). Returns ``[g][i]`` a list of
    per-token advantages ([num_response_tokens] floats)."""
    if credit not in CREDITS:
        raise ValueError(f"grpo.process_credit: expected one of {CREDITS}, got {credit!r}")
    out = []
    for steps_g, starts_g in zip(groups, starts):
        rewards = [r for steps in steps_g for _, r in steps]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        scale = 1.0 / (std + eps) if normalize_std else 1.0
        group_out = []
        for steps, tok_starts in zip(steps_g, starts_g):
            normed = [(r - mean) * scale for _, r in steps]
            if credit == "to_go":
                for s in range(len(normed) - 2, -1, -1):
                    normed[s] += normed[s + 1]
            owner = steps_of_tokens(tok_starts, [end for end, _ in steps])
            group_out.append([normed[s] for s in owner])
        out.append(group_out)
    return out


SUPERVISIONS = ("outcome", "process")


@dataclass(frozen=True)
class Supervision:
    """Where a step's advantages come from: ``outcome`` (one per sample, the group-normalised
    reward) or ``process`` (one per token, from the reward function's ``"steps"``)."""

    kind: str = "outcome"
    credit: str = "step"
    """process: ``step`` | ``to_go`` (see the module docstring)."""
    eps: float = 1e-6
    normalize_std: bool = True

    def __post_init__(self) -> None:
        if self.kind not in SUPERVISIONS:
            raise ValueError(f"grpo.supervision: expected one of {SUPERVISIONS}, got {self.kind!r}")
        if self.credit not in CREDITS:
            raise ValueError(f"grpo.process_credit: expected one of {CREDITS}, got {self.credit!r}")

    def advantages(self, shaped: torch.Tensor, scored: Rewards, batch: RolloutBatch,
                   tokenizer) -> torch.Tensor | list[list[float]]:
        """``shaped`` [num_groups, n] rewards -> [num_groups, n] per-sample advantages (outcome), or
        per sample in group order a [num_response_tokens] list (process)."""
        if self.kind == "outcome":
            return group_advantages(shaped, self.eps, self.normalize_std)
        n = shaped.shape[1]
        if scored.steps is None or any(s is None for s in scored.steps):
            raise ValueError("grpo.supervision=process: the reward function must return a dict with 'steps' "
                             "([(end, reward), ...]) for every sample (the built-in 'chain' does)")
        samples = batch.samples
        starts = [token_starts(tokenizer, s.response_ids) for s in samples]
        steps = [scored.steps[i:i + n] for i in range(0, len(samples), n)]
        per_group = process_advantages(steps, [starts[i:i + n] for i in range(0, len(samples), n)], self.credit,
                                       self.eps, self.normalize_std)
        return [adv for group in per_group for adv in group]
