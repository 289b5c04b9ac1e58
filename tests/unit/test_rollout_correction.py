"""Off-policy correction in the GRPO loss, against hand-computed numbers: truncated IS and masked IS
at token and sequence level, their product, the rollout_corr/* stats, and one GRPO update in which
masking every token leaves the weights untouched."""
from __future__ import annotations

import math

import pytest
import torch

from splash_rollout.recipes.grpo.loss import GRPOLossConfig, grpo_loss
from splash_rollout.recipes.grpo.rollout_correction import RolloutCorrectionConfig, correction_weights

# two samples; the trainer's old logprobs are 0 and equal the current ones (PPO ratio 1), so the
# per-token loss is -A * w and its gradient -A * w / 5 (5 masked tokens)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])
# token ratios r = exp(old - rollout): sample 0 (3, 1, 0.25), R = 0.75; sample 1 (0.5, 4), R = 2;
# the padded third token of sample 1 has a huge ratio that must be ignored
RATIOS = torch.tensor([[3.0, 1.0, 0.25], [0.5, 4.0, 100.0]], dtype=torch.float64)
ROLLOUT = (-torch.log(RATIOS)).float()


def run(**corr) -> tuple[float, dict[str, float], list[float]]:
    lp = torch.zeros(2, 3, requires_grad=True)
    cfg = GRPOLossConfig(rollout_corr=RolloutCorrectionConfig(**corr))
    loss, stats = grpo_loss(lp, torch.zeros(2, 3), ADV, MASK, cfg, rollout_logprobs=ROLLOUT)
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in stats.items()}, lp.grad.flatten().tolist()


def test_off_by_default_is_plain_grpo():
    loss, stats, grad = run()
    assert loss == pytest.approx((-3 + 2 * 2) / 5)
    assert not any(k.startswith("rollout_corr/") for k in stats)
    assert grad == pytest.approx([-0.2, -0.2, -0.2, 0.4, 0.4, 0.0])


def test_token_truncated_is():
    loss, stats, grad = run(is_level="token", is_cap=2.0)
    # weights (2, 1, 0.25) and (0.5, 2): -1 * (2 + 1 + 0.25) + 2 * (0.5 + 2) = 1.75
    assert loss == pytest.approx(1.75 / 5)
    assert grad == pytest.approx([-2 / 5, -1 / 5, -0.25 / 5, 1 / 5, 4 / 5, 0.0])
    assert stats["rollout_corr/clipped_frac"] == pytest.approx(2 / 5)     # the 3 and the 4
    assert stats["rollout_corr/ratio_mean"] == pytest.approx(8.75 / 5)
    assert stats["rollout_corr/ratio_max"] == pytest.approx(4.0)          # not the padding's 100
    assert stats["rollout_corr/seq_ratio_max"] == pytest.approx(2.0)
    assert stats["rollout_corr/seq_ratio_mean"] == pytest.approx((0.75 + 2.0) / 2)
    assert stats["rollout_corr/masked_frac"] == 0.0


def test_sequence_truncated_is():
    loss, stats, _ = run(is_level="sequence", is_cap=1.5)
    # sample 0: R = 0.75 on 3 tokens; sample 1: min(2, 1.5) on 2 tokens
    assert loss == pytest.approx((-1 * 0.75 * 3 + 2 * 1.5 * 2) / 5)
    assert stats["rollout_corr/clipped_frac"] == pytest.approx(2 / 5)


def test_token_masked_is():
    loss, stats, grad = run(mask_level="token", mask_low=0.4, mask_high=2.0)
    # kept: (0, 1, 0) and (1, 0)
    assert loss == pytest.approx((-1 + 2) / 5)
    assert grad == pytest.approx([0.0, -0.2, 0.0, 0.4, 0.0, 0.0])
    assert stats["rollout_corr/masked_frac"] == pytest.approx(3 / 5)
    assert stats["rollout_corr/clipped_frac"] == 0.0


