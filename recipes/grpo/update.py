"""One GRPO update: rewards shaped into advantages, then optimizer steps over the rollout batch.

    rewards   -= overlong_penalty * [finish_reason == "length"]     (grpo.overlong=penalty)
    rewards   -= kl_coef * sum_t KL_t(rollout || reference)          (grpo.kl_in=reward)
    advantages = group_advantages(rewards)
    for each minibatch (seeded shuffle when grpo.shuffle_minibatches):
        trainer.optimizer_step(this rank's micro-batches, grpo_loss)

Overlong samples under ``grpo.overlong=mask`` keep their reward in the group but train no token.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from splash_rollout.recipes.grpo.loss import GRPOLossConfig, grpo_loss, kl_per_token, sample_weight, step_normalizer, token_logprobs
from splash_rollout.recipes.grpo.micro_batches import plan_micro_batches, plan_rank_micro_batches
from splash_rollout.recipes.grpo.routing_replay import replay_table
from splash_rollout.recipes.grpo.trainer import Trainer, collate
from splash_rollout.rollout.types import RolloutBatch, Sample


@dataclass(frozen=True)
class UpdateConfig:
    loss: GRPOLossConfig
    minibatches: int = 1
    micro_batch_size: int = 32
    micro_batch_tokens: int | None = None
    """Padded tokens per micro-batch (count x longest sequence; None: ``micro_batch_size`` alone)."""
    max_new_tokens: int = 1
    """Dr. GRPO's constant normalizer."""
    overlong: str = "keep"
    """keep | mask (no loss on truncated samples) | penalty (reward -= overlong_penalty)."""
    overlong_penalty: float = 1.0
    kl_in: str = "loss"
    """loss (kl_coef * KL per token in the loss) | reward (summed KL taken off the reward)."""
    shuffle_minibatches: bool = False
    seed: int = 0
    routing_replay: bool = False
    """Replay the rollout's routed experts in every trainer forward (samples must carry ``routing``)."""


def _response_mask(s: Sample, overlong: str) -> list[int]:
    return [0] * len(s.response_ids) if overlong == "mask" and s.finish_reason == "length" else s.loss_mask


def _seq_len(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.response_ids)


def reference_logprobs(ref_model: torch.nn.Module, samples: list[Sample], pad_id: int, micro_batch_size: int,
                       temperature: float, device: torch.device,
                       micro_batch_tokens: int | None = None) -> list[torch.Tensor]:
    """Per sample (in ``samples`` order), [num_response_tokens] float32 log p_ref of its response tokens."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for ids in plan_micro_batches([_seq_len(s) for s in samples], micro_batch_size, micro_batch_tokens):
        chunk = [samples[i] for i in ids]
        mb = collate([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], pad_id)
        with torch.no_grad():
            logits = ref_model(mb.input_ids.to(device), mb.attention_mask.to(device))[:, :-1]
            lp = token_logprobs(logits, mb.targets.to(device), temperature).cpu()
        for row, (i, s) in enumerate(zip(ids, chunk)):
            start = len(s.prompt_ids) - 1
            out[i] = lp[row, start:start + len(s.response_ids)]
    return out


def shape_rewards(rewards: torch.Tensor, batch: RolloutBatch, config: UpdateConfig,
                  ref_logprobs: list[torch.Tensor] | None) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards [num_groups, n] -> (shaped rewards [num_groups, n], stats)."""
    samples = batch.samples
    shaped = rewards.clone().flatten()
    stats: dict[str, float] = {}
    if config.overlong == "penalty":
        hit = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.float32)
        shaped -= config.overlong_penalty * hit
    if config.kl_in == "reward" and ref_logprobs is not None and config.loss.kl_coef > 0:
        kl = torch.stack([kl_per_token(torch.tensor(s.response_logprobs, dtype=torch.float32), r,
                                       config.loss.kl_estimator).sum() for s, r in zip(samples, ref_logprobs)])
        shaped -= config.loss.kl_coef * kl
        stats["train/kl_reward"] = float(kl.mean())
    return shaped.view_as(rewards), stats


