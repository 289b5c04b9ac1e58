"""Sampler: next tokens and their log-probabilities from the last-position logits, all rows at once.

Conventions (the rollout/trainer contract):

* Randomness is counter-based (``random_draws.py``): the uniform behind a sample's k-th response
  token is a pure function of (seed, k). A sample's tokens depend only on its seed and the logits it
  saw, not on what else is in the batch, the row order, or how often it was retracted and re-run;
  there is no sampler state to keep. The token is found by inverse CDF on the truncated distribution.
* The returned logprob of a sampled token is ``log_softmax(logits / temperature)[token]`` taken
  BEFORE top-k / top-p / min-p truncation, i.e. under the tempered full distribution (what a trainer
  recomputes from its own forward). With temperature 0 (greedy: argmax, no random draw) the logprob
  is under the untempered distribution ``log_softmax(logits)``.
* Truncation order: top-k (keep tokens at least as likely as the k-th), then top-p (the smallest
  prefix of the sorted top-k distribution whose mass reaches top_p; the top token is always kept),
  then min-p (drop tokens below ``min_p * p_max``). Each rule is a probability threshold, so tokens
  tied with the last kept one are kept too.
* Softmax, truncation and CDF accumulate in ``models.numerics.acc_dtype()`` (float64 under
  reproducible numerics). Under fast numerics a CPU batch without truncation takes one native call
  (``native/sample_rows.py``): the same distribution and draw, its sums taken in another order.
* Non-finite logits: a row whose tempered logits hold a NaN or +inf (or no finite value at all) is
  refused, never sampled: its token is ``NO_TOKEN`` (-1) and its logprob NaN. -inf is a mask
  (probability 0) and is fine. The engine ends such a request with
  ``finish_reason="error"`` (``Request.append_token``); the other rows of the step are unaffected.

There is no Python loop over rows: ``SamplingBatch.make`` builds the per-row tensors once per step
and ``sample`` runs batched tensor ops on ``logits.device``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from splash_rollout.engine.random_draws import to_int64, uniform
from splash_rollout.engine.request import SamplingSpec
from splash_rollout.models.numerics import acc_dtype, numerics_mode
from splash_rollout.native.sample_rows import sample_plain

NO_TOKEN = -1
"""The token of a refused row (its logits were not finite)."""
_TOP_K_CAP = 1 << 62  # any top_k beyond the vocabulary means "off"; keeps huge ints inside int64


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one step, as tensors on the logits' device."""

    temperature: torch.Tensor
    """[R] float32, 1.0 on greedy rows (their logprob is untempered)."""
    top_k: torch.Tensor
    """[R] int64, <= 0 or >= vocab: off."""
    top_p: torch.Tensor
    """[R] float64 in (0, 1]; 1: off."""
    min_p: torch.Tensor
    """[R] float64 in [0, 1]; 0: off."""
    seed: torch.Tensor
    """[R] int64, the low 64 bits of each sample's seed."""
    draw_index: torch.Tensor
    """[R] int64, the index of the response token being drawn (tokens generated so far)."""
    greedy: torch.Tensor
    """[R] bool, temperature 0: argmax, no draw."""
    sort_rows: torch.Tensor
    """[S] int64, the sampled rows with top-k or top-p on (only they need a sorted distribution)."""
    sort_width: int | None
    """Sorted prefix the ``sort_rows`` need: the largest top-k when every one of them has top-k on
    (top-p then only looks inside it), None when some row needs its whole distribution sorted."""
    truncates: bool
    """Whether any sampled row truncates at all (host-side: a plain batch skips the work)."""
    any_greedy: bool
    any_sampled: bool

    @classmethod
    def make(cls, specs: Sequence[SamplingSpec], draw_index: Sequence[int],
             device: torch.device | str = "cpu") -> "SamplingBatch":
        """specs[i], draw_index[i]: row i's settings and the number of response tokens it has so far."""
        if len(specs) != len(draw_index):
            raise ValueError(f"draw_index: expected one per spec ({len(specs)}), got {len(draw_index)}")
        greedy = [s.greedy for s in specs]
        sort_rows = [i for i, s in enumerate(specs) if not s.greedy and (s.top_k > 0 or s.top_p < 1.0)]
        widths = [min(int(specs[i].top_k), _TOP_K_CAP) for i in sort_rows]
        sampled = [not g for g in greedy]
        r = len(specs)
        # two host-to-device copies (the float and the integer settings), not eight
        reals = torch.tensor([1.0 if g else float(s.temperature) for s, g in zip(specs, greedy)]
                             + [float(s.top_p) for s in specs] + [float(s.min_p) for s in specs],
                             dtype=torch.float64).to(device).split([r, r, r])
        ints = torch.tensor([min(int(s.top_k), _TOP_K_CAP) for s in specs] + [to_int64(int(s.seed)) for s in specs]
                            + [int(k) for k in draw_index] + [int(g) for g in greedy] + sort_rows,
                            dtype=torch.int64).to(device).split([r, r, r, r, len(sort_rows)])
        return cls(
            temperature=reals[0].float(), top_k=ints[0], top_p=reals[1], min_p=reals[2], seed=ints[1],
            draw_index=ints[2], greedy=ints[3].bool(), sort_rows=ints[4],
            sort_width=max(widths) if widths and min(widths) > 0 else None,
            truncates=bool(sort_rows) or any(s.min_p > 0 for s, g in zip(specs, sampled) if g),
            any_greedy=any(greedy), any_sampled=any(sampled))

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


