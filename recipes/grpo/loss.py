"""GRPO objective: group-normalised advantages and the clipped, token-level policy loss.

    A_ij    = (r_ij - mean_j r_ij) / (std_j r_ij + eps)            one advantage per sample
                                                                     (or per token: process_credit.py)
    rho_ijt = exp(log pi(y_t) - log pi_rollout(y_t))                 vs the rollout's own logprobs
    L_ijt   = max(-A_ij rho_ijt, -A_ij clip(rho_ijt, 1 - eps_low, 1 + eps_high)) + beta KL_t
    loss    = sum_t mask_t L_ijt / normalizer                        token-level mean by default

std is the population std of the group (``unbiased=False``); a group whose rewards are all equal
gets zero advantages (no signal, no noise).

Aggregation (``loss_agg``), with w_i a per-sample weight and the normalizer over the whole
optimizer step (all micro-batches and ranks):

* ``token_mean``: w_i = 1, normalizer = response tokens of the step (every token counts the same);
* ``seq_mean``: w_i = 1 / |y_i|, normalizer = samples of the step (every sample counts the same);
* ``drgrpo``: w_i = 1, normalizer = samples x max_new_tokens (Dr. GRPO: a constant, so length does
  not rescale a sample's gradient; pair it with ``normalize_std=False``).

KL against a frozen reference, per token with delta = log pi - log pi_ref (``kl_estimator``):
k1 = delta, k2 = delta^2 / 2, k3 = exp(-delta) + delta - 1 (>= 0, unbiased for KL(pi || ref)).
``kl_coef * kl`` is added to the per-token loss here; as a reward penalty instead it is summed over
the response and taken off the sample's reward before advantages (``kl_penalty``). The entropy
bonus subtracts ``entropy_coef * H(pi(.|y_<t))`` per token.

Off-policy correction (``rollout_corr``, recipes/grpo/rollout_correction.py): when on, the ratio is
taken against the trainer's own logprobs before the step (``old_logprobs``) and the clipped policy
term of each token is multiplied by a detached truncated / masked importance weight of
``old_logprobs`` against the rollout's (``rollout_logprobs``); KL and entropy terms are not weighted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash_rollout.recipes.grpo.rollout_correction import RolloutCorrectionConfig, correction_weights
from splash_rollout.models.numerics import acc_dtype


@dataclass(frozen=True)
class GRPOLossConfig:
    clip_low: float = 0.2
    """eps_low: the ratio is clipped below at 1 - clip_low (for negative advantages)."""
    clip_high: float = 0.2
    """eps_high: clipped above at 1 + clip_high (for positive advantages); > clip_low is DAPO's clip-higher."""
    kl_coef: float = 0.0
    """beta; 0 disables the reference model entirely."""
    adv_eps: float = 1e-6
    normalize_std: bool = True
    """False: advantages are only mean-centred (Dr. GRPO)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean | drgrpo (see the module docstring)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3."""
    entropy_coef: float = 0.0
    """> 0 adds an entropy bonus (the trainer then computes the full-vocabulary entropy)."""
    rollout_corr: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Truncated / masked importance sampling against the rollout's logprobs (off by default)."""

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"grpo.loss_agg: expected one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"grpo.kl_estimator: expected one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"grpo.kl_coef / grpo.entropy_coef: expected >= 0, got {self.kl_coef}, {self.entropy_coef}")


LOSS_AGGS = ("token_mean", "seq_mean", "drgrpo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """[B, T] KL estimate per token of pi (``logprobs``) against the reference."""
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta * delta
    return torch.exp(-delta) + delta - 1.0


def step_normalizer(lengths: list[int], loss_agg: str, max_new_tokens: int, world_size: int) -> float:
    """What the weighted token sum of one optimizer step is divided by, per rank (gradients are
    averaged over ranks, so the global normalizer is divided by ``world_size``)."""
    if loss_agg == "token_mean":
        total = float(sum(lengths))
    elif loss_agg == "seq_mean":
        total = float(len(lengths))
    else:
        total = float(len(lengths) * max_new_tokens)
    return max(total, 1.0) / world_size


def sample_weight(length: int, loss_agg: str) -> float:
    return 1.0 / max(length, 1) if loss_agg == "seq_mean" else 1.0


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    """rewards [num_groups, n] -> advantages [num_groups, n] (float32)."""
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=-1, unbiased=False, keepdim=True) + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, vocab], targets [B, T] int64 -> log p(target) [B, T] under
    log_softmax(logits / temperature): the engine's convention, so fresh ratios are exactly 1."""
    return token_logprobs_and_entropy(logits, targets, temperature, entropy=False)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [B, T] float32, entropy of the whole distribution [B, T] float32 or None)."""
    logits = logits.to(torch.float32)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits.to(acc_dtype()), dim=-1)  # float64 under reproducible numerics
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
    if not entropy:
        return picked, None
    return picked, -(logprobs.exp() * logprobs).sum(-1).float()


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, config: GRPOLossConfig = GRPOLossConfig(),
              ref_logprobs: torch.Tensor | None = None,
              normalizer: float | None = None, weights: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None,
              rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logprobs, old_logprobs, loss_mask [B, T]; advantages [B] (per sample) or [B, T] (per token,
    process supervision); ref_logprobs [B, T] or None;
    weights [B] per-sample weights (``sample_weight``; default 1); entropy [B, T] or None;
    rollout_logprobs [B, T] or None: the engine's logprobs, required when ``config.rollout_corr``
    is on (``old_logprobs`` are then the trainer's before the step), which adds its
    ``rollout_corr/*`` stats.

    ``normalizer``: what the weighted masked token sum is divided by (default: this batch's mask
    sum); ``step_normalizer`` gives the whole optimizer step's (over micro-batches and ranks) for
    ``config.loss_agg``. Returns (loss, stats); stats are detached token means over the mask:
    ``clip_frac`` (tokens where the clipped branch was taken), ``ratio``, ``kl``, ``entropy``.
    """
    mask = loss_mask.to(logprobs.dtype)
    tokens = mask.sum().clamp(min=1.0)
    if normalizer is None:
        normalizer = tokens
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # per sample [B] or per token [B, T]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (((clipped > unclipped).to(mask.dtype) * mask).sum() / tokens).detach(),
             "ratio": ((ratio * mask).sum() / tokens).detach()}
    if config.rollout_corr.enabled:
        if rollout_logprobs is None:
            raise ValueError("grpo_loss: rollout_corr is on, so rollout_logprobs (the engine's, [B, T]) are required")
        is_weights, corr_stats = correction_weights(old_logprobs, rollout_logprobs, loss_mask, config.rollout_corr)
        per_token = per_token * is_weights.to(per_token.dtype)
        stats.update(corr_stats)
    if ref_logprobs is not None and config.kl_coef > 0:
        kl = kl_per_token(logprobs, ref_logprobs.to(logprobs.dtype), config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = ((kl * mask).sum() / tokens).detach()
    if entropy is not None:
        if config.entropy_coef > 0:
            per_token = per_token - config.entropy_coef * entropy
        stats["entropy"] = ((entropy * mask).sum() / tokens).detach()
    if weights is not None:
        mask = mask * weights.to(mask.dtype).unsqueeze(-1)
    loss = (per_token * mask).sum() / normalizer
    return loss, stats
