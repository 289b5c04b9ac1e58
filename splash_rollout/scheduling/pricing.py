"""Prices of a step, a switch and the phase ahead, per layout: what the policy compares.

θ's cost model (scheduling/cost_model.py) prices one step of a batch in a layout; this module turns
that into what a decision needs:

* ``admitted_costs``: per layout, the step it would run -- the running batch plus the head of the
  queue its pool admits -- and that step's cost (inf where the batch does not fit);
* ``switch_cost``: the per-layer transfers of a switch and their exposed (overlapped) seconds;
* ``phase_seconds_per_token``: every layout priced on the same work, the phase ahead (its prompt
  rows and the horizon's decode rows), at its own rates;
* with a ``StepTimeCorrection`` (scheduling/online.py) each price is θ's corrected by the step times
  measured so far; ``observe_step`` feeds it.
"""
from __future__ import annotations

import math

import numpy as np

from splash_rollout.layout import BatchKV, Layout, SwitchPlan
from splash_rollout.layout.layouts import Ownership
from splash_rollout.scheduling.admission_plan import AdmissionPlan, Waiting, admit
from splash_rollout.scheduling.cost_model import StepBatch, StepCost, step_time
from splash_rollout.scheduling.deployment import Deployment
from splash_rollout.scheduling.feasibility import KVFit
from splash_rollout.scheduling.online import GROUPS, StepTimeCorrection, stage_groups, step_shape
from splash_rollout.scheduling.phase import PhasePrefill, held_at_runs, owner_pieces, prefill_step
from splash_rollout.scheduling.switch_cost import SwitchCost, layer_transfer_seconds, overlapped_seconds

REPRICE_STEPS = 8
"""Consecutive observed steps of one signature that share θ's price (``LayoutPolicy.observe_step``)."""


