"""A trainer step changes the weights in place; what a no-grad forward reads afterwards must be the new
weights, whatever copies of them the fast-numerics products keep."""
from __future__ import annotations

import torch

from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate

CFG = PRESETS["glm5-nano"]
PROMPTS = [[5 + i, 6, 7] for i in range(6)]
RESPONSES = [[(11 * i + 3 * k) % 40 + 20 for k in range(12)] for i in range(6)]


def _nll(logprobs, mb):
    return -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum(), {}


def test_after_a_deepspeed_step_a_no_grad_forward_reads_the_new_weights(one_torch_thread, no_leftover_process_group):
    """ZeRO writes the stepped weights back through ``.data`` (no version bump): the oneDNN-packed
    copies a fast-numerics no-grad forward (``Trainer.logprobs``) reads must not outlive the step."""
    from splash_rollout.recipes.grpo.loss import token_logprobs

    batch = collate(PROMPTS, RESPONSES, pad_id=0)
    trainer = Trainer(MLAForCausalLM.from_config(CFG, seed=1), TrainerConfig(backend="deepspeed", lr=1e-2))
    trainer.logprobs(batch)  # packs the weights
    trainer.optimizer_step([batch], _nll)
    fresh = MLAForCausalLM.from_config(CFG, seed=1)
    fresh.load_state_dict(trainer.named_weights())
    with torch.no_grad():
        want = token_logprobs(fresh(batch.input_ids, batch.attention_mask)[:, :-1], batch.targets, 1.0)
    assert torch.equal(trainer.logprobs(batch), want)