def grpo_update(trainer: Trainer, batch: RolloutBatch, advantages: torch.Tensor | list[list[float]],
                config: UpdateConfig, pad_id: int, step: int, ref_model: torch.nn.Module | None = None,
                policy_version: int | None = None, mtp=None) -> dict[str, float]:
    """``config.minibatches`` optimizer steps over the rollout batch; this rank trains on samples
    ``rank::world`` of each minibatch. ``advantages``: [num_groups, n] per sample, or per sample
    (group order) a [num_response_tokens] list (process supervision). ``policy_version``: the weight
    version being trained; tokens sampled under an older one (partial rollout) carry their own
    policy's logprobs, which the ratio (and the off-policy correction) is taken against, and are left
    out of ``train/logprob_diff_max`` (a check of the engine against the trainer on the same weights).
    ``mtp``: the ``MTPTrainer`` whose module trains on the same forward passes (mtp_training.py)."""
    samples = batch.samples
    per_token_adv = isinstance(advantages, list)  # process supervision: a list per sample
    adv = advantages if per_token_adv else advantages.flatten().tolist()
    order = list(range(len(samples)))
    if config.shuffle_minibatches:
        random.Random(config.seed * 1_000_033 + step).shuffle(order)
    per_mb = -(-len(order) // config.minibatches)
    loss_cfg = config.loss
    kl_in_loss = ref_model is not None and config.kl_in == "loss"
    masks = [_response_mask(s, config.overlong) for s in samples]
    minibatches: list[tuple[float, list]] = []
    for m in range(config.minibatches):
        idx = order[m * per_mb:(m + 1) * per_mb]
        trained = [i for i in idx if sum(masks[i])]
        normalizer = step_normalizer([sum(masks[i]) for i in trained], loss_cfg.loss_agg, config.max_new_tokens,
                                     trainer.world_size)
        micro = []
        for plan in plan_rank_micro_batches([_seq_len(samples[i]) for i in idx], trainer.rank, trainer.world_size,
                                            config.micro_batch_size, config.micro_batch_tokens):
            # an empty plan (this rank has fewer samples than another has micro-batches) runs a
            # sample with nothing to train, so every rank makes the same number of backward passes
            ids = [idx[j] for j in plan] or idx[:1]
            chunk = [samples[i] for i in ids]
            per_sample = {} if per_token_adv else {"advantages": [adv[i] if plan else 0.0 for i in ids]}
            if loss_cfg.loss_agg == "seq_mean":
                per_sample["weights"] = [sample_weight(sum(masks[i]), "seq_mean") for i in ids]
            mb = collate([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], pad_id,
                         response_mask=[masks[i] if plan else [0] * len(masks[i]) for i in ids],
                         per_token={"old_logprobs": [s.response_logprobs for s in chunk],
                                    "on_policy": [[float(v == policy_version) for v in s.versions] if
                                                  policy_version is not None else [1.0] * len(s.response_ids)
                                                  for s in chunk],
                                    **({"advantages": [adv[i] if plan else [0.0] * len(samples[i].response_ids)
                                                       for i in ids]} if per_token_adv else {})},
                         per_sample=per_sample)
            if config.routing_replay:
                mb.extras["routing"], mb.extras["routing_replayed"] = replay_table(chunk, mb.input_ids.shape[1])
            if kl_in_loss:
                with torch.no_grad():
                    dev = trainer.device
                    logits = ref_model(mb.input_ids.to(dev), mb.attention_mask.to(dev))[:, :-1]
                    mb.extras["ref_logprobs"] = token_logprobs(logits, mb.targets.to(dev), trainer.temperature).cpu()
            micro.append(mb)
        minibatches.append((normalizer, micro))
    if loss_cfg.rollout_corr.enabled:
        # the ratio is against the trainer's own logprobs before this step's first update; the
        # engine's become the importance weights' denominator
        for _, micro in minibatches:
            for mb in micro:
                mb.extras["rollout_logprobs"] = mb.extras["old_logprobs"]
                mb.extras["old_logprobs"] = trainer.logprobs(mb).detach().float().cpu()

    stats_all: list[dict[str, float]] = []
    for normalizer, micro in minibatches:
        def loss_fn(logprobs, mb, entropy=None, normalizer=normalizer):
            mask = mb.loss_mask
            rollout = mb.extras.get("rollout_logprobs")
            loss, stats = grpo_loss(logprobs, mb.extras["old_logprobs"], mb.extras["advantages"], mask, loss_cfg,
                                    mb.extras.get("ref_logprobs"), normalizer=normalizer,
                                    weights=mb.extras.get("weights"), entropy=entropy, rollout_logprobs=rollout)
            # rollout vs trainer logprobs of the same tokens (weights equal before the first step)
            engine_lp = rollout if rollout is not None else mb.extras["old_logprobs"]
            stats["logprob_diff_max"] = ((logprobs - engine_lp).abs() * mask * mb.extras["on_policy"]).max().detach()
            return loss, stats

        stats_all.append(trainer.optimizer_step(micro, loss_fn, entropy=loss_cfg.entropy_coef > 0, mtp=mtp))
    corr = sorted({k for s_ in stats_all for k in s_ if k.startswith(("rollout_corr/", "mtp/"))})
    out = {f"train/{k}": float(np.mean([s[k] for s in stats_all])) for k in stats_all[0]
           if k in stats_all[-1] and k not in corr}
    for k in corr:  # rollout_corr/* and mtp/* keep their own prefix; maxima stay maxima over the minibatches
        values = [s_[k] for s_ in stats_all if k in s_]
        out[k] = float(np.max(values) if k.endswith("_max") else np.mean(values))
    out["train/logprob_diff_max"] = stats_all[0]["logprob_diff_max"]  # on-policy pass: must be ~0
    out["train/trained_samples"] = float(sum(1 for m in masks if sum(m)))
    return out
