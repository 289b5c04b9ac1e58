"""Sampler: next tokens and their log-probabilities from the last-position logits.

Conventions (the rollout/trainer contract):

* Each request carries its own ``torch.Generator`` seeded by the sample's seed and draws exactly one
  uniform number per sampled token, so a sample's tokens do not depend on what else is in the batch.
  The token is found by inverse-CDF on the truncated distribution.
* The returned logprob of a sampled token is ``log_softmax(logits / temperature)[token]`` taken
  BEFORE top-k / top-p / min-p truncation, i.e. under the tempered full distribution (what a trainer
  recomputes from its own forward). With temperature 0 (greedy: argmax, no random draw) the logprob
  is under the untempered distribution ``log_softmax(logits)``.
* Truncation order: top-k, then top-p (smallest prefix of the sorted distribution whose mass reaches
  top_p; the top token is always kept), then min-p (drop tokens below ``min_p * p_max``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from splash_rollout.engine.request import SamplingSpec
from splash_rollout.models.numerics import acc_dtype


def _truncate(probs: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """probs: [V] float32 tempered probabilities → unnormalised truncated probabilities [V]."""
    vocab = probs.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(probs, spec.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if spec.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_p, 0) - sorted_p
        keep_sorted = mass_before < spec.top_p * sorted_p.sum()
        keep_sorted[0] = True
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if spec.min_p > 0.0:
        probs = torch.where(probs >= spec.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


def sample(logits: torch.Tensor, specs: Sequence[SamplingSpec],
           generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [R, V] → (tokens [R] int64, logprobs [R] float32), one row per request."""
    logits = logits.float()
    rows = logits.shape[0]
    temps = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in specs], dtype=torch.float32)
    scaled = (logits / temps[:, None]).to(acc_dtype())  # float64 under reproducible numerics
    logprobs_all = torch.log_softmax(scaled, dim=-1).float()  # [R, V]
    tokens = torch.argmax(logits, dim=-1)  # greedy rows keep this
    for i in range(rows):
        spec = specs[i]
        if spec.greedy:
            continue
        probs = _truncate(logprobs_all[i].exp(), spec)
        cdf = torch.cumsum(probs, 0)
        u = torch.rand((), generator=generators[i], dtype=torch.float64).item() * cdf[-1].item()
        tok = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).item())
        tok = min(tok, probs.shape[0] - 1)
        while probs[tok] <= 0:  # u landed on a float edge: step back to a kept token
            tok -= 1
        tokens[i] = tok
    logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
