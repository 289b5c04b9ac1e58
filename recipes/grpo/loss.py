"""GRPO objective: group-normalised advantages and the clipped, token-level policy loss.

    A_ij    = (r_ij - mean_j r_ij) / (std_j r_ij + eps)            one advantage per sample
    rho_ijt = exp(log pi(y_t) - log pi_rollout(y_t))                 vs the rollout's own logprobs
    L_ijt   = max(-A_ij rho_ijt, -A_ij clip(rho_ijt, 1 - eps_low, 1 + eps_high)) + beta KL_t
    loss    = sum_t mask_t L_ijt / normalizer                        token-level mean by default

std is the population std of the group (``unbiased=False``); a group whose rewards are all equal
gets zero advantages (no signal, no noise). KL is the k3 estimator against a frozen reference,
``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased for KL(pi || ref)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    logits = logits.to(torch.float32)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits.to(acc_dtype()), dim=-1)  # float64 under reproducible numerics
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, config: GRPOLossConfig = GRPOLossConfig(),
              ref_logprobs: torch.Tensor | None = None,
              normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logprobs, old_logprobs, loss_mask [B, T]; advantages [B]; ref_logprobs [B, T] or None.

    ``normalizer``: what the masked token sum is divided by (default: this batch's mask sum). Pass
    the token count of the whole optimizer step (over micro-batches and ranks) to make the loss a
    token mean of the global batch. Returns (loss, stats); stats are detached token means over the
    mask: ``clip_frac`` (tokens where the clipped branch was taken), ``ratio``, ``kl``.
    """
    mask = loss_mask.to(logprobs.dtype)
    tokens = mask.sum().clamp(min=1.0)
    if normalizer is None:
        normalizer = tokens
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (((clipped > unclipped).to(mask.dtype) * mask).sum() / tokens).detach(),
             "ratio": ((ratio * mask).sum() / tokens).detach()}
    if ref_logprobs is not None and config.kl_coef > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = ((kl * mask).sum() / tokens).detach()
    loss = (per_token * mask).sum() / normalizer
    return loss, stats
