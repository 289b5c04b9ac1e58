"""How one rank's sequences are grouped into micro-batches for the trainer's forward/backward.

A micro-batch is right-padded to its longest sequence (``trainer.collate``), so a batch that mixes a
few long responses with many short ones computes mostly padding: with RL's heavy-tailed response
lengths the padded tokens of a count-only split are 2-3x the real ones. Sequences are therefore
taken shortest first and a micro-batch is closed when one more sequence would exceed either
``max_seqs`` sequences or ``max_tokens`` padded tokens (count x longest), the token-budget batching
of verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``. A sequence longer than the budget
gets a micro-batch of its own.

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


def padded_tokens(seq_lens: Sequence[int], plan: Sequence[Sequence[int]]) -> int:
    """Tokens the trainer computes for ``plan`` (each micro-batch padded to its longest)."""
    return sum(len(mb) * max(seq_lens[i] for i in mb) for mb in plan if mb)
