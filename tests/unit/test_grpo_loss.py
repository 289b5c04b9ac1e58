"""GRPO loss against hand-computed numbers: advantages, clipping on both sides, masking, ratio 1, KL."""
import math

import pytest
import torch

from splash_rollout.recipes.grpo.loss import GRPOLossConfig, group_advantages, grpo_loss, token_logprobs
from splash_rollout.recipes.grpo.trainer import collate


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]), eps=0.0)
    # group 0: mean 0.5, population std 0.5 -> +-1
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # group 1: mean 0.25, std sqrt(3)/4
    s = math.sqrt(3) / 4
    assert adv[1].tolist() == pytest.approx([-0.25 / s, -0.25 / s, 0.75 / s, -0.25 / s])


def test_group_advantages_constant_group_is_zero_and_centred_only_option():
    assert group_advantages(torch.tensor([[0.1, 0.1, 0.1]])).abs().max() == 0
    assert group_advantages(torch.tensor([[2.0, 0.0]]), normalize_std=False).tolist() == [[1.0, -1.0]]


def _loss(log_ratio, adv, mask=None, **cfg):
    old = torch.zeros(len(adv), len(log_ratio[0]))
    lp = torch.tensor(log_ratio, dtype=torch.float32, requires_grad=True)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32)
    loss, stats = grpo_loss(lp, old, torch.tensor(adv), mask, GRPOLossConfig(**cfg))
    return loss, stats, lp


def test_ratio_one_when_logprobs_equal():
    loss, stats, lp = _loss([[0.0, 0.0], [0.0, 0.0]], [1.0, -3.0])
    # per-token -A*1: tokens (-1, -1, 3, 3) -> mean 1.0
    assert loss.item() == pytest.approx(1.0)
    assert stats["ratio"].item() == pytest.approx(1.0) and stats["clip_frac"].item() == 0.0
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.75, 0.75])


def test_clipping_both_sides():
    r_hi, r_lo = math.log(1.5), math.log(0.5)
    # A=+1, ratio 1.5 -> clipped at 1.2: -1.2, no gradient
    loss, stats, lp = _loss([[r_hi]], [1.0], clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_frac"].item() == 1.0
    loss.backward()
    assert lp.grad.item() == 0.0
    # A=-1, ratio 0.5 -> clipped at 0.8: +0.8, no gradient
    loss, stats, lp = _loss([[r_lo]], [-1.0], clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(0.8) and stats["clip_frac"].item() == 1.0
    loss.backward()
    assert lp.grad.item() == 0.0
    # pessimistic side is never clipped: A=-1 ratio 1.5 -> 1.5; A=+1 ratio 0.5 -> -0.5
    loss, stats, lp = _loss([[r_hi], [r_lo]], [-1.0, 1.0], clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((1.5 - 0.5) / 2) and stats["clip_frac"].item() == 0.0
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1.0 * 1.5 / 2 * -1, -1.0 * 0.5 / 2])
    # asymmetric (clip-higher): A=+1 ratio 1.5 with clip_high 0.28 -> -1.28
    loss, _, _ = _loss([[r_hi]], [1.0], clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_masked_tokens_ignored():
    base, _, _ = _loss([[0.0, 0.0, 0.0]], [2.0], mask=[[1, 1, 0]])
    garbage, _, lp = _loss([[0.0, 0.0, 50.0]], [2.0], mask=[[1, 1, 0]])
    assert base.item() == pytest.approx(-2.0) and garbage.item() == pytest.approx(-2.0)
    garbage.backward()
    assert lp.grad[0, 2].item() == 0.0


def test_normalizer_is_global_token_count():
    lp = torch.zeros(1, 2)
    loss, _ = grpo_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), normalizer=8.0)
    assert loss.item() == pytest.approx(-2.0 / 8.0)


def test_kl_k3_estimator():
    lp = torch.zeros(1, 2)
    ref = torch.tensor([[0.0, math.log(2.0)]])
    loss, stats = grpo_loss(lp, lp, torch.tensor([0.0]), torch.ones(1, 2), GRPOLossConfig(kl_coef=0.5), ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert stats["kl"].item() == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.5 * k3 / 2)


def test_token_logprobs_temperature_and_collate_alignment():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    got = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert got.item() == pytest.approx(1.0 - math.log(math.e + 2.0))
    b = collate([[5, 6], [7]], [[8, 9, 1], [3]], pad_id=2, per_token={"old": [[-1, -2, -3], [-4]]},
                per_sample={"adv": [0.5, -0.5]})
    assert b.input_ids.tolist() == [[5, 6, 8, 9, 1], [7, 3, 2, 2, 2]]
    # targets at mask positions are exactly the response tokens
    assert b.targets[0][b.loss_mask[0] > 0].tolist() == [8, 9, 1]
    assert b.targets[1][b.loss_mask[1] > 0].tolist() == [3]
    assert b.extras["old"][0].tolist() == [0, -1, -2, -3] and b.extras["adv"].tolist() == [0.5, -0.5]
