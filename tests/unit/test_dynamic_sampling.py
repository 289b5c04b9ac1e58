"""Over-sampling with dynamic filtering in the GRPO recipe: the std filter, the scorer that judges
groups as they finish, and a tiny run (one rank) that trains on exactly prompts_per_step groups
with a signal while every asked group is counted."""
from __future__ import annotations

import json

import pytest

from splash_rollout.recipes.grpo.dynamic_sampling import GroupScorer, OversampleConfig, passes
from splash_rollout.rollout.types import RolloutBatch, Sample, SampleGroup


def parity_reward(response: str, row: dict, token_ids: list[int]) -> float:
    """Reward 1 when the response's token ids sum to an odd number: samples of one prompt often disagree."""
    return float(sum(token_ids) % 2)


def test_std_filter():
    assert passes([0.0, 1.0, 0.0], "std") and not passes([0.5, 0.5, 0.5], "std")
    assert passes([0.5, 0.5], "none")
    with pytest.raises(ValueError, match="grpo.filter"):
        OversampleConfig(8, 4, filter="spread")
    with pytest.raises(ValueError, match=r"grpo.oversample_groups: expected >= grpo.prompts_per_step \(4\)"):
        OversampleConfig(3, 4)


class _Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


class _Ex:
    row, split, index = {}, "train", 0


def test_scorer_keeps_scores_of_kept_groups_in_their_order():
    from splash_rollout.recipes.grpo.build import reward_options
    from splash_rollout.recipes.grpo.reward_fns import RewardFunction
    from splash_rollout.run import compose_config

    fn = RewardFunction(reward_options(compose_config(["+recipe=grpo_glm5",
                                                       "reward.fn=tests.unit.test_dynamic_sampling:parity_reward"])))
    scorer = GroupScorer(fn, [_Ex(), _Ex(), _Ex()], _Tok(), "std")
    group = lambda i, lens: SampleGroup(i, [Sample([1], [7] * n, [0.0] * n, "stop", 0) for n in lens])  # noqa: E731
    assert scorer(group(0, [1, 2])) and not scorer(group(1, [2, 4])) and scorer(group(2, [2, 3]))
    kept = RolloutBatch([group(2, [2, 3]), group(0, [1, 2])])
    assert scorer.rewards_of(kept).reward == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.timeout(120)
def test_recipe_trains_on_the_first_groups_that_pass(tmp_path, no_leftover_process_group):
    from splash_rollout.run import compose_config, launch

    cfg = compose_config(["+recipe=grpo_glm5", "sft.steps=0", "grpo.steps=2", "grpo.prompts_per_step=2",
                          "grpo.oversample_groups=6", "grpo.n=4", "grpo.max_new_tokens=12",
                          "trainer.micro_batch_size=8", "logger.kind=none", "hardware.threads=1", "engine.parallel.world_size=1", "eval.every=0",
                          "trainer=torch", "engine.compute.numerics=fast", "grpo.rollout_corr.is_level=token",
                          "grpo.routing_replay=true",
                          "reward.fn=tests.unit.test_dynamic_sampling:parity_reward"])
    launch(cfg, str(tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for m in lines:
        assert m["rollout/asked_groups"] == 6
        assert m["rollout/kept_groups"] + m["rollout/filtered_groups"] + m["rollout/aborted_groups"] == 6
        if m["rollout/kept_groups"] == 2:  # trained: only groups with a signal, n samples each
            assert m["reward/groups_with_signal"] == 1.0 and m["rollout/num_samples"] == 8
            assert m["train/trained_samples"] == 8 and 0.9 < m["rollout_corr/ratio_mean"] < 1.1
            assert m["train/logprob_diff_max"] <= 1e-5  # the trainer replays the engine's routing
        else:  # fewer than the target passed: the call ran out, nothing was cut off
            assert m["rollout/aborted_groups"] == 0 and m["rollout/aborted_samples"] == 0
    assert any(m["rollout/kept_groups"] == 2 for m in lines)
