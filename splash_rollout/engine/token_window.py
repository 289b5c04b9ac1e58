"""Token windows: DP-attention ranks decode several steps between two meetings.

Under DP-attention a rank's next step reads only the tokens it sampled itself: its rows are its own
requests'. What the ranks must still agree on each step is the scheduler replica, and that moves
deterministically while nothing joins or leaves the batch -- every running request gains one row,
one position and, now and then, one page. So a window of K steps needs one control message before
it and one all-gather of the K x (requests) sampled tokens after it, instead of K of each: a rank
that a slow stretch of the machine holds back for a step no longer holds every other rank back
with it, the ranks only wait for each other once per window.

Inside a window every replica appends a *provisional* token to each request each step: the real one
on the request's owner (it is the next step's input there), a stand-in elsewhere. Nothing finishes
inside a window: a request that samples a stop token keeps decoding on its owner, and when the
window closes every replica takes the K provisional tokens back and appends the gathered real ones
one by one under the usual rule, so a request that stopped at step j < K ends there (its later rows
were computed and are dropped). Tokens, logprobs and finish reasons are those of exchanging after
every step; the sampler's draws are keyed by position, not by step.

A window opens only where nothing but a stop could change the batch before it closes
(``window_steps``, the one owner of that rule): the ranks carry their own rows between blocks
(``AttentionExecutor.inputs_stay_local``), every running request is a plain one-row decode and all
of them fit one step's token budget, nothing waits in the queue (no admission), no drafts are
verified, no switch is pending or scheduled inside it, no request reaches its length cap before
its last step, and every rank has the pages the window's growth takes (no retraction).
"""
from __future__ import annotations

from splash_rollout.engine.request_scheduler import ScheduledSeq, Scheduler


def window_steps(most: int, scheduler: Scheduler, steps_left: int | None, quiet_steps: int | None) -> int:
    """Steps the next window may run, at most ``most`` (1: the ranks meet after the step, as always).

    steps_left: steps the serve call may still run (None: no limit); quiet_steps: steps from now the
    layout driver will not switch in (None: no switch scheduled)."""
    k = min(x for x in (most, steps_left, quiet_steps) if x is not None)
    running = scheduler.running
    if k <= 1 or scheduler.waiting or not running or len(running) > scheduler.max_num_batched_tokens:
        return 1
    for req in running:
        if req.fork_of is not None or req.forks or req.num_uncomputed_tokens != 1:
            return 1  # a follower, a leader with followers, a prefill or a re-prefill: the batch changes
        k = min(k, req.max_total_tokens - req.num_tokens)  # a length cap ends the window, never crosses it
    while k > 1 and not _pages_last(scheduler, k):
        k -= 1
    return max(k, 1)


def _pages_last(scheduler: Scheduler, steps: int) -> bool:
    """Whether every rank has the pages ``steps`` decode steps of the running batch take."""
    placement = scheduler.placement
    free = placement.pages_free
    most_per_request = -(-steps // placement.page_size) + 1
    if min(free) >= most_per_request * len(scheduler.running):
        return True  # O(1): no request can take more
    need = [0] * placement.world_size
    for req in scheduler.running:
        need = [a + b for a, b in zip(need, placement.growth(req, req.num_computed_tokens + steps))]
    return all(n <= f for n, f in zip(need, free))


class TokenWindow:
    """One rank's window: its own sampled tokens of each step, kept until the window closes."""

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"TokenWindow: expected at least one step, got {steps}")
        self.steps = steps
        self.done = 0
        """Steps of the window run so far."""
        self.width: int | None = None
        """Tokens every step of the window samples (set by its first step)."""
        self._tokens: list[list[int]] = []
        self._logprobs: list[list[float]] = []

    @classmethod
    def closed(cls) -> "TokenWindow":
        """A window already over: the ranks meet before the next step."""
        window = cls(1)
        window.done = 1
        return window

    @property
    def is_over(self) -> bool:
        """Whether every step of the window has run (the ranks meet before the next one)."""
        return self.done == self.steps

    def check_step(self, scheduled: list[ScheduledSeq], retracted: bool) -> None:
        """Inside a window every step is the same one-row decode of the same requests: anything else
        means the replicas could no longer agree without a meeting, so it is refused loudly."""
        if self.steps == 1:
            return
        if self.width is None:
            self.width = len(scheduled)
        if (len(scheduled) != self.width or retracted
                or any(s.num_new != 1 or s.draft or s.forks or not s.samples for s in scheduled)):
            raise RuntimeError(f"token window: step {self.done + 1} of {self.steps} changed the batch "
                               f"({len(scheduled)} scheduled, {self.width} expected; retracted: {retracted}); "
                               f"window_steps let a window open that the scheduler did not keep")

    def hold(self, tokens: list[int], logprobs: list[float]) -> None:
        """This rank's tokens [s] and logprobs [s] of the step just sampled (host)."""
        self._tokens.append(tokens)
        self._logprobs.append(logprobs)
        self.done += 1

    def held(self) -> tuple[list[list[int]], list[list[float]]]:
        """Everything this rank sampled in the window: tokens [K][s], logprobs [K][s]."""
        return self._tokens, self._logprobs


def provisional(sample_rank: list[int], rank: int, tokens: list[int],
                logprobs: list[float]) -> tuple[list[int], list[float]]:
    """A step's [S] tokens and logprobs as this replica knows them inside a window: its own rows
    (``sample_rank`` == rank) real, the others' a stand-in (token 0, logprob 0) until it closes."""
    mine_tokens, mine_logprobs = iter(tokens), iter(logprobs)
    full_tokens = [next(mine_tokens) if r == rank else 0 for r in sample_rank]
    full_logprobs = [next(mine_logprobs) if r == rank else 0.0 for r in sample_rank]
    return full_tokens, full_logprobs
