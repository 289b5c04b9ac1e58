"""LayoutDriver: the driver's (rank 0's) choice of layout at each step boundary.

Three sources ask for a switch: ``switch_layout`` (a pending request), a ``switch_schedule``
({step: layout}, tests and benchmarks) and, with ``layout="auto"``, the scheduler's policy. The
driver prices the running batch and the queue with the policy (and, when the next step would have
to retract requests for lack of KV pages, a switch against that retraction), keeps the decisions
the timeline shows (the first, every switch, and a checkpoint each time the priced batch falls to
half its peak since the last one kept), and learns the call's residual lengths from the samples
that stopped. It only decides; the engine carries the switch out on every rank, or reports it
deferred, and then the request stays pending.

The policy is consulted at events (scheduling/decision_events.py), not at every step, and is fed
a sample of the steps the engine ran (``observe_step``): the measured seconds correct θ online
(scheduling/online.py) and count the steps spent in the layout (the policy's dwell). The driver's
own time -- consulting and feeding the policy -- is reported per step as ``policy_s``. How often it
consults and feeds the policy is the driver's own config (``DriverConfig``), not the policy's.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Mapping

from splash_rollout.config_fields import from_mapping
from splash_rollout.engine.request import Request
from splash_rollout.engine.request_scheduler import Scheduler
from splash_rollout.engine.step_log import StepRecord
from splash_rollout.layout.layouts import Layout
from splash_rollout.scheduling.decision_events import DecisionEvents


@dataclass(frozen=True)
class DriverConfig:
    """The driver's cadence: when it consults the layout policy and feeds its online correction."""

    decide_every_steps: int = 32
    """Consult the policy at events (admissions, finished requests, a deferred switch, the running
    batch moving by ``decide_batch_fraction``) and at least every this many steps."""
    decide_batch_fraction: float = 0.25
    """Relative change of the running batch since the last decision that makes a new one due."""
    observe_every_steps: int = 8
    """Hand the online correction one step in this many (and the first ``dwell_evidence_steps`` of
    every stay in a layout): a drain's steps repeat their shape, and pricing each one costs rank 0 a
    quarter of a decision (0.25 ms at B = 228 on a 2-core CPU, where one in four was 0.4 % of a
    drain's wall time)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "driver") -> "DriverConfig":
        """A DriverConfig from a mapping of its field names (None: the default); unknown names are refused."""
        return from_mapping(cls, values, where)

    def __post_init__(self) -> None:
        if self.observe_every_steps < 1:
            raise ValueError(f"observe_every_steps: expected a positive integer, got {self.observe_every_steps}")
        if self.decide_every_steps < 1:
            raise ValueError(f"decide_every_steps: expected a positive integer, got {self.decide_every_steps}")
        if not 0.0 < self.decide_batch_fraction <= 1.0:
            raise ValueError(f"decide_batch_fraction: expected a value in (0, 1], got {self.decide_batch_fraction}")


class LayoutDriver:
    def __init__(self, policy=None, switch_schedule: dict[int, Layout] | None = None,
                 config: DriverConfig = DriverConfig()) -> None:
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
        self.config = config
        self.events = (DecisionEvents(config.decide_every_steps, config.decide_batch_fraction)
                       if policy is not None else None)
        """When the policy is consulted (None without a policy)."""
        self.consults = 0
        """Policy consultations so far (each an event)."""
        self._switched = False
        """The next observed step is a switching step (its transfers are not a step of the layout)."""
        self._observable = 0
        """Steps of the current stay the correction could learn from (switching steps excluded); the
        first ``dwell_evidence_steps`` of them are all fed to it."""
        self._peak_priced = 0
        """The largest batch the policy priced since the last decision the timeline kept."""
        self._policy_s = 0.0
        self._boundary_s = 0.0
        """Seconds the last boundary spent with the policy (inside that step's control time)."""

    def request(self, dst: Layout, blocking: bool = False) -> None:
        self.pending, self.pending_cause = (dst, blocking), "request"

    def new_call(self) -> None:
        """A new serve call is a new group of prompts: its own length distribution."""
        self.ended_lengths = ([], [])
        if self.events is not None:
            self.events.reset()

    def observe_finished(self, finished: list[Request]) -> None:
        for r in finished:
            if r.finish_reason in ("stop", "length"):
                self.ended_lengths[r.finish_reason == "length"].append(r.num_output_tokens)
        if self.events is not None and finished:
            self.events.finished(len(finished))

    def observe_step(self, record: StepRecord, scheduled) -> None:
        """Rank 0 after each step: its step-log ``record`` and what it ran (ScheduledSeq list).
        Counts the step toward the dwell and, unless it switched, gives the policy its seconds
        (less the policy's own share) for the online correction."""
        self.steps_in_layout += 1
        switched, self._switched = self._switched, False
        if self.policy is None or switched:
            return
        self._observable += 1
        cfg = self.policy.config
        evidence = cfg.dwell_evidence_steps
        if self._observable > evidence and (self._observable - 1) % self.config.observe_every_steps:
            return  # a sample of the layout's steps: the first few that did not switch, then one in K
        t0 = time.perf_counter()
        measured = record.seconds - self._boundary_s  # the step, less the policy's time inside it
        signature = (record.requests, record.rows, record.prefill_rows)
        self.policy.observe_step(Layout.parse(record.layout), lambda: _executed_batch(scheduled), measured,
                                 signature)
        if (self._observable == evidence and self.steps_in_layout < cfg.min_dwell_steps
                and self.policy.correction is not None):
            self.events.ask("measured")  # the stay's evidence is complete: it may end the dwell
        self._policy_s += time.perf_counter() - t0

    def take_policy_s(self) -> float:
        """Seconds spent consulting and feeding the policy since the last call (rank 0's own cost)."""
        spent, self._policy_s = self._policy_s, 0.0
        return spent

    def at_boundary(self, layout: Layout, step: int, scheduler: Scheduler) -> tuple[Layout, bool] | None:
        """The switch to make before ``step`` runs, or None. ``pending`` keeps it until it is done."""
        if self.policy is not None:
            t0 = time.perf_counter()
            deferred = self.pending is not None and self.pending_cause in ("policy", "pressure")  # not done last boundary
            if deferred:
                self.pending = None
            if self.pending is None and not self._relieve_pressure(layout, step, scheduler):
                event = self.events.due(step, len(scheduler.running), len(scheduler.waiting), deferred)
                if event is not None:
                    self._consult_policy(layout, step, scheduler, event)
            self._boundary_s = time.perf_counter() - t0
            self._policy_s += self._boundary_s
        want = self.pending
        if want is None and step in self.switch_schedule:
            want = self.pending = (self.switch_schedule[step], False)
            self.pending_cause = "schedule"
        if want is None or want[0] is layout:
            self.pending = None
            return None
        return want

    def quiet_steps(self, step: int) -> int | None:
        """Steps from ``step`` (the one about to run) in which the driver will not switch: up to the
        next scheduled switch; 1 while a switch waits to be retried; None when nothing is due. The
        policy is consulted only where the engine meets it at a boundary."""
        if self.pending is not None:
            return 1
        later = [s for s in self.switch_schedule if s > step]
        return min(later) - step if later else None

    def switched(self) -> None:
        self.pending = None
        self._switched = True
        self.steps_in_layout = self._observable = 0

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

    def _consult_policy(self, layout: Layout, step: int, scheduler: Scheduler, event: str) -> None:
        from splash_rollout.scheduling.phase import prefill_in_phase
        from splash_rollout.scheduling.admission_plan import Waiting

        running = self._priced(scheduler)
        queued = list(itertools.islice(scheduler.waiting, scheduler.max_num_seqs))
        if not (running or queued):
            return
        self.events.decided(step, len(scheduler.running), len(scheduler.waiting))
        self.consults += 1
        batch = self._step_batch(scheduler, running)
        waiting = Waiting.make([r.num_uncomputed_tokens for r in queued], self._hold(scheduler, queued),
                               scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        first = not self.decision_log
        measured = min(self._observable, self.policy.config.dwell_evidence_steps)  # all fed, up to there
        residual = self._remaining(running + queued)
        phase = None  # the phase ahead, for a decision priced over it (a call's first; every one with price_phase)
        if first or self.policy.config.price_phase:  # as the simulator describes its own
            phase = prefill_in_phase([r.num_uncomputed_tokens for r in running if r.in_prefill],
                                     residual[: len(running)], waiting.prompt, scheduler.max_num_seqs,
                                     self.policy.config.horizon_quantile)
        decision = self.policy.decide(None if first else layout, batch, residual, self.steps_in_layout,
                                      self._hold(scheduler, running), waiting, phase, measured_steps=measured)
        # the timeline keeps the first call, every switch, and a checkpoint each time the batch the
        # policy priced has fallen to half its peak since the last kept one (a call's first decision
        # sees the queue's first admissions, not the batch they grow into): a draining group shows,
        # O(log B) times, what each layout was predicted to cost when the policy stayed put
        priced = len(running) + decision.admitted.get(decision.chosen.value, 0)
        self._peak_priced = max(self._peak_priced, priced)
        drained = bool(self.decision_log) and 2 * priced <= self._peak_priced
        last = self.decision_log[-1] if self.decision_log else {}
        retried = event == "deferred" and last.get("chosen") == decision.chosen.value  # logged already
        if first or (decision.switch and not retried) or drained:
            why = "initial" if first else "switch" if decision.switch else "drained"
            self.decision_log.append(dict(decision.to_dict(), step=step, batch_size=len(scheduler.running),
                                          waiting=len(scheduler.waiting), priced_batch=priced, logged=why,
                                          event=event, consults=self.consults))
            self._peak_priced = priced
        if decision.chosen is not layout and (first or decision.switch):
            self.pending, self.pending_cause = (decision.chosen, False), "policy"


def _executed_batch(scheduled):
    """The StepBatch of a step that ran (ScheduledSeq list), read after its postprocess: each history
    holds this step's rows (``end``: a verification that rejected drafts has computed fewer since),
    and a request that sampled has one token more than it has computed."""
    from splash_rollout.scheduling.cost_model import StepBatch

    reqs = [s.request for s in scheduled]
    sampled = [r.num_computed_tokens == r.num_tokens - 1 for r in reqs]
    return StepBatch.make([s.end for s in scheduled], [s.num_new for s in scheduled], [r.owner for r in reqs],
                          sum(sampled), sum(1 for r, x in zip(reqs, sampled) if x and r.num_output_tokens == 1))
