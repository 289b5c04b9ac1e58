"""The queue's admission as the policy plans it: which queued requests a step admits, per layout.

(How much each request is expected to grow, and so how many the scheduler admits, is
scheduling/admission.py's rule; this module prices what that admission does to a step.)

The engine admits FIFO within the step's token budget and ``max_seqs``, gives each admitted request
the owner with the least projected KV, and reserves its expected total in whole pages; a layout's
pool then takes the longest prefix of that plan whose KV fits (the first that does not fit blocks
the rest). ``AdmissionPlan`` is that plan, the same for every layout; ``KVFit.admits``
(scheduling/feasibility.py) is how far a layout's pool follows it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splash_rollout.layout import Layout
from splash_rollout.layout.layouts import Ownership
from splash_rollout.scheduling.cost_model import StepBatch


def choose_owner(projected_tokens_per_rank, new_request_tokens: int = 0) -> int:
    """Owner for a new request: the rank with the least projected KV (prompt + max_new_tokens of its
    requests); ties go to the lowest rank. ``new_request_tokens`` is the same on every rank, so it
    does not change the choice; it is accepted so callers read like the rule."""
    projected = np.asarray(projected_tokens_per_rank, dtype=np.int64)
    if projected.ndim != 1 or projected.size == 0:
        raise ValueError("projected_tokens_per_rank: expected a non-empty 1-D array")
    return int(np.argmin(projected + int(new_request_tokens)))


@dataclass(frozen=True)
class Waiting:
    """Requests queued behind the running batch, in admission (FIFO) order."""

    prompt: np.ndarray
    """[W] int64: tokens each would prefill (its prompt)."""
    reserved: np.ndarray
    """[W] int64: tokens each may reach (prompt + max_new_tokens), what admission reserves."""
    token_budget: int
    """Query rows one step may run (decode rows and prefill chunks together)."""
    max_seqs: int
    """Most requests running at once."""

    @classmethod
    def make(cls, prompt, reserved, token_budget: int, max_seqs: int) -> "Waiting":
        p = np.asarray(prompt, dtype=np.int64).reshape(-1)
        r = np.asarray(reserved, dtype=np.int64).reshape(-1)
        if p.shape != r.shape:
            raise ValueError(f"reserved: expected one value per waiting request ({p.size}), got {r.size}")
        return cls(p, r, int(token_budget), int(max_seqs))


@dataclass(frozen=True)
class AdmissionPlan:
    """The queue head a step could admit, before any pool says no: FIFO within the token budget and
    ``max_seqs``, owners by least projected KV, reservations in whole pages. The same for every
    layout (none of it depends on the layout); each layout admits a prefix of it (``admits``)."""

    chunk: np.ndarray
    """[K] int64: prefill rows each candidate would run this step."""
    reserved: np.ndarray
    """[K] int64: tokens each reserves (page-rounded)."""
    owners: np.ndarray
    """[K] int64: the owner each would get."""

    @classmethod
    def make(cls, batch: StepBatch, hold: np.ndarray, waiting: Waiting | None, world_size: int,
             page_size: int = 1) -> "AdmissionPlan":
        if waiting is None or waiting.prompt.size == 0:
            return cls(*(np.zeros(0, np.int64),) * 3)
        budget = waiting.token_budget - int(batch.query_rows.sum())
        before = np.cumsum(waiting.prompt) - waiting.prompt  # [W] prompt tokens ahead of each
        k = min(int(np.count_nonzero(before < budget)), max(0, waiting.max_seqs - batch.size))
        chunk = np.minimum(waiting.prompt[:k], budget - before[:k])
        reserved = -(-waiting.reserved[:k] // page_size) * page_size
        projected = (np.bincount(batch.owners, weights=hold.astype(np.float64), minlength=world_size)[:world_size]
                     if batch.size else np.zeros(world_size)).tolist()
        owners = []
        for res in reserved.tolist():  # greedy and sequential; K is what one step's budget admits
            owner = min(range(world_size), key=projected.__getitem__)  # ties go to the lowest rank
            owners.append(owner)
            projected[owner] += res
        return cls(chunk.astype(np.int64), reserved.astype(np.int64), np.asarray(owners, dtype=np.int64))

    def admits(self, layout: Layout, hold: np.ndarray, hold_owners: np.ndarray, pool_tokens: int,
               world_size: int) -> int:
        """How many of the plan ``layout``'s pool admits: the longest prefix whose KV fits (FIFO:
        the first that does not fit blocks the rest). Vectorised over the prefixes."""
        if not self.reserved.size:
            return 0
        ownership = layout.ownership
        if ownership is Ownership.EVERY or ownership is Ownership.POSITIONS:
            demand = int(hold.sum()) + np.cumsum(self.reserved)  # [K] after admitting 1..K
            if ownership is Ownership.POSITIONS:
                demand = -(-demand // world_size)
        else:
            base = np.bincount(hold_owners, weights=hold, minlength=world_size)[:world_size] if hold.size \
                else np.zeros(world_size)
            added = np.zeros((self.reserved.size, world_size))
            added[np.arange(self.reserved.size), self.owners] = self.reserved
            demand = (base + np.cumsum(added, axis=0)).max(axis=1)  # [K] busiest owner after 1..K
        return int(np.count_nonzero(np.cumprod(demand <= pool_tokens)))

    def step(self, batch: StepBatch, hold: np.ndarray, added: int) -> tuple[StepBatch, np.ndarray]:
        """The step with the first ``added`` candidates admitted, and its reserved tokens per request."""
        if not added:
            return batch, hold
        c = self.chunk[:added]
        grown = StepBatch.make(np.concatenate([batch.context, c]), np.concatenate([batch.query_rows, c]),
                               np.concatenate([batch.owners, self.owners[:added]]),
                               None if batch.sampling_rows is None else batch.sampling_rows + added)
        return grown, np.concatenate([hold, self.reserved[:added]])


def admit(layout: Layout, batch: StepBatch, hold: np.ndarray, waiting: Waiting | None, pool_tokens: int,
          world_size: int, page_size: int = 1) -> tuple[StepBatch, np.ndarray, int]:
    """The step ``layout`` would run: ``batch`` plus the head of ``waiting`` its pool admits (FIFO,
    reservations rounded up to whole pages, owners by least projected KV, a prefill chunk each within
    the token budget). Returns (step batch, reserved tokens per request, requests admitted)."""
    hold = np.asarray(hold, dtype=np.int64)
    plan = AdmissionPlan.make(batch, hold, waiting, world_size, page_size)
    added = plan.admits(layout, hold, batch.owners, pool_tokens, world_size)
    step, reserved = plan.step(batch, hold, added)
    return step, reserved, added
