"""Off-policy correction: weights for the gap between the rollout policy and the trainer's.

The engine samples with its own kernels (``numerics=fast``: float32 rounding that differs from the
trainer's; a stale weight version; a routing flip in a MoE layer), so the rollout's logprob of a
token, ``lp_rollout``, is not the trainer's ``lp_old`` for the same weights. The PPO ratio is then
taken against ``lp_old`` (recomputed by the trainer before the step), and each token's loss is
multiplied by a detached importance weight built from

    r_t   = exp(lp_old_t - lp_rollout_t)                        token level
    R_i   = exp(sum_t mask_t (lp_old_t - lp_rollout_t))         sequence level (one per sample)

* truncated IS (``is_level`` token | sequence): w = min(r, is_cap) -- the token's (or the whole
  sample's) ratio capped at C, so a token the rollout policy made unlikely cannot blow up the step;
* masked IS (``mask_level`` token | sequence): w = 0 where the ratio leaves [mask_low, mask_high]
  (the token, or every token of a sample whose R leaves it), 1 elsewhere.

Both may be on; the weights multiply. Off (``"none"``) by default: then the loss is exactly the
plain GRPO loss against the rollout's logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = ("none", "token", "sequence")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    is_level: str = "none"
    """Truncated importance sampling: none | token | sequence."""
    is_cap: float = 2.0
    """C: the importance weight is min(ratio, C)."""
    mask_level: str = "none"
    """Masked importance sampling: none | token | sequence."""
    mask_low: float = 0.5
    """Ratios below this get weight 0 (masked)."""
    mask_high: float = 2.0
    """Ratios above this get weight 0 (masked)."""

    def __post_init__(self) -> None:
        for name in ("is_level", "mask_level"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(f"grpo.rollout_corr.{name}: expected one of {LEVELS}, got {getattr(self, name)!r}")
        if not self.is_cap > 0:
            raise ValueError(f"grpo.rollout_corr.is_cap: expected > 0, got {self.is_cap}")
        if not 0 <= self.mask_low < self.mask_high:
            raise ValueError(f"grpo.rollout_corr.mask_low / mask_high: expected 0 <= low < high, "
                             f"got {self.mask_low}, {self.mask_high}")

    @property
    def enabled(self) -> bool:
        return self.is_level != "none" or self.mask_level != "none"


def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                       config: RolloutCorrectionConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """old_logprobs (trainer, before the step), rollout_logprobs, loss_mask: [B, T] ->
    (weights [B, T] float32, detached; stats under ``rollout_corr/``).

    Stats are over the masked tokens (sequence level: over the samples with a trained token):
    ``ratio_mean`` / ``ratio_max`` of the token ratio r, ``seq_ratio_mean`` / ``seq_ratio_max`` of R,
    ``clipped_frac`` (tokens whose IS weight hit the cap), ``masked_frac`` (tokens given weight 0)."""
    mask = loss_mask.to(torch.float32)
    log_r = (old_logprobs.detach().to(torch.float64) - rollout_logprobs.to(torch.float64)) * mask
    ratio = torch.exp(log_r)                                    # [B, T] float64; 1 on padding
    seq_ratio = torch.exp(log_r.sum(-1, keepdim=True))          # [B, 1]
    weights = torch.ones_like(ratio)
    tokens = mask.sum().clamp(min=1.0)
    clipped = torch.zeros_like(ratio)
    if config.is_level != "none":
        r = ratio if config.is_level == "token" else seq_ratio.expand_as(ratio)
        clipped = (r > config.is_cap).to(ratio.dtype)
        weights = weights * r.clamp(max=config.is_cap)
    kept = torch.ones_like(ratio)
    if config.mask_level != "none":
        r = ratio if config.mask_level == "token" else seq_ratio.expand_as(ratio)
        kept = ((r >= config.mask_low) & (r <= config.mask_high)).to(ratio.dtype)
        weights = weights * kept
    has_tokens = mask.sum(-1) > 0
    seq = seq_ratio.squeeze(-1)[has_tokens]
    on = mask > 0
    stats = {"rollout_corr/ratio_mean": (ratio * mask).sum() / tokens,
             "rollout_corr/ratio_max": ratio[on].max() if on.any() else torch.ones((), dtype=ratio.dtype),
             "rollout_corr/seq_ratio_mean": seq.mean() if seq.numel() else torch.ones((), dtype=ratio.dtype),
             "rollout_corr/seq_ratio_max": seq.max() if seq.numel() else torch.ones((), dtype=ratio.dtype),
             "rollout_corr/clipped_frac": (clipped * mask).sum() / tokens,
             "rollout_corr/masked_frac": ((1.0 - kept) * mask).sum() / tokens}
    return weights.to(torch.float32).detach(), {k: v.detach().float() for k, v in stats.items()}
