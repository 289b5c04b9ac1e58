"""How one rank's sequences are grouped into micro-batches for the trainer's forward/backward.

A micro-batch is right-padded to its longest sequence (``trainer.collate``), so a batch that mixes a
few long responses with many short ones computes mostly padding: with RL's heavy-tailed response
lengths the padded tokens of a count-only split are 2-3x the real ones. Sequences are therefore
taken shortest first and a micro-batch is closed when one more sequence would exceed either
``max_seqs`` sequences or ``max_tokens`` padded tokens (count x longest), the token-budget batching
of verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``. A sequence longer than the budget
gets a micro-batch of its own.

With more than one rank, every rank runs the same number of micro-batches: ZeRO-2 reduces
gradients at every backward, so a rank with one backward more than another would leave the
collectives out of step. Each rank plans every rank's share (the batch is the same on all of them),
and a rank whose plan is shorter than the longest splits its micro-batches with the most padded
tokens; one with fewer sequences than micro-batches to run gets empty ones, which the caller runs
with nothing to train (a zero loss mask).

The split changes only how the gradient is accumulated, not what it is: every loss in this recipe
divides by a normaliser of the whole optimizer step (``loss.step_normalizer``), never by a
micro-batch's own size.
"""
from __future__ import annotations

from typing import Sequence


def plan_micro_batches(seq_lens: Sequence[int], max_seqs: int, max_tokens: int | None = None) -> list[list[int]]:
    """``seq_lens`` [N] (prompt + response tokens per sequence) -> indices into it, one list per
    micro-batch, shortest sequences first (ties in index order); each list holds at most ``max_seqs``
    indices and, when ``max_tokens`` is given, len(list) x its longest sequence <= ``max_tokens``
    unless the list is a single sequence. Every index appears exactly once."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs: expected >= 1, got {max_seqs}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens: expected >= 1 or None, got {max_tokens}")
    order = sorted(range(len(seq_lens)), key=lambda i: (seq_lens[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending, so the sequence being added is the longest so far
        over_tokens = max_tokens is not None and (len(current) + 1) * seq_lens[i] > max_tokens
        if current and (len(current) >= max_seqs or over_tokens):
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan


def plan_rank_micro_batches(seq_lens: Sequence[int], rank: int, world_size: int, max_seqs: int,
                            max_tokens: int | None = None) -> list[list[int]]:
    """``seq_lens`` [N] of the whole batch (the same on every rank), of which ``rank`` trains
    positions ``rank::world_size`` -> this rank's micro-batches as positions into ``seq_lens``, as
    many as the rank with the most (an empty list: a micro-batch with nothing to train)."""
    plans = []
    for r in range(world_size):
        share = list(range(r, len(seq_lens), world_size))
        plans.append([[share[j] for j in mb] for mb in
                      plan_micro_batches([seq_lens[i] for i in share], max_seqs, max_tokens)])
    count = max(len(p) for p in plans)
    own = plans[rank]
    while len(own) < count:
        splittable = [k for k, mb in enumerate(own) if len(mb) > 1]
        if not splittable:
            own.append([])
            continue
        k = max(splittable, key=lambda k: len(own[k]) * max(seq_lens[i] for i in own[k]))
        half = len(own[k]) // 2
        own[k:k + 1] = [own[k][:half], own[k][half:]]
    return own


def padded_tokens(seq_lens: Sequence[int], plan: Sequence[Sequence[int]]) -> int:
    """Tokens the trainer computes for ``plan`` (each micro-batch padded to its longest)."""
    return sum(len(mb) * max(seq_lens[i] for i in mb) for mb in plan if mb)