def test_sequence_masked_is_and_product_with_truncation():
    loss, stats, _ = run(mask_level="sequence", mask_low=0.5, mask_high=1.5)
    assert loss == pytest.approx(-3 / 5) and stats["rollout_corr/masked_frac"] == pytest.approx(2 / 5)
    loss, _, _ = run(is_level="token", is_cap=2.0, mask_level="sequence", mask_low=0.5, mask_high=1.5)
    assert loss == pytest.approx(-(2 + 1 + 0.25) / 5)


def test_weights_are_detached_and_need_rollout_logprobs():
    old = torch.zeros(1, 2, requires_grad=True)
    w, _ = correction_weights(old, torch.tensor([[0.0, math.log(2.0)]]), torch.ones(1, 2),
                              RolloutCorrectionConfig(is_level="token"))
    assert not w.requires_grad and w.flatten().tolist() == pytest.approx([1.0, 0.5])
    cfg = GRPOLossConfig(rollout_corr=RolloutCorrectionConfig(mask_level="token"))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), cfg)


@pytest.mark.parametrize("kwargs, field", [({"is_level": "seq"}, "is_level"), ({"mask_level": "all"}, "mask_level"),
                                           ({"is_cap": 0.0}, "is_cap"),
                                           ({"mask_low": 2.0, "mask_high": 1.0}, "mask_low")])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"grpo.rollout_corr.{field}"):
        RolloutCorrectionConfig(**kwargs)


def test_update_masks_on_trainer_logprobs(no_leftover_process_group, one_torch_thread):
    """The importance ratio is the trainer's logprob before the step over the rollout's: rollout
    logprobs 1 nat below the trainer's give ratio e on every token, a mask [0.5, 2] drops all of
    them, so the step has zero gradient and AdamW leaves the weights where they were."""
    from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate
    from splash_rollout.recipes.grpo.update import UpdateConfig, grpo_update
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.rollout.types import RolloutBatch, Sample, SampleGroup

    trainer = Trainer(MLAForCausalLM.from_config(PRESETS["glm5-nano"], seed=0), TrainerConfig(backend="torch", lr=1e-2))
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, 12], [13, 14]]
    true = trainer.logprobs(collate(prompts, responses, pad_id=2))
    samples = [Sample(p, r, (true[i, len(p) - 1:len(p) - 1 + len(r)] - 1.0).tolist(), "stop", 0)
               for i, (p, r) in enumerate(zip(prompts, responses))]
    batch = RolloutBatch([SampleGroup(0, samples)])
    before = {k: v.clone() for k, v in trainer.named_weights().items()}
    corr = RolloutCorrectionConfig(is_level="token", is_cap=10.0, mask_level="token", mask_low=0.5, mask_high=2.0)
    stats = grpo_update(trainer, batch, torch.tensor([[1.0, -1.0]]), UpdateConfig(GRPOLossConfig(rollout_corr=corr)),
                        pad_id=2, step=0)
    assert stats["rollout_corr/ratio_mean"] == pytest.approx(math.e, rel=1e-5)
    assert stats["rollout_corr/masked_frac"] == 1.0 and stats["train/logprob_diff_max"] == pytest.approx(1.0, rel=1e-5)
    assert all(torch.equal(before[k], v) for k, v in trainer.named_weights().items())
    # the same batch without correction moves the weights
    grpo_update(trainer, batch, torch.tensor([[1.0, -1.0]]), UpdateConfig(GRPOLossConfig()), pad_id=2, step=1)
    assert any(not torch.equal(before[k], v) for k, v in trainer.named_weights().items())


def test_recipe_options_reach_the_loss():
    from splash_rollout.recipes.grpo.build import loss_config
    from splash_rollout.run import compose_config

    assert not loss_config(compose_config(["+recipe=grpo_glm5"])).rollout_corr.enabled
    corr = loss_config(compose_config(["+recipe=grpo_glm5", "grpo.rollout_corr.is_level=sequence",
                                       "grpo.rollout_corr.is_cap=3"])).rollout_corr
    assert corr == RolloutCorrectionConfig(is_level="sequence", is_cap=3.0)
    with pytest.raises(ValueError, match=r"grpo.rollout_corr: unknown option\(s\) \['cap'\]"):
        loss_config(compose_config(["+recipe=grpo_glm5", "+grpo.rollout_corr.cap=3"]))
