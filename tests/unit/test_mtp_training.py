"""The MTP module trained beside the policy: it learns on the policy's own forward (its loss falls, its
drafts are kept more often) while the policy trains exactly as it would without it, and its coupled
acceptance uses the engine's own draws (a perfect draft model is kept every time)."""
from __future__ import annotations

import torch

from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.engine.mtp_drafter import coupled_drafts
from splash_rollout.recipes.grpo.mtp_training import MTPTrainer, MTPTrainingConfig
from splash_rollout.recipes.grpo.trainer import Trainer, TrainerConfig, collate

CFG = PRESETS["glm5-nano"]
PROMPTS = [[5 + i, 6, 7] for i in range(6)]
RESPONSES = [[(11 * i + 3 * k) % 40 + 20 for k in range(12)] for i in range(6)]  # a pattern two ahead can learn


def _split(model):
    mtp = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.mtp_layers.")}
    rest = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("model.mtp_layers.")}
    return mtp, rest


def _nll(logprobs, mb):
    return -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum(), {}


def test_the_module_learns_on_the_policys_forward_and_the_policy_trains_as_without_it(
        one_torch_thread, no_leftover_process_group):
    batch = collate(PROMPTS, RESPONSES, pad_id=0)
    plain = Trainer(MLAForCausalLM.from_config(CFG, seed=1), TrainerConfig(backend="torch", lr=1e-3))
    trainer = Trainer(MLAForCausalLM.from_config(CFG, seed=1), TrainerConfig(backend="torch", lr=1e-3))
    mtp = MTPTrainer(trainer.model, MTPTrainingConfig(lr=3e-3))
    mtp.freeze_baseline()
    first = mtp.measure(PROMPTS, RESPONSES, pad_id=0)
    mtp_before, _ = _split(trainer.model)
    losses = []
    for _ in range(30):
        want = plain.optimizer_step([batch], _nll)
        got = trainer.optimizer_step([batch], _nll, mtp=mtp)
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
        losses.append(got["mtp/loss"])
    _, policy = _split(trainer.model)
    _, policy_plain = _split(plain.model)
    assert all(torch.equal(policy_plain[n], p) for n, p in policy.items())  # token for token as without it
    last = mtp.measure(PROMPTS, RESPONSES, pad_id=0)
    assert losses[-1] < 0.6 * losses[0], losses
    assert last["mtp/accept_top1"] > first["mtp/accept_top1"] + 0.3, (first, last)
    frozen = {f"model.mtp_layers.{n}": p for n, p in mtp.frozen.named_parameters()}
    assert all(torch.equal(mtp_before[n], p) for n, p in frozen.items())  # the frozen copy stayed put
    assert "mtp_frozen/accept_top1" in last
    mtp_after, _ = _split(trainer.model)
    assert not all(torch.equal(mtp_before[n], p) for n, p in mtp_after.items())
    trainer.optimizer_step([batch], _nll)  # without it: the module is left alone
    assert all(torch.equal(mtp_after[n], p) for n, p in _split(trainer.model)[0].items())


def test_a_perfect_draft_model_is_kept_every_time_under_coupling(one_torch_thread):
    """Coupled drafts drawn from the policy's own logits with each sample's uniform are the sampled
    tokens: the draw index and the sampler are the engine's."""
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    config = EngineConfig(model="glm5-nano", compute={"numerics": "reproducible", "speculation": "off"},
                          memory={"num_pages": 64, "page_size": 16})
    with RolloutEngine(config) as engine:
        batch = engine.generate(PROMPTS[:3], SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=10,
                                                            ignore_eos=True, seed=4))
        model = engine.model
        for s in batch.samples:
            with torch.no_grad():
                logits = model(torch.tensor([s.prompt_ids + s.response_ids]))[0]
            p = len(s.prompt_ids)
            rows = logits[p - 1: p - 1 + len(s.response_ids)]  # row k draws response token k
            got = coupled_drafts(rows, [s.spec] * len(rows), list(range(len(rows))))
            assert got.tolist() == s.response_ids

