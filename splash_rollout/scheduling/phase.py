"""How the prompt rows of the phase ahead arrive, and the prefill steps each layout runs them in.

The policy's phase pricing (``LayoutPolicy.phase_seconds_per_token``) compares layouts over the
horizon. What one step admits is a snapshot: a batch at its request limit admits as many prompts as
it has free slots this step -- five at one decision, one at the next -- and a layout with a large
fixed cost per prefill step looks fast on the first and slow on the second. Over a phase the queue
enters as the batch finishes: the free slots' prompts now, then one per finishing request, spread
over the horizon, in runs of short prompts (one step's budget holds them) and long ones (prefilled
in full-budget chunks). This file owns which prompts are in the phase (``prefill_in_phase``, for
the engine's driver and the simulator alike), that split (``PhasePrefill``), the runs and the queue
one phase step admits each from (``PhasePrefill.arrival_runs``; the free slots' prompts, one run
per kind, ``PhasePrefill.now_runs``), what the batch holds as each run reaches the head
(``held_at_runs``: who can take a run over), and the step shapes of layouts that prefill on owners
(``owner_capped``, ``owner_pieces``) or over a long prompt's growing context (``mid_prefill``).

Rows are query rows (tokens a step computes); counts are requests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from splash_rollout.scheduling.cost_model import StepBatch
from splash_rollout.scheduling.horizon import quantile


@dataclass(frozen=True)
class Arrivals:
    """The later prompts that arrive next, as the queue one phase step admits from."""

    prompt: np.ndarray
    """[A] int64: their prompt rows, FIFO."""
    reserved: np.ndarray
    """[A] int64: tokens each reserves."""
    token_budget: int
    """Query rows of the step that admits them (decode rows included)."""
    rows: int
    """Prompt rows of the run (``prompt.sum()``)."""
    long: bool
    """Prompts longer than one step's budget (prefilled in full-budget chunks) rather than short
    ones that arrive one per finishing request."""
    more: bool
    """Other later prompts, of the other kind, follow this run."""


@dataclass(frozen=True)
class PhasePrefill:
    """The prompt rows the phase ahead prefills, split by when they can start: ``now`` (the running
    prefills and the queue's head in the free slots) and ``later`` (the queued prompts that enter
    one per running request finishing within the horizon, after the first ``now_requests``)."""

    now_rows: int
    """Rows that can prefill from this step on: the running prefills' rest and the free slots' prompts."""
    now_requests: int = 0
    """Queued requests among ``now_rows`` (the free slots): the queue's first ``now_requests``."""
    later_rows: int = 0
    """Rows of the queued prompts that enter as running requests finish within the horizon."""
    later_requests: int = 0
    """How many of them: the queue's next ``later_requests`` after the first ``now_requests``."""

    def __post_init__(self) -> None:
        for name in ("now_rows", "now_requests", "later_rows", "later_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"PhasePrefill.{name}: expected a non-negative count, got {getattr(self, name)}")
        if (self.later_rows > 0) != (self.later_requests > 0):
            raise ValueError(f"PhasePrefill: later_rows ({self.later_rows}) and later_requests "
                             f"({self.later_requests}) must both be zero or both positive")

    @property
    def rows(self) -> int:
        return self.now_rows + self.later_rows

    def next_arrivals(self, prompt: np.ndarray, reserved: np.ndarray, token_budget: int, running: int,
                      horizon: float) -> Arrivals | None:
        """The first run of the later prompts. ``prompt``, ``reserved``: [W] the queue, FIFO;
        ``token_budget``: query rows one step may run; ``running``: decode rows beside them. The
        later prompts split, in FIFO order, into runs of one kind:

        * prompts that fit one step's budget arrive one per finish, so a step carries what arrived
          since the previous one: the run's rows over min(horizon, its count) -- at least one
          prompt's worth on average, more only when more than one finishes per step;
        * a prompt longer than that budget is prefilled in full-budget chunks however it arrives.

        None when nothing enters later."""
        if not self.later_requests:
            return None
        head = slice(self.now_requests, self.now_requests + self.later_requests)
        prompt, reserved = prompt[head], reserved[head]
        room = token_budget - running  # prefill rows one step has beside the decode rows
        if not prompt.size or room < 1:
            return None
        long = prompt > room
        change = np.flatnonzero(long != long[0])
        n = int(change[0]) if change.size else prompt.size  # the first run: the next n of the queue
        rows = int(prompt[:n].sum())
        budget = token_budget
        if not long[0]:
            per_step = math.ceil(rows / max(1.0, min(max(horizon, 1.0), float(n))))
            budget = running + min(room, per_step)
        return Arrivals(prompt[:n], reserved[:n], budget, rows, bool(long[0]), n < prompt.size)

    def now_runs(self, prompt: np.ndarray, reserved: np.ndarray, token_budget: int, running: int) -> list[Arrivals]:
        """The free slots' prompts (the queue's first ``now_requests``) in one run per kind, as
        ``next_arrivals`` tells them apart: the long ones are prefilled in full-budget chunks
        however many short ones precede them, and the short ones go in full-budget steps of their
        own -- not all at the step shape of the queue's head. They need no finishing request to
        enter, so every run is at the full ``token_budget``, and which kind comes between two
        prompts of the other does not change the steps they take: one run per kind (FIFO within
        it, the kind at the queue's head first) prices a mixed queue of thousands in two. Their
        rows are part of ``now_rows``; the rest of ``now_rows`` is the running prefills'."""
        room = token_budget - running
        prompt, reserved = prompt[: self.now_requests], reserved[: self.now_requests]
        if not prompt.size or room < 1:
            return []
        long = prompt > room
        kinds = [bool(long[0])] + ([not long[0]] if (long != long[0]).any() else [])
        return [Arrivals(prompt[long == k], reserved[long == k], token_budget, int(prompt[long == k].sum()), k,
                         i + 1 < len(kinds) or self.later_requests > 0)
                for i, k in enumerate(kinds)]

    def arrival_runs(self, prompt: np.ndarray, reserved: np.ndarray, token_budget: int, running: int,
                     horizon: float) -> list[Arrivals]:
        """Every run of the later prompts in FIFO order (``next_arrivals`` over what is left)."""
        runs, rest = [], self
        while (run := rest.next_arrivals(prompt, reserved, token_budget, running, horizon)) is not None:
            runs.append(run)
            if not run.more:
                break
            left = rest.later_requests - run.prompt.size
            rest = PhasePrefill(rest.now_rows, rest.now_requests + run.prompt.size,
                                max(rest.later_rows - run.rows, 1) if left else 0, left)
        return runs


def held_at_runs(hold: np.ndarray, now_reserved: np.ndarray, runs: list[Arrivals]) -> np.ndarray:
    """Tokens the batch is expected to hold (reserved KV over the group) when each later run reaches
    the queue's head, before it is admitted: ``hold`` ([B] what the running requests hold now) plus
    the reservations of the prompts admitted ahead of the run (``now_reserved``: [N] the free
    slots'; then every earlier run's), less what the requests that finish meanwhile free. The later
    prompts enter one per finishing request, so as many finish as later prompts enter ahead of the
    run, each freeing on average what a running request holds now. A run is handed to another
    layout only when the policy is consulted again as it reaches the head, and the switch then
    needs the destination's pool to hold this batch, not the whole pool of the layout it leaves.
    Returns [R] tokens, one per run (not capped by any pool)."""
    held = float(np.sum(hold)) + float(np.sum(now_reserved))
    mean_hold = float(np.mean(hold)) if np.size(hold) else 0.0
    out = []
    for run in runs:
        out.append(held)
        held += float(run.reserved.sum()) - run.prompt.size * mean_hold
    return np.asarray(out, dtype=np.float64)


def owner_capped(step: StepBatch, cap: int) -> tuple[StepBatch, np.ndarray]:
    """``step`` as a layout that prefills on owners runs it: each owner prefills at most ``cap`` rows
    a step, FCFS over its own prefilling requests (a chunk cut to no rows leaves the step, its
    context with it). Decode rows are untouched. Returns (the step, kept: [B] bool, which of
    ``step``'s requests it still holds)."""
    q = step.query_rows.copy()
    pre = np.flatnonzero(q > 1)
    if not pre.size:
        return step, np.ones(step.size, dtype=bool)
    used: dict[int, int] = {}
    for i in pre.tolist():
        o = int(step.owners[i])
        q[i] = min(int(q[i]), max(cap - used.get(o, 0), 0))
        used[o] = used.get(o, 0) + int(q[i])
    keep = (q > 0) | (step.query_rows <= 1)
    context = step.context - (step.query_rows - q)
    return StepBatch.make(context[keep], q[keep], step.owners[keep], step.sampling_rows, step.prefill_done), keep


def prefill_step(step: StepBatch, first: int, prompt: np.ndarray, cap: int) -> StepBatch:
    """The step a layout runs for ``step`` (its requests from position ``first`` on admitted from a
    queue whose prompt rows are ``prompt``, FIFO): cut to ``cap`` rows per owner when the layout
    prefills on owners (``cap`` > 0), then each admitted chunk at its prompt's mid-prefill context."""
    kept = np.ones(step.size, dtype=bool)
    if cap:
        step, kept = owner_capped(step, cap)
    admitted = kept[first:]
    return mid_prefill(step, int(kept[:first].sum()), prompt[: admitted.size][admitted])


def owner_pieces(prompt: np.ndarray, reserved: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Short prompts arriving one per finish overlap on different owners (one's second chunk beside
    the next one's first), so for a layout that prefills on owners a step's arrivals are pieces of
    at most ``cap`` rows spread over owners. Returns (pieces [P] int64, reserved [P] int64: each
    prompt's reservation split evenly over its pieces)."""
    n = -(-prompt // cap)  # [A] pieces per prompt
    offset = np.concatenate([np.arange(k) for k in n.tolist()]) * cap if n.size else np.zeros(0, np.int64)
    pieces = np.minimum(np.repeat(prompt, n) - offset, cap)
    return pieces.astype(np.int64), np.repeat(-(-reserved // n), n).astype(np.int64)


def mid_prefill(step: StepBatch, first: int, prompt: np.ndarray) -> StepBatch:
    """``step`` with each admitted request (positions ``first``.. of the step; ``prompt``: [A] their
    prompt rows, FIFO) at the context its chunk sees halfway through its prompt's prefill: a long
    prompt prefilled in chunks attends, on average over its chunks, to half of itself, not to its
    first chunk alone."""
    if step.size <= first:
        return step
    context = step.context.copy()
    q = step.query_rows[first:]
    context[first:] = np.maximum(context[first:], (prompt[: q.size] + q) // 2)
    return StepBatch.make(context, step.query_rows, step.owners, step.sampling_rows, step.prefill_done)


def prefill_in_phase(running_left: np.ndarray, running_residual: np.ndarray, queued_prompt: np.ndarray,
                     max_running: int, q: float) -> PhasePrefill:
    """Prompt rows the group prefills over the policy's horizon, by when they can start: now, what
    the running requests still have to prefill and the queue's head in the free slots; later, the
    prompts of the queued requests that enter one per running request that finishes within the
    horizon (its residual at most the horizon). The queue behind those waits for a later phase: a
    draining queue of thousands of prompts enters as the batch turns over, not all within the
    horizon, and not all in this step's free slots. The engine's driver and the simulator both
    describe their phase with it.

    running_left: [P] rows the running prefills have left; running_residual: [B] residual decode steps
    per running request; queued_prompt: [W] prompt rows of the queue, FCFS; max_running: most
    requests running at once; q: the horizon's quantile of the running residuals."""
    running_left, running_residual = np.asarray(running_left), np.asarray(running_residual)
    queued_prompt = np.asarray(queued_prompt, dtype=np.int64)
    horizon = quantile(running_residual, q)
    free = min(max(max_running - running_residual.size, 0), queued_prompt.size)
    later = min(int((running_residual <= horizon).sum()), queued_prompt.size - free)
    return PhasePrefill(int(running_left.sum() + queued_prompt[:free].sum()), free,
                        int(queued_prompt[free:free + later].sum()), later)
