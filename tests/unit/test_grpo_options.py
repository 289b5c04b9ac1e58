"""GRPO options, against hand-computed values: loss aggregation, KL estimators (loss and reward),
entropy bonus, LR schedules, overlong masking / penalty, pass@k."""
from __future__ import annotations

import math

import pytest
import torch

from splash_rollout.recipes.grpo.evaluation import pass_at_k
from splash_rollout.recipes.grpo.loss import GRPOLossConfig, grpo_loss, kl_per_token, sample_weight, step_normalizer, \
    token_logprobs_and_entropy
from splash_rollout.recipes.grpo.schedule import LRSchedule
from splash_rollout.recipes.grpo.update import UpdateConfig, _response_mask, shape_rewards
from splash_rollout.rollout.types import RolloutBatch, Sample, SampleGroup

# two samples: 3 and 1 response tokens; on-policy (ratio 1) so the per-token loss is -A
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])
LP = torch.zeros(2, 3)


def loss_of(agg: str, max_new: int = 4) -> float:
    lengths = [3, 1]
    w = torch.tensor([sample_weight(n, agg) for n in lengths]) if agg == "seq_mean" else None
    loss, _ = grpo_loss(LP, LP, ADV, MASK, GRPOLossConfig(loss_agg=agg), weights=w,
                        normalizer=step_normalizer(lengths, agg, max_new, world_size=1))
    return float(loss)


def test_loss_aggregations():
    assert loss_of("token_mean") == pytest.approx((-1 * 3 + 2 * 1) / 4)          # every token the same
    assert loss_of("seq_mean") == pytest.approx((-1 * 3 / 3 + 2 * 1 / 1) / 2)    # every sample the same
    assert loss_of("drgrpo", max_new=4) == pytest.approx((-1 * 3 + 2 * 1) / (2 * 4))  # a constant
    assert step_normalizer([3, 1], "token_mean", 4, world_size=2) == 2.0  # gradients are averaged over ranks
    with pytest.raises(ValueError, match="grpo.loss_agg"):
        GRPOLossConfig(loss_agg="mean")


def test_kl_estimators():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    assert float(kl_per_token(lp, ref, "k1")) == pytest.approx(d)
    assert float(kl_per_token(lp, ref, "k2")) == pytest.approx(d * d / 2)
    assert float(kl_per_token(lp, ref, "k3")) == pytest.approx(math.exp(-d) + d - 1)
    assert float(kl_per_token(ref, ref, "k3")) == 0.0
    cfg = GRPOLossConfig(kl_coef=0.5, kl_estimator="k2")
    loss, stats = grpo_loss(LP, LP, torch.zeros(2), MASK, cfg, ref_logprobs=LP - 1.0)
    assert float(stats["kl"]) == pytest.approx(0.5) and float(loss) == pytest.approx(0.25)


def test_entropy_bonus():
    logits = torch.zeros(1, 2, 4)  # uniform over 4: H = log 4
    lp, ent = token_logprobs_and_entropy(logits, torch.zeros(1, 2, dtype=torch.long))
    assert torch.allclose(ent, torch.full((1, 2), math.log(4.0)))
    loss, stats = grpo_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), GRPOLossConfig(entropy_coef=0.1), entropy=ent)
    assert float(loss) == pytest.approx(-0.1 * math.log(4.0)) and float(stats["entropy"]) == pytest.approx(math.log(4))


def test_lr_schedules():
    const = LRSchedule(lr=1.0, kind="constant", warmup_steps=4, total_steps=10)
    assert [const.lr_at(s) for s in (0, 1, 3, 9)] == [0.25, 0.5, 1.0, 1.0]
    cos = LRSchedule(lr=1.0, kind="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert cos.lr_at(0) == 0.5 and cos.lr_at(2) == pytest.approx(1.0)
    assert cos.lr_at(7) == pytest.approx(0.1 + 0.9 * 0.5) and cos.lr_at(12) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="grpo.lr_schedule"):
        LRSchedule(lr=1.0, kind="linear")


def _batch() -> RolloutBatch:
    s = lambda n, why: Sample([5], [7] * n, [-0.5] * n, why, seed=0)
    return RolloutBatch([SampleGroup(0, [s(2, "stop"), s(4, "length")])])


def test_overlong_mask_and_penalty():
    batch, rewards = _batch(), torch.tensor([[1.0, 1.0]])
    shaped, _ = shape_rewards(rewards, batch, UpdateConfig(GRPOLossConfig(), overlong="penalty", overlong_penalty=0.7),
                              None)
    assert shaped.tolist() == [[1.0, pytest.approx(0.3)]]
    assert [_response_mask(s, "mask") for s in batch.samples] == [[1, 1], [0, 0, 0, 0]]
    assert [_response_mask(s, "keep") for s in batch.samples] == [[1, 1], [1, 1, 1, 1]]


def test_kl_in_reward():
    batch, rewards = _batch(), torch.tensor([[1.0, 1.0]])
    ref = [torch.full((2,), -1.5), torch.full((4,), -0.5)]  # delta = +1 per token on sample 0, 0 on sample 1
    cfg = UpdateConfig(GRPOLossConfig(kl_coef=0.1, kl_estimator="k1"), kl_in="reward")
    shaped, stats = shape_rewards(rewards, batch, cfg, ref)
    assert shaped.tolist() == [[pytest.approx(1.0 - 0.1 * 2), 1.0]] and stats["train/kl_reward"] == pytest.approx(1.0)


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 * 2) / (4 * 3))  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer wrong samples than k


def test_separate_reference_checkpoint(tmp_path):
    from splash_rollout.recipes.grpo.build import load_reference
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    policy = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0)
    other = MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=1)
    torch.save(other.state_dict(), tmp_path / "ref.pt")
    ref = load_reference(str(tmp_path / "ref.pt"), policy, "float32")
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    for name, t in ref.state_dict().items():
        assert torch.equal(t, other.state_dict()[name])
    assert any(p.requires_grad for p in policy.parameters())  # the policy itself is untouched
    with pytest.raises(FileNotFoundError, match="grpo.ref_path"):
        load_reference(str(tmp_path / "missing.pt"), policy, "float32")