class StepPricer:
    """Prices over one deployment, for the layouts a policy may choose. The only state is the
    optional online correction, which ``observe_step`` feeds."""

    def __init__(self, deployment: Deployment, layouts: tuple[Layout, ...],
                 correction: StepTimeCorrection | None = None):
        """correction: corrects θ's step times from measured ones (None: θ's predictions as they are)."""
        self.dep = deployment
        self.layouts = layouts
        self.fit = KVFit(deployment)
        self.correction = correction
        self._priced: tuple | None = None
        """The last step θ priced for the correction: (key, shape, groups, steps it has priced)."""

    def observe_step(self, layout: Layout, batch, measured_s: float, signature: tuple | None = None) -> None:
        """A step that ran in ``layout`` and took ``measured_s`` (not a switching step), priced by θ
        and handed to the correction; without one, nothing to learn. ``batch``: the step's StepBatch,
        or a callable that builds it (called only when θ prices the step anew). ``signature``: a
        cheap key of the step's shape (requests, rows, ...): consecutive steps with the same key
        reuse θ's price of the first for ``REPRICE_STEPS`` steps -- a decode step's price moves by
        one token of context per request per step."""
        if self.correction is None:
            return
        key = (layout, signature)
        if signature is not None and self._priced is not None and self._priced[0] == key \
                and self._priced[3] < REPRICE_STEPS:
            _, shape, groups, uses = self._priced
            self._priced = (key, shape, groups, uses + 1)
        else:
            step = batch() if callable(batch) else batch
            if not step.size:
                return
            prior = step_time(layout, step, self.dep.model, self.dep.profile, self.dep.sizes)
            shape, groups = step_shape(step.size, int(np.count_nonzero(step.query_rows > 1))), stage_groups(prior.stages)
            self._priced = (key, shape, groups, 1)
        self.correction.observe(layout.value, shape, groups, measured_s)

    def corrected(self, cost: StepCost, batch: StepBatch) -> StepCost:
        """``cost`` with its seconds (and per-layer seconds, which hide a switch's transfers) corrected."""
        if self.correction is None or not cost.feasible:
            return cost
        prefill = int(np.count_nonzero(batch.query_rows > 1))
        seconds = self.correction.factors().seconds(cost.layout.value, step_shape(batch.size, prefill),
                                                    stage_groups(cost.stages))
        ratio = seconds / cost.seconds if cost.seconds > 0 else 1.0
        return StepCost(cost.layout, seconds, cost.stages, tuple(x * ratio for x in cost.layer_seconds), cost.feasible,
                        cost.reason, cost.variant)

    def price(self, layout: Layout, step: StepBatch) -> StepCost:
        """θ's cost of ``step`` in ``layout``, corrected by the measured steps when there is a correction."""
        d = self.dep
        return self.corrected(step_time(layout, step, d.model, d.profile, d.sizes), step)

    def admitted_costs(self, batch: StepBatch, reserved: np.ndarray | None = None, waiting: Waiting | None = None,
                       current: Layout | None = None) -> dict[Layout, tuple[StepCost, StepBatch, int]]:
        """Per layout: (cost of the step it would run, that step's batch, queued requests it admits).
        A layout whose pool cannot hold ``reserved`` (default: the live context) costs inf; the
        ``current`` layout only when its pool cannot hold the live context (the batch is already
        there: staying needs its real KV to fit, the estimate only gates its admission)."""
        d = self.dep
        hold = batch.context if reserved is None else np.asarray(reserved, dtype=np.int64)
        plan = AdmissionPlan.make(batch, hold, waiting, d.world_size, d.page_size)
        out = {}
        for l in self.layouts:
            if not self.fit.holds(l, batch.context if l is current else hold, batch.owners):
                out[l] = (StepCost(l, math.inf, feasible=False, reason=f"{l.value}: reserved KV does not fit"), batch, 0)
                continue
            added = self.fit.admits(l, plan, hold, batch.owners)
            step, _ = plan.step(batch, hold, added)
            cost = step_time(l, step, d.model, d.profile, d.sizes) if step.size else StepCost(l, math.inf, feasible=False,
                                                                                          reason=f"{l.value}: admits nothing")
            out[l] = (cost, step, added)
        return out

    def switch_cost(self, src: Layout, dst: Layout, batch: StepBatch, dst_cost: StepCost) -> SwitchCost:
        stored = np.maximum(batch.context - batch.query_rows, 0)
        kv = BatchKV(tuple(int(x) for x in stored), tuple(int(o) for o in batch.owners), self.dep.page_size)
        plan = SwitchPlan.build(src, dst, self.dep.sizes, kv, self.dep.world_size)
        x = layer_transfer_seconds(plan, self.dep.profile)
        if self.correction is not None:  # the transfers are collectives: the corrected comm rate prices them
            x = tuple(v * float(self.correction.factors().stage[GROUPS.index("comm")]) for v in x)
        return SwitchCost(plan.src, plan.dst, float(sum(x)), float(overlapped_seconds(x, dst_cost.layer_seconds)), x,
                          int(plan.max_bytes_received), int(plan.layer_buffer_bytes))

    def phase_seconds_per_token(self, priced: dict, batch: StepBatch, horizon: float, prefill: int | PhasePrefill,
                                hold: np.ndarray | None = None, waiting: Waiting | None = None
                                ) -> dict[Layout, float]:
        """Per layout: predicted seconds per row of the phase ahead, every layout priced on the same
        work -- the phase's prompt rows and ``horizon`` decode steps of the batch -- at its own
        rates. ``prefill`` says how the prompt rows arrive (an int: all of them now; see
        ``phase.PhasePrefill``):

        * the rows that can run now: the running prefills' rest takes ceil(rows / that layout's
          prefill rows per step) steps at the cost of the step they run in; the free slots'
          prompts go in FIFO runs of one kind (``PhasePrefill.now_runs``), each at the full-budget
          step of its own prompts as if the pool had room (``hold``, ``waiting``: as ``decide``
          gets them; what this step's pool admits is a snapshot) -- a long prompt behind short
          ones at its own rate (on one owner, for DP-attention and DOP), not at the short head's.
          With no free slot (or an int) every now row is priced at the step with the queue's
          head admitted up to the token budget;
        * the prompts that enter later arrive in runs (``PhasePrefill.arrival_runs``): short ones
          one per finishing request, a step carrying what arrived since the last one, so each
          layout pays its per-prefill-step cost on the steps they trickle in; long ones in
          full-budget chunks. The first run, like the now rows, is priced in the layout itself. A
          run behind it may be left to the layout that runs it fastest among those that can take the batch back when
          the run reaches the head, since the policy is consulted again then and a switch costs
          milliseconds: a pool that holds what this layout's batch holds by then
          (``phase.held_at_runs``: the batch, the prompts admitted ahead, less what the requests
          finishing meanwhile free) or, where this layout's pool fills first, at least as much
          over the group as its own. A batch held at the request limit by the turnover fits the
          smaller pools and every layout prices the run the same way; a layout whose larger pool
          admission fills (DOP's, past CP's) prefills it itself;
        * the steps of the horizon left after the prefill steps run the batch decoding, one row per
          request (at the current context). A call's first decision, with nothing running, decodes
          a row a step for each request the phase admits now, in steps of the batch the layout's
          pool keeps running (``kept_running``): where pools bind, the layout that holds more of
          the queue decodes the same rows in fewer, wider steps. A layout whose prefill outlasts
          the horizon pays for all of it: the work is the same for every layout, the time is its own.

        A layout that prefills on owners (DP-attention, DOP) runs at most its budget / T rows per
        owner a step -- a long prompt on one owner at that rate -- and an admitted prompt's chunk is
        priced at the context halfway through its prefill."""
        phase = prefill if isinstance(prefill, PhasePrefill) else PhasePrefill(int(prefill))
        decode = StepBatch.make(np.maximum(batch.context, 1), np.ones(batch.size, dtype=np.int64), batch.owners)
        hold = batch.context if hold is None else hold
        # the decode work every layout is priced on: a row a step over the horizon for each running
        # request, in steps of the batch. A call's first decision has nothing running: the work is
        # a row a step for each request the phase admits now, and each layout runs it in steps of
        # the batch its own pool keeps running (where pools bind, the larger one's steps are wider)
        width = batch.size or phase.now_requests
        kept = {l: decode if batch.size else self.kept_running(l, batch, hold, waiting)
                for l, (cost, _, _) in priced.items() if cost.feasible}
        runs = [] if waiting is None else phase.arrival_runs(waiting.prompt, waiting.reserved, waiting.token_budget,
                                                             batch.size, horizon)
        # the free slots' prompts in runs of one kind, each at its own full-budget step; the rows
        # left are the running prefills', at the step they run in (an int or no free slot: every
        # now row at the step with the queue's head admitted, as before the split)
        now_runs = [] if waiting is None or not phase.now_requests else \
            phase.now_runs(waiting.prompt, waiting.reserved, waiting.token_budget, batch.size)
        out, parts, dec_s = self._phase_parts(priced, batch, phase, hold, waiting, decode, width, kept, runs, now_runs)
        rows = phase.now_rows + sum(r.rows for r in runs)
        out.update(self._cheapest_plans(parts, dec_s, hold, waiting, phase, runs, now_runs, horizon, rows, width))
        return out

    def _phase_parts(self, priced: dict, batch: StepBatch, phase: PhasePrefill, hold: np.ndarray,
                     waiting: Waiting | None, decode: StepBatch, width: int, kept: dict, runs: list, now_runs: list):
        """Per feasible layout, in its own rates: the (steps, seconds) of the running prefills' rows,
        then of each run of prompts (the free slots', then the later arrivals'), and the seconds of a
        step of ``width`` decode rows. Infeasible layouts (or nothing to run) are priced at once.
        Returns (those prices, the parts, the decode seconds)."""
        d = self.dep
        running_rows = phase.now_rows - sum(r.rows for r in now_runs)
        out, parts, dec_s = {}, {}, {}
        decoding = int(np.count_nonzero(batch.query_rows <= 1))  # running requests that decode, one row each
        for l, (cost, step, _) in priced.items():
            if not cost.feasible or not width:
                out[l] = cost.seconds / max(1, step.rows)
                continue
            cap = 0  # rows one owner prefills a step (0: the group's budget, not per owner)
            if waiting is not None and l.ownership is Ownership.OWNER:
                cap = max(1, d.chunk_tokens(l, waiting.token_budget) // d.world_size)
            if now_runs:
                step = prefill_step(batch, batch.size, np.zeros(0, np.int64), cap) if cap else batch
            elif phase.now_rows and waiting is not None and waiting.prompt.size:
                step, _, _ = admit(l, batch, hold, waiting, 1 << 62, d.world_size, d.page_size)
                step = prefill_step(step, batch.size, waiting.prompt, cap)
            elif cap:
                step = prefill_step(step, step.size, np.zeros(0, np.int64), cap)
            if step is not priced[l][1]:
                cost = self.price(l, step)
            pre_rows = step.rows - decoding  # the prefill rows (a one-row prompt is one too)
            n_now = math.ceil(running_rows / pre_rows) if pre_rows and running_rows > 0 else 0
            parts[l] = [(n_now, n_now * cost.seconds)]  # (steps, seconds) of the now rows, then of each run
            for k, later in enumerate(now_runs + runs):
                prompt, reserved = later.prompt, later.reserved
                if cap and not later.long and k >= len(now_runs):  # short arrivals overlap on owners
                    prompt, reserved = owner_pieces(prompt, reserved, cap)
                queue = Waiting(prompt, reserved, later.token_budget, decode.size + prompt.size)
                arrive, _, _ = admit(l, decode, decode.context, queue, 1 << 62, d.world_size, d.page_size)
                arrive = prefill_step(arrive, decode.size, prompt, cap)
                a_rows = arrive.rows - decode.size
                n = math.ceil(later.rows / a_rows) if a_rows else math.inf
                parts[l].append((n, n * self.price(l, arrive).seconds))
            # the decode rows at this layout's rate: ``width`` rows a step of work, run in steps of
            # ``kept[l]`` (fewer rows than ``width`` where a first decision's pool binds)
            dec_s[l] = self.price(l, kept[l]).seconds * width / max(1, kept[l].size)
        return out, parts, dec_s

    def _cheapest_plans(self, parts: dict, dec_s: dict, hold: np.ndarray, waiting: Waiting | None,
                        phase: PhasePrefill, runs: list, now_runs: list, horizon: float, rows: int,
                        width: int) -> dict[Layout, float]:
        """Per layout: its parts, each run behind the first left to the layout that runs it fastest
        among those that could take the batch back by then, and the horizon's decode steps after
        them, over the phase's rows."""
        d = self.dep
        out = {}
        capacity = {l: self.fit.pool(l) * (1 if l.ownership is Ownership.EVERY else d.world_size)
                    for l in parts}
        now_reserved = waiting.reserved[: phase.now_requests] if waiting is not None else np.zeros(0, np.int64)
        held = held_at_runs(hold, now_reserved, runs)  # [R] tokens the batch holds as each run reaches the head
        mine = 2 + len(now_runs)  # the running prefills, the free slots' runs, the first later run: in the layout
        for l, own in parts.items():
            # a later run behind the first may go to a layout that can take the batch back from this
            # one as the run reaches the head: its pool holds what this one's batch holds by then, at
            # most this one's pool (own[k] prices runs[k - mine + 1])
            plan = own[:mine] + [min((parts[m][k] for m in parts
                                      if capacity[m] >= min(capacity[l], held[k - mine + 1])),
                                     key=lambda p: p[1]) for k in range(mine, len(own))]
            steps, seconds = sum(p[0] for p in plan), sum(p[1] for p in plan)
            if not math.isfinite(seconds):
                out[l] = math.inf
                continue
            n_dec = max(horizon - steps, 0.0)
            out[l] = (seconds + (n_dec * dec_s[l] if n_dec else 0.0)) / (rows + max(horizon, 1.0) * width)
        return out

    def kept_running(self, layout: Layout, batch: StepBatch, hold: np.ndarray, waiting: Waiting | None) -> StepBatch:
        """The decode step ``layout`` runs once its pool is full: ``batch`` and the head of the queue
        its pool admits (FIFO, at the queue's reservations, up to ``waiting.max_seqs``; every prompt
        prefilled), one row each. In the wide phase the queue keeps that batch running, so a layout
        whose pool holds more decodes more requests a step; without a queue it is ``batch``."""
        step = batch
        if waiting is not None and waiting.prompt.size:
            unbounded = Waiting(waiting.prompt, waiting.reserved, 1 << 62, waiting.max_seqs)
            step, _, _ = admit(layout, batch, hold, unbounded, self.fit.pool(layout), self.dep.world_size,
                               self.dep.page_size)
        return StepBatch.make(np.maximum(step.context, 1), np.ones(step.size, dtype=np.int64), step.owners)

