"""LayoutDriver: the driver's (rank 0's) choice of layout at each step boundary.

Three sources ask for a switch: ``switch_layout`` (a pending request), a ``switch_schedule``
({step: layout}, tests and benchmarks) and, with ``layout="auto"``, the scheduler's policy. The
driver prices the running batch and the queue with the policy (and, when the next step would have
to retract requests for lack of KV pages, a switch against that retraction), keeps the decisions the timeline
shows (the first, every switch, and a checkpoint each time the priced batch halves), and learns the
call's residual lengths from the samples that stopped. It only decides; the engine carries the
switch out on every rank, or reports it deferred, and then the request stays pending.
"""
from __future__ import annotations

import itertools

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
        self.pending_cause: str | None = None
        """Why ``pending`` was asked for: request, schedule, policy or pressure (the switch log keeps it)."""

    def request(self, dst: Layout, blocking: bool = False) -> None:
        self.pending, self.pending_cause = (dst, blocking), "request"

    def new_call(self) -> None:
        """A new serve call is a new group of prompts: its own length distribution."""
        self.ended_lengths = ([], [])

    def observe_finished(self, finished: list[Request]) -> None:
        for r in finished:
            if r.finish_reason in ("stop", "length"):
                self.ended_lengths[r.finish_reason == "length"].append(r.num_output_tokens)

    def at_boundary(self, layout: Layout, step: int, scheduler: Scheduler) -> tuple[Layout, bool] | None:
        """The switch to make before ``step`` runs, or None. ``pending`` keeps it until it is done."""
        if self.policy is not None and self.pending is None:
            if not self._relieve_pressure(layout, step, scheduler):
                self._consult_policy(layout, step, scheduler)
        want = self.pending
        if want is None and step in self.switch_schedule:
            want = self.pending = (self.switch_schedule[step], False)
            self.pending_cause = "schedule"
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

    # ---- what the policy is shown ----------------------------------------------------------------
    @staticmethod
    def _priced(scheduler: Scheduler) -> list[Request]:
        """The running requests that compute (a follower waiting for its leader's prompt does not)."""
        return [r for r in scheduler.running if r.fork_of is None]

    @staticmethod
    def _step_batch(scheduler: Scheduler, running: list[Request]):
        from splash_rollout.scheduling.cost_model import StepBatch

        budget = scheduler.max_num_batched_tokens
        rows = [max(1, min(r.num_uncomputed_tokens, budget)) if r.in_prefill else 1 for r in running]
        return StepBatch.make([r.num_computed_tokens + q for r, q in zip(running, rows)], rows,
                              [r.owner for r in running])

    @staticmethod
    def _hold(scheduler: Scheduler, requests: list[Request]) -> list[int]:
        """[B] KV tokens each request is expected to reach (admission's estimate), a prompt that
        several samples share counted once."""
        ps = scheduler.placement.page_size
        return [scheduler.expected_total(r) - r.num_shared_pages * ps for r in requests]

    def _remaining(self, requests: list[Request]):
        from splash_rollout.scheduling.horizon import residual_tokens

        return residual_tokens([r.num_output_tokens for r in requests], [r.spec.max_new_tokens for r in requests],
                               *self.ended_lengths)

    def _relieve_pressure(self, layout: Layout, step: int, scheduler: Scheduler) -> bool:
        """When the next step would have to retract: let the policy price a switch against it.
        Returns whether the boundary was a pressure one (the regular consult is skipped then)."""
        short, victims = scheduler.pressure()
        if not victims:
            return False
        running = self._priced(scheduler)
        decision = self.policy.relieve_pressure(
            layout, self._step_batch(scheduler, running), self._remaining(running), self._hold(scheduler, running),
            short, [running.index(v) for v in victims])
        last = self.decision_log[-1] if self.decision_log else {}
        if decision.switch or last.get("logged") != "pressure":
            self.decision_log.append(dict(decision.to_dict(), step=step, batch_size=len(scheduler.running),
                                          waiting=len(scheduler.waiting), priced_batch=len(running),
                                          logged="pressure"))
        if decision.switch:
            self.pending, self.pending_cause = (decision.chosen, False), "pressure"
        return True

    def _consult_policy(self, layout: Layout, step: int, scheduler: Scheduler) -> None:
        from splash_rollout.scheduling.policy import Waiting

        running = self._priced(scheduler)
        queued = list(itertools.islice(scheduler.waiting, scheduler.max_num_seqs))
        if not (running or queued):
            return
        batch = self._step_batch(scheduler, running)
        waiting = Waiting.make([r.num_uncomputed_tokens for r in queued], self._hold(scheduler, queued),
                               scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        first = not self.decision_log
        decision = self.policy.decide(None if first else layout, batch, self._remaining(running + queued),
                                      self.steps_in_layout, self._hold(scheduler, running), waiting)
        # the timeline keeps the first call, every switch, and a checkpoint each time the batch the
        # policy priced has halved since the last kept one: a draining group shows, O(log B) times,
        # what each layout was predicted to cost when the policy stayed put
        priced = len(running) + decision.admitted.get(decision.chosen.value, 0)
        drained = bool(self.decision_log) and 2 * priced <= self.decision_log[-1]["priced_batch"]
        if first or decision.switch or drained:
            why = "initial" if first else "switch" if decision.switch else "drained"
            self.decision_log.append(dict(decision.to_dict(), step=step, batch_size=len(scheduler.running),
                                          waiting=len(scheduler.waiting), priced_batch=priced, logged=why))
        if decision.chosen is not layout and (first or decision.switch):
            self.pending, self.pending_cause = (decision.chosen, False), "policy"