def truncation_threshold(probs: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """probs: [R, V] tempered probabilities -> [R] the smallest probability a kept token may have
    (top-k, then top-p over the top-k set, then min-p)."""
    dtype = probs.dtype
    p_max = probs.max(dim=-1).values  # [R]
    threshold = params.min_p.to(dtype) * p_max  # min-p; 0 where off
    rows = params.sort_rows
    if rows.numel():
        sub = probs.index_select(0, rows)  # [S, V]
        vocab = sub.shape[-1]
        width = params.sort_width
        if width is not None and width < vocab:  # the top `width` values, sorted: all top-p looks at
            sorted_p = torch.topk(sub, width, dim=-1, sorted=True).values  # [S, width]
        else:
            sorted_p = torch.sort(sub, dim=-1, descending=True).values  # [S, V]; values only: ties are equal
        vocab = sorted_p.shape[-1]
        k = params.top_k.index_select(0, rows)
        k = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
        kth = sorted_p.gather(1, (k - 1)[:, None])  # [S, 1]
        in_k = torch.where(sorted_p >= kth, sorted_p, torch.zeros_like(sorted_p))
        cum = torch.cumsum(in_k, dim=-1)
        mass_before = cum - in_k
        top_p = params.top_p.index_select(0, rows).to(dtype)[:, None]
        keep = (mass_before < top_p * cum[:, -1:]) | (top_p >= 1.0)
        keep[:, 0] = True
        keep &= in_k > 0  # a prefix of the sorted row
        last = keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1
        sorted_threshold = sorted_p.gather(1, last).squeeze(1)  # [S]
        threshold = threshold.index_copy(0, rows, torch.maximum(threshold.index_select(0, rows), sorted_threshold))
    return threshold


def truncate(probs: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """probs: [R, V] -> [R, V] unnormalised truncated probabilities (0 where cut)."""
    if not params.truncates:
        return probs
    threshold = truncation_threshold(probs, params)
    return torch.where(probs >= threshold[:, None], probs, torch.zeros_like(probs))


def usable_rows(scaled: torch.Tensor) -> torch.Tensor:
    """scaled: [R, V] tempered logits -> [R] bool: no NaN, no +inf, and at least one finite value
    (-inf is a mask: probability 0). One reduction: a row's max is NaN if it holds a NaN, +inf if it
    holds +inf, -inf if nothing is finite."""
    return torch.isfinite(scaled.amax(dim=-1))


def sample(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [R, V] -> (tokens [R] int64, logprobs [R] float32), one row per request; rows that
    ``usable_rows`` refuses get ``NO_TOKEN`` and a NaN logprob."""
    if not params.truncates and numerics_mode() == "fast":
        got = sample_plain(logits, params.temperature, uniform(params.seed, params.draw_index), params.greedy)
        if got is not None:
            return got
    return sample_torch(logits, params)


def sample_torch(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` in torch ops, every rule (the path of truncated batches, reproducible numerics and
    other devices)."""
    logits = logits.float()
    scaled = (logits / params.temperature[:, None]).to(acc_dtype())  # [R, V]; float64 under reproducible
    usable = usable_rows(scaled)  # [R]
    scaled = scaled.masked_fill(~usable[:, None], 0.0)  # refused rows: no NaN downstream (no host check)
    logprobs_all = torch.log_softmax(scaled, dim=-1)  # [R, V] acc dtype
    if params.any_sampled:
        probs = truncate(logprobs_all.exp(), params)  # [R, V]
        cdf = torch.cumsum(probs, dim=-1)  # [R, V], non-decreasing
        mass = cdf[:, -1:]  # [R, 1]
        u = (uniform(params.seed, params.draw_index)[:, None] * mass.double()).to(cdf.dtype)  # [R, 1] in [0, mass)
        drawn = torch.searchsorted(cdf, u, right=True)  # first token whose cdf exceeds u (its probability > 0)
        last_kept = torch.searchsorted(cdf, mass.contiguous(), right=False)  # first token where the cdf reaches the mass
        tokens = torch.minimum(drawn, last_kept).squeeze(1)  # u rounded up onto the mass: the last kept token
        if params.any_greedy:
            tokens = torch.where(params.greedy, torch.argmax(scaled, dim=-1), tokens)
    else:
        tokens = torch.argmax(scaled, dim=-1)
    logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1).float()
    tokens = tokens.masked_fill(~usable, NO_TOKEN)
    logprobs = logprobs.masked_fill(~usable, float("nan"))
    return tokens, logprobs
