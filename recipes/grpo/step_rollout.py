"""Where one GRPO step's groups come from, and their rewards, in the three ways the recipe runs.

* Plain: ``grpo.prompts_per_step`` fresh prompts, one ``generate``, then the reward function over
  the finished batch, group by group.
* Over-sampling (``grpo.oversample_groups``, dynamic_sampling.py): more prompts are asked for, the
  call streams each finished group to the reward function and ``grpo.filter``, and stops once
  ``prompts_per_step`` groups passed; the rewards are the ones computed while streaming.
* Partial rollout (``grpo.partial_rollout``, partial_rollout.py): on top of over-sampling, the
  groups the previous step's call cut off are taken back (too-stale ones dropped) and continued in
  this step's call, ahead of its fresh prompts; the ones this call cuts off are kept for the next.

The loop asks ``generate`` for a step's groups and ``rewards`` for their scores the same way in all
three; ``StepGroups.counts`` says what the step asked, kept, filtered, carried and dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splash_rollout.recipes.grpo.dynamic_sampling import GroupScorer, OversampleConfig, oversample_metrics
from splash_rollout.recipes.grpo.partial_rollout import Carry
from splash_rollout.recipes.grpo.reward_fns import RewardFunction, Rewards
from splash_rollout.recipes.grpo.task_data import Example, PromptOrder
from splash_rollout.rollout.types import RolloutBatch, SamplingParams


@dataclass
class StepGroups:
    batch: RolloutBatch
    examples: list[Example]
    """The call's examples by ``prompt_index`` (carried groups first, then the fresh prompts)."""
    policy_version: int
    """The weights the call sampled its new tokens with: the ones this step trains."""
    scorer: GroupScorer | None = None
    """Over-sampling: the rewards computed while the call streamed its groups."""
    oversample_counts: dict[str, float] = field(default_factory=dict)
    partial_counts: dict[str, float] = field(default_factory=dict)


def score_batch(reward_fn: RewardFunction, batch: RolloutBatch, examples: list[Example], tokenizer) -> Rewards:
    """The reward function over every sample of the batch, in group order."""
    flat = [(g.prompt_index, s) for g in batch.groups for s in g.samples]
    return reward_fn([tokenizer.decode(s.response_ids) for _, s in flat], [examples[i] for i, _ in flat],
                     [s.response_ids for _, s in flat])


class StepRollout:
    def __init__(self, reward_fn: RewardFunction, train: list[Example], order: PromptOrder, tokenizer,
                 prompts_per_step: int, oversample: OversampleConfig | None, carry: Carry | None) -> None:
        self.reward_fn, self.train, self.order, self.tokenizer = reward_fn, train, order, tokenizer
        self.oversample, self.carry = oversample, carry
        self.asked = oversample.oversample_groups if oversample else prompts_per_step
        """Groups a step asks for (carried ones included)."""

    def generate(self, engine, sampling: SamplingParams) -> StepGroups:
        carried = self.carry.take(engine.weight_version) if self.carry is not None else []
        indices = [c.data_index for c in carried] + self.order.take(self.asked - len(carried))
        examples = [self.train[i] for i in indices]
        fresh = [ex.prompt_ids for ex in examples[len(carried):]]
        if self.oversample is None:
            return StepGroups(engine.generate(fresh, sampling), examples, engine.weight_version)
        scorer = GroupScorer(self.reward_fn, examples, self.tokenizer, self.oversample.filter)
        batch = engine.generate(fresh, sampling, on_group=scorer, target_groups=self.oversample.target_groups,
                                resume=[c.group for c in carried] or None)
        out = StepGroups(batch, examples, engine.weight_version, scorer, oversample_metrics(batch))
        if self.carry is not None:
            self.carry.put(batch.aborted, indices)
            out.partial_counts = self.carry.metrics(batch, out.policy_version)
        return out

    def rewards(self, step: StepGroups) -> Rewards:
        """The rewards of ``step.batch.groups``' samples, in group order."""
        if step.scorer is not None:
            return step.scorer.rewards_of(step.batch)
        return score_batch(self.reward_fn, step.batch, step.examples, self.tokenizer)
