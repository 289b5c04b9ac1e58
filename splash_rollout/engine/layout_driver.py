"""LayoutDriver: the driver's (rank 0's) choice of layout at each step boundary.

Three sources ask for a switch: ``switch_layout`` (a pending request), a ``switch_schedule``
({step: layout}, tests and benchmarks) and, with ``layout="auto"``, the scheduler's policy. The
driver prices the running batch and the queue with the policy, keeps the decisions the timeline
shows (the first, every switch, and a checkpoint each time the priced batch halves), and learns the
call's residual lengths from the samples that stopped. It only decides; the engine carries the
switch out on every rank, or reports it deferred, and then the request stays pending.
"""
from __future__ import annotations

from splash_rollout.engine.request import Request
from splash_rollout.engine.scheduler import Scheduler
from splash_rollout.layout.layouts import Layout


class LayoutDriver:
    def __init__(self, policy=None, switch_schedule: dict[int, Layout] | None = None) -> None:
        self.policy = policy
        """A scheduling.LayoutPolicy (layout="auto"), or None: the layout changes only on request."""
        self.switch_schedule = dict(switch_schedule or {})
        """Engine step -> layout to switch to at that step."""
        self.pending: tuple[Layout, bool] | None = None
        """A requested switch (destination, blocking), applied at the next boundary that allows it."""
        self.decision_log: list[dict] = []
        """The policy's decisions that chose a layout (with predicted per-layout step costs)."""
        self.ended_lengths: tuple[list[int], list[int]] = ([], [])
        """Response lengths of this call's samples that stopped (EOS / stop) and that hit their cap:
        what the policy's horizon estimate learns from (scheduling/horizon.py)."""
        self.steps_in_layout = 0
        """Steps run since the last switch (the policy's dwell)."""

    def request(self, dst: Layout, blocking: bool = False) -> None:
        self.pending = (dst, blocking)

    def new_call(self) -> None:
        """A new serve call is a new group of prompts: its own length distribution."""
        self.ended_lengths = ([], [])

    def observe_finished(self, finished: list[Request]) -> None:
        for r in finished:
            if r.finish_reason in ("stop", "length"):
                self.ended_lengths[r.finish_reason == "length"].append(r.num_output_tokens)

    def at_boundary(self, layout: Layout, step: int, scheduler: Scheduler) -> tuple[Layout, bool] | None:
        """The switch to make before ``step`` runs, or None. ``pending`` keeps it until it is done."""
        if self.policy is not None:
            self._consult_policy(layout, step, scheduler)
        want = self.pending
        if want is None and step in self.switch_schedule:
            want = self.pending = (self.switch_schedule[step], False)
        if want is None or want[0] is layout:
            self.pending = None
            return None
        return want

    def switched(self) -> None:
        self.pending = None
        self.steps_in_layout = 0

    def stepped(self) -> None:
        """A step ran in the current layout (the policy's dwell counts these)."""
        self.steps_in_layout += 1

    def _consult_policy(self, layout: Layout, step: int, scheduler: Scheduler) -> None:
        from splash_rollout.scheduling.cost_model import StepBatch
        from splash_rollout.scheduling.horizon import residual_tokens
        from splash_rollout.scheduling.policy import Waiting

        running = list(scheduler.running)
        queued = list(scheduler.waiting)[: scheduler.max_num_seqs]
        if not (running or queued) or self.pending is not None:
            return
        budget = scheduler.max_num_batched_tokens
        rows = [max(1, min(r.num_uncomputed_tokens, budget)) if r.in_prefill else 1 for r in running]
        batch = StepBatch.make([r.num_computed_tokens + q for r, q in zip(running, rows)], rows,
                               [r.owner for r in running])
        waiting = Waiting.make([r.num_uncomputed_tokens for r in queued], [r.max_total_tokens for r in queued],
                               budget, scheduler.max_num_seqs)
        remaining = residual_tokens([r.num_output_tokens for r in running + queued],
                                    [r.spec.max_new_tokens for r in running + queued], *self.ended_lengths)
        first = not self.decision_log
        decision = self.policy.decide(None if first else layout, batch, remaining, self.steps_in_layout,
                                      [r.max_total_tokens for r in running], waiting)
        # the timeline keeps the first call, every switch, and a checkpoint each time the batch the
        # policy priced has halved since the last kept one: a draining group shows, O(log B) times,
        # what each layout was predicted to cost when the policy stayed put
        priced = len(running) + decision.admitted.get(decision.chosen.value, 0)
        drained = bool(self.decision_log) and 2 * priced <= self.decision_log[-1]["priced_batch"]
        if first or decision.switch or drained:
            why = "initial" if first else "switch" if decision.switch else "drained"
            self.decision_log.append(dict(decision.to_dict(), step=step, batch_size=len(running),
                                          waiting=len(scheduler.waiting), priced_batch=priced, logged=why))
        if decision.chosen is not layout and (first or decision.switch):
            self.pending = (decision.chosen, False)
