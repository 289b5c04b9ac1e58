"""π(x; θ): which attention layout to run next step, and which owner a new request gets.

Paper §4.2: run the fastest layout whose KV fits; switch only when the candidate's lead, over the
steps the current batch is expected to keep running, pays the switch's exposed cost plus a margin.
Rules, in order:

1. never enter a layout that cannot hold the batch (its reserved KV -- what each request is
   expected to reach -- plus one layer's switch buffers beyond it: Eq. 5 headroom);
2. if the current layout cannot hold the batch's real KV (what it holds after this step), move to
   the fastest one that can. Staying is judged on real KV, not on the expected totals: the
   estimate is an admission bound, and a batch whose real KV later outgrows the pool is what
   retraction (``relieve_pressure``) answers; an estimate that outgrows the pool while the real
   KV fits must not force a switch;
3. stay at least ``min_dwell_steps`` steps in a layout (hysteresis against oscillating loads) --
   unless the stay has been measured and leaving pays many times over: once the online correction
   has ``dwell_evidence_steps`` steps of this stay, a candidate whose saving over the horizon is
   more than ``dwell_break_factor`` x the round-trip switch cost ends the dwell (the dwell bounds
   switches whose saving is small next to their cost; one that pays many times over is no thrash);
4. switch only if the candidate is faster by ``rel_margin`` and
   ``lead × horizon > overlapped switch cost + abs_margin_s``, where the horizon is a quantile of the
   running requests' decode steps left: the caller's estimate (the engine passes the median residual
   length learned from the call's stopped samples, scheduling/horizon.py), at most max_new_tokens.

Capacity counts when it changes admission (paper §5.3): with the requests queued behind the batch
(``Waiting``), each layout is priced on the batch *it* would run -- the running requests plus the
queued ones its pool admits, FIFO, within the step's token budget -- and layouts compare by seconds
per token processed, not per step. A layout whose larger pool admits more of the queue can lead
while the queue lasts, and lose the lead to a faster one once the batch drains.

With a ``StepTimeCorrection`` (scheduling/online.py; the engine's ``auto`` has one) every price is
θ's prediction corrected by the step times measured so far, and each decision carries the
corrected θ; a layout is judged at its price times exp(its doubt), the correction's uncertainty
about a layout that has run little or not at all, so θ's promise about a layout never run must be
a large one before the policy moves into it. Admission is planned once per call -- the queue head within the token budget, owners by
least projected KV, the same for every layout -- and each layout only checks, vectorised over the
prefixes of that plan, how far its pool follows it.

Every call returns a ``Decision`` record the engine stores in its timeline.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import numpy as np

from splash_rollout.layout import ALL_LAYOUTS, BatchKV, Layout, SwitchPlan, fits
from splash_rollout.layout.layouts import Ownership
from splash_rollout.scheduling.cost_model import StepBatch, StepCost, step_time
from splash_rollout.scheduling.deployment import Deployment
from splash_rollout.scheduling.horizon import quantile
from splash_rollout.scheduling.phase import PhasePrefill, held_at_runs, owner_pieces, prefill_step
from splash_rollout.scheduling.online import GROUPS, StepTimeCorrection, stage_groups, step_shape
from splash_rollout.scheduling.switch_cost import SwitchCost, layer_transfer_seconds, overlapped_seconds


@dataclass(frozen=True)
class PolicyConfig:
    rel_margin: float = 0.05
    """The candidate must be at least this fraction faster per step."""
    abs_margin_s: float = 5e-3
    """Predicted saving over the horizon must exceed the switch cost by this many seconds."""
    min_dwell_steps: int = 16
    """Steps to stay in a layout after entering it."""
    dwell_evidence_steps: int = 3
    """Steps of a stay the online correction must have measured before the dwell may end early
    (the prices of the layout it is in are measured ones, no longer θ's promise); an engine feeds
    the correction every one of a stay's first this many steps. 0: the dwell always holds."""
    dwell_break_factor: float = 10.0
    """A measured stay's dwell ends early for a candidate saving more than this many times the
    round-trip switch cost (plus ``abs_margin_s``) over the horizon."""
    horizon_quantile: float = 0.5
    """Quantile of the running requests' expected remaining tokens used as the horizon (steps)."""
    layouts: tuple[Layout, ...] = ALL_LAYOUTS
    """Layouts the policy may choose (deployments may rule some out)."""
    round_trip: bool = True
    """Charge a switch twice -- there and, if the load turns back, back again -- so a lead that
    only pays one way (a load that oscillates around a crossover) does not switch."""
    price_phase: bool = False
    """Compare layouts over the phase ahead instead of one step: the same prompt rows and horizon
    decode rows for every layout, the prompts that start now at its full-budget prefill step, the
    ones that enter as the batch finishes at the steps they trickle into (scheduling/phase.py),
    the rest of the horizon at the cost of the batch decoding. One step's shape flips between a
    prefill chunk and pure decode as requests finish and are admitted, and the layout that wins a
    chunk step (CP, on a long chunk) is not the one that wins the phase when decode steps dominate it."""
    decide_every_steps: int = 32
    """An engine consults the policy at events (admissions, finished requests, a deferred switch,
    the running batch moving by ``decide_batch_fraction``) and at least every this many steps."""
    decide_batch_fraction: float = 0.25
    """Relative change of the running batch since the last decision that makes a new one due."""
    observe_every_steps: int = 8
    """An engine hands the online correction one step in this many (and the first
    ``dwell_evidence_steps`` of every stay in a layout):
    a drain's steps repeat their shape, and pricing each one costs rank 0 a quarter of a decision
    (0.25 ms at B = 228 on a 2-core CPU, where one in four was 0.4 % of a drain's wall time)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "policy") -> "PolicyConfig":
        """A PolicyConfig from a mapping of its field names (a YAML or Hydra group); None values
        keep the defaults, ``layouts`` may be layout names. Unknown names are an error naming them."""
        if not isinstance(values, Mapping):
            raise TypeError(f"{where}: expected a PolicyConfig or a mapping of its fields, got {type(values).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {names}")
        kwargs = {k: v for k, v in values.items() if v is not None}
        if "layouts" in kwargs:
            kwargs["layouts"] = tuple(Layout.parse(x, f"{where}.layouts") for x in kwargs["layouts"])
        try:
            return cls(**kwargs)
        except ValueError as e:  # name the field where the caller wrote it
            raise ValueError(f"{where}.{e}" if str(e).split(":")[0] in names else f"{where}: {e}") from None

    def __post_init__(self) -> None:
        if self.rel_margin < 0 or self.abs_margin_s < 0 or self.min_dwell_steps < 0:
            raise ValueError("policy: margins and min_dwell_steps must be non-negative")
        if not self.dwell_break_factor >= 1.0:
            raise ValueError(f"dwell_break_factor: expected a number >= 1, got {self.dwell_break_factor}")
        if self.dwell_evidence_steps < 0:
            raise ValueError(f"dwell_evidence_steps: expected a non-negative integer, got {self.dwell_evidence_steps}")
        if self.observe_every_steps < 1:
            raise ValueError(f"observe_every_steps: expected a positive integer, got {self.observe_every_steps}")
        if self.decide_every_steps < 1:
            raise ValueError(f"decide_every_steps: expected a positive integer, got {self.decide_every_steps}")
        if not 0.0 < self.decide_batch_fraction <= 1.0:
            raise ValueError(f"decide_batch_fraction: expected a value in (0, 1], got {self.decide_batch_fraction}")
        if not 0.0 <= self.horizon_quantile <= 1.0:
            raise ValueError(f"horizon_quantile: expected a value in [0, 1], got {self.horizon_quantile}")


class DecisionRule(str, Enum):
    """Which rule decided (``Decision.rule``): what programs and tests read; ``reason`` is for people."""

    NOTHING_FITS = "nothing_fits"
    """No layout holds the batch: keep the current one."""
    INITIAL = "initial"
    """A call's first decision: the fastest layout (priced over the phase ahead)."""
    CURRENT_FASTEST = "current_fastest"
    """The current layout is the fastest (after doubt about layouts that have not run)."""
    DWELL = "dwell"
    """The stay in the current layout is younger than the dwell, and no measured lead breaks it."""
    FORCED = "forced"
    """The current layout cannot hold the batch: switch to the fastest one that can."""
    SWITCH = "switch"
    """A faster layout's saving over the horizon pays its switch."""
    NO_GAIN = "no_gain"
    """Faster layouts exist but none pays its switch (margin, headroom or a dwell's factor)."""
    PRESSURE_SWITCH = "pressure_switch"
    """Out of KV pages: switching to a layout that holds the batch is cheaper than retracting."""
    PRESSURE_RETRACT = "pressure_retract"
    """Out of KV pages: retracting the youngest requests is cheaper than any switch."""


@dataclass(frozen=True)
class Decision:
    """One policy call: what runs next step and why."""

    current: Layout | None
    chosen: Layout
    switch: bool
    reason: str
    step_costs: dict[str, float] = field(default_factory=dict)
    """Predicted seconds per step per layout (inf: does not fit)."""
    switch_cost_s: float = 0.0
    """Predicted exposed (overlapped) cost of the switch to ``chosen`` (0 when not switching)."""
    blocking_cost_s: float = 0.0
    horizon_steps: float = 0.0
    admitted: dict[str, int] = field(default_factory=dict)
    """Queued requests each layout's pool would admit this step (capacity that changes admission)."""
    seconds_per_token: dict[str, float] = field(default_factory=dict)
    """Predicted seconds per processed token (query row) of the step each layout would run."""
    prior_step_costs: dict[str, float] = field(default_factory=dict)
    """θ's own seconds per step per layout, before the online correction (empty without one)."""
    correction: dict = field(default_factory=dict)
    """The corrected θ the prices used (``online.Factors.to_dict``; empty without a correction)."""
    rule: DecisionRule | None = None
    """The rule that decided (None: a decision not made by ``LayoutPolicy``, e.g. a test's)."""

    def to_dict(self) -> dict:
        return {"current": None if self.current is None else self.current.value, "chosen": self.chosen.value,
                "switch": self.switch, "rule": None if self.rule is None else self.rule.value, "reason": self.reason,
                "step_costs": {k: (None if math.isinf(v) else v) for k, v in self.step_costs.items()},
                "switch_cost_s": self.switch_cost_s, "blocking_cost_s": self.blocking_cost_s,
                "horizon_steps": self.horizon_steps, "admitted": dict(self.admitted),
                "seconds_per_token": {k: (None if math.isinf(v) else v) for k, v in self.seconds_per_token.items()},
                "prior_step_costs": {k: (None if math.isinf(v) else v) for k, v in self.prior_step_costs.items()},
                "correction": self.correction}


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


REPRICE_STEPS = 8
"""Consecutive observed steps of one signature that share θ's price (``LayoutPolicy.observe_step``)."""


class LayoutPolicy:
    """π over one deployment. The caller passes the current layout and how long it has been in it;
    the only state is the optional online correction, which ``observe_step`` feeds."""

    def __init__(self, deployment: Deployment, config: PolicyConfig = PolicyConfig(),
                 correction: StepTimeCorrection | None = None):
        """correction: corrects θ's step times from measured ones (None: θ's predictions as they are)."""
        self.dep = deployment
        self.config = config
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

    def _corrected(self, cost: StepCost, batch: StepBatch) -> StepCost:
        """``cost`` with its seconds (and per-layer seconds, which hide a switch's transfers) corrected."""
        if self.correction is None or not cost.feasible:
            return cost
        prefill = int(np.count_nonzero(batch.query_rows > 1))
        seconds = self.correction.factors().seconds(cost.layout.value, step_shape(batch.size, prefill),
                                                    stage_groups(cost.stages))
        ratio = seconds / cost.seconds if cost.seconds > 0 else 1.0
        return StepCost(cost.layout, seconds, cost.stages, tuple(x * ratio for x in cost.layer_seconds), cost.feasible,
                        cost.reason, cost.variant)

    def _price(self, layout: Layout, step: StepBatch) -> StepCost:
        """θ's cost of ``step`` in ``layout``, corrected by the measured steps when there is a correction."""
        d = self.dep
        return self._corrected(step_time(layout, step, d.model, d.profile, d.sizes), step)

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
        for l in self.config.layouts:
            pool = d.pools.get(l, 0)
            if not fits(l, batch.context if l is current else hold, pool, d.world_size, batch.owners):
                out[l] = (StepCost(l, math.inf, feasible=False, reason=f"{l.value}: reserved KV does not fit"), batch, 0)
                continue
            added = plan.admits(l, hold, batch.owners, pool, d.world_size)
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

    def _headroom_ok(self, dst: Layout, hold: np.ndarray, owners: np.ndarray, sc: SwitchCost) -> bool:
        """Eq. 5: one layer's incoming buffers beyond the destination's footprint must fit."""
        d = self.dep
        if sc.layer_buffer_bytes == 0:
            return True
        extra = -(-sc.layer_buffer_bytes // d.sizes.kv_bytes_per_token_total)  # in pool tokens
        return fits(dst, hold, d.pools.get(dst, 0) - extra, d.world_size, owners)

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
          pool keeps running (``_kept_running``): where pools bind, the layout that holds more of
          the queue decodes the same rows in fewer, wider steps. A layout whose prefill outlasts
          the horizon pays for all of it: the work is the same for every layout, the time is its own.

        A layout that prefills on owners (DP-attention, DOP) runs at most its budget / T rows per
        owner a step -- a long prompt on one owner at that rate -- and an admitted prompt's chunk is
        priced at the context halfway through its prefill."""
        d = self.dep
        phase = prefill if isinstance(prefill, PhasePrefill) else PhasePrefill(int(prefill))
        decode = StepBatch.make(np.maximum(batch.context, 1), np.ones(batch.size, dtype=np.int64), batch.owners)
        hold = batch.context if hold is None else hold
        # the decode work every layout is priced on: a row a step over the horizon for each running
        # request, in steps of the batch. A call's first decision has nothing running: the work is
        # a row a step for each request the phase admits now, and each layout runs it in steps of
        # the batch its own pool keeps running (where pools bind, the larger one's steps are wider)
        width = batch.size or phase.now_requests
        kept = {l: decode if batch.size else self._kept_running(l, batch, hold, waiting)
                for l, (cost, _, _) in priced.items() if cost.feasible}
        runs = [] if waiting is None else phase.arrival_runs(waiting.prompt, waiting.reserved, waiting.token_budget,
                                                             batch.size, horizon)
        # the free slots' prompts in runs of one kind, each at its own full-budget step; the rows
        # left are the running prefills', at the step they run in (an int or no free slot: every
        # now row at the step with the queue's head admitted, as before the split)
        now_runs = [] if waiting is None or not phase.now_requests else \
            phase.now_runs(waiting.prompt, waiting.reserved, waiting.token_budget, batch.size)
        running_rows = phase.now_rows - sum(r.rows for r in now_runs)
        out, parts, dec_s = {}, {}, {}
        decoding = int(np.count_nonzero(batch.query_rows <= 1))  # running requests that decode, one row each
        rows = phase.now_rows + sum(r.rows for r in runs)
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
                cost = self._price(l, step)
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
                parts[l].append((n, n * self._price(l, arrive).seconds))
            # the decode rows at this layout's rate: ``width`` rows a step of work, run in steps of
            # ``kept[l]`` (fewer rows than ``width`` where a first decision's pool binds)
            dec_s[l] = self._price(l, kept[l]).seconds * width / max(1, kept[l].size)
        capacity = {l: d.pools.get(l, 0) * (1 if l.ownership is Ownership.EVERY else d.world_size)
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

    def _kept_running(self, layout: Layout, batch: StepBatch, hold: np.ndarray, waiting: Waiting | None) -> StepBatch:
        """The decode step ``layout`` runs once its pool is full: ``batch`` and the head of the queue
        its pool admits (FIFO, at the queue's reservations, up to ``waiting.max_seqs``; every prompt
        prefilled), one row each. In the wide phase the queue keeps that batch running, so a layout
        whose pool holds more decodes more requests a step; without a queue it is ``batch``."""
        step = batch
        if waiting is not None and waiting.prompt.size:
            unbounded = Waiting(waiting.prompt, waiting.reserved, 1 << 62, waiting.max_seqs)
            step, _, _ = admit(layout, batch, hold, unbounded, self.dep.pools.get(layout, 0), self.dep.world_size,
                               self.dep.page_size)
        return StepBatch.make(np.maximum(step.context, 1), np.ones(step.size, dtype=np.int64), step.owners)

    def decide(self, current: Layout | None, batch: StepBatch, remaining_tokens, steps_in_layout: int = 0,
               reserved=None, waiting: Waiting | None = None, prefill_left: int | PhasePrefill | None = None,
               measured_steps: int = 0) -> Decision:
        """Next layout for ``batch``. ``remaining_tokens``: [B] max_new_tokens left per request;
        ``steps_in_layout``: steps run since entering ``current``, ``measured_steps`` of which the
        correction was fed (rule 3's dwell and its evidence);
        ``reserved``: [B] tokens each request may reach (prompt + max_new_tokens) for the fit check;
        ``waiting``: the queue behind the batch (each layout is priced on what its pool admits);
        ``prefill_left``: prompt rows the running batch and the queue still have to prefill (with
        ``price_phase``): a ``PhasePrefill`` (which start now, which enter as the batch finishes),
        or an int of rows that all start now (default: this step's chunk rows and the queue's prompts)."""
        cfg = self.config
        hold = batch.context if reserved is None else np.asarray(reserved, dtype=np.int64)
        priced = self.admitted_costs(batch, hold, waiting, current)
        prior = {l.value: c.seconds for l, (c, _, _) in priced.items()} if self.correction is not None else {}
        priced = {l: (self._corrected(c, st), st, a) for l, (c, st, a) in priced.items()}
        costs = {l: c for l, (c, _, _) in priced.items()}
        rows = {l: max(1, st.rows) for l, (_, st, _) in priced.items()}
        feasible = [l for l, c in costs.items() if c.feasible]
        rem = np.asarray(remaining_tokens, dtype=np.float64)
        horizon = quantile(rem, cfg.horizon_quantile)
        # compare layouts on the same amount of work: seconds for the reference step's rows
        ref_rows = rows[current] if current in feasible else max((rows[l] for l in feasible), default=1)
        # a call's first decision, nothing running yet, chooses the layout of the wide phase: it is
        # priced over that phase whatever the config (one step's admissions are prefill rows, at
        # much the same price per row in every layout, and say nothing of how many requests each
        # pool then keeps decoding)
        if cfg.price_phase or (current is None and batch.size == 0 and waiting is not None):
            if prefill_left is None:
                prefill_left = int(batch.query_rows[batch.query_rows > 1].sum()) + (
                    int(waiting.prompt.sum()) if waiting is not None else 0)
            spt = self.phase_seconds_per_token(priced, batch, horizon, prefill_left, hold, waiting)
        else:
            spt = {l: c.seconds / rows[l] for l, c in costs.items()}
        eff = {l: spt[l] * ref_rows if costs[l].feasible else math.inf for l in costs}
        secs = {l.value: c.seconds for l, c in costs.items()}
        factors = self.correction.factors() if self.correction is not None else None
        extra = {"admitted": {l.value: a for l, (_, _, a) in priced.items()},
                 "seconds_per_token": {l.value: spt[l] if costs[l].feasible else math.inf for l in costs},
                 "prior_step_costs": prior, "correction": factors.to_dict() if factors is not None else {}}
        # a layout is judged at its corrected price times its doubt (online.Factors.uncertainty):
        # one that has not run must lead by more before the policy moves into it
        doubt = {l: (0.0 if factors is None or l is current else factors.uncertainty(l.value)) for l in costs}
        order = sorted((eff[l] * math.exp(doubt[l]), i, l) for i, l in enumerate(costs) if costs[l].feasible)
        if not order:
            keep = current if current is not None else cfg.layouts[0]
            return Decision(current, keep, False, "no layout holds the batch; keep", secs, horizon_steps=horizon,
                            rule=DecisionRule.NOTHING_FITS, **extra)
        fastest = order[0][2]
        if current is None:
            return Decision(None, fastest, False, f"initial: {fastest.value} is fastest", secs, horizon_steps=horizon,
                            rule=DecisionRule.INITIAL, **extra)
        cur_ok = current in feasible
        cur_eff = eff.get(current, math.inf)
        if cur_ok and fastest is current:
            cheaper = [l.value for l in feasible if eff[l] < cur_eff]  # at their prices, before doubt
            why = f"current is fastest after doubt about {', '.join(cheaper)}" if cheaper else "current is fastest"
            return Decision(current, current, False, why, secs, horizon_steps=horizon, rule=DecisionRule.CURRENT_FASTEST,
                            **extra)
        reasons, pays = [], 1.0  # pays: how many round-trip switch costs a switch's saving must cover
        if cur_ok and steps_in_layout < cfg.min_dwell_steps:
            dwell = f"dwell {steps_in_layout}/{cfg.min_dwell_steps} steps"
            if not (self.correction is not None and cfg.dwell_evidence_steps
                    and measured_steps >= cfg.dwell_evidence_steps):
                return Decision(current, current, False, dwell, secs, horizon_steps=horizon, rule=DecisionRule.DWELL,
                                **extra)
            pays = cfg.dwell_break_factor
            reasons.append(f"{dwell}, {measured_steps} measured: a switch must pay {pays:g}x its cost")
        for seconds, _, cand in order:
            if cand is current:
                break
            sc = self.switch_cost(current, cand, batch, costs[cand])
            if not self._headroom_ok(cand, hold, batch.owners, sc):
                reasons.append(f"{cand.value}: no headroom for one layer's buffers")
                continue
            if not cur_ok:
                why = "; ".join(reasons + [f"{current.value} cannot hold the batch; forced to {cand.value}"])
                return Decision(current, cand, True, why, secs, sc.overlapped_s, sc.blocking_s, horizon,
                                rule=DecisionRule.FORCED, **extra)
            lead = cur_eff - seconds
            if seconds > cur_eff * (1.0 - cfg.rel_margin):
                unsure = f" after {doubt[cand]:.0%} doubt" if doubt[cand] else ""
                reasons.append(f"{cand.value} leads by {lead / cur_eff:.1%}{unsure} < {cfg.rel_margin:.0%}")
                break
            gain = lead * horizon
            price = sc.overlapped_s * (2.0 if cfg.round_trip else 1.0)
            if gain <= pays * (price + cfg.abs_margin_s):
                times = f"{pays:g} x " if pays != 1.0 else ""
                reasons.append(f"{cand.value} saves {gain * 1e3:.2f} ms over {horizon:.0f} steps <= {times}(switch "
                               f"{price * 1e3:.2f} ms (round trip) + margin)")
                continue
            why = f"{cand.value} saves {gain * 1e3:.1f} ms over {horizon:.0f} steps > switch {sc.overlapped_s * 1e3:.2f} ms"
            if priced[cand][2] != priced[current][2]:
                why += f" (admits {priced[cand][2]} queued vs {priced[current][2]})"
            why = "; ".join(reasons + [why])  # and why faster layouts were passed over
            return Decision(current, cand, True, why, secs, sc.overlapped_s, sc.blocking_s, horizon,
                            rule=DecisionRule.SWITCH, **extra)
        keep_reason = "; ".join(reasons) or "no better layout"  # a dwell that did not end leads them
        return Decision(current, current, False, keep_reason, secs, horizon_steps=horizon,
                        rule=DecisionRule.DWELL if pays != 1.0 else DecisionRule.NO_GAIN, **extra)

    def relieve_pressure(self, current: Layout, batch: StepBatch, remaining_tokens, hold, short_pages,
                         victims) -> Decision:
        """The running ``batch`` cannot get the KV pages its next step needs in ``current`` (``short_pages``:
        [T] missing per rank). Two ways out, priced on the same work (the batch's rows over the horizon):

        * retract ``victims`` ([V] indices into the batch, youngest first): the rest runs on in
          ``current`` at its seconds per token, and the victims' tokens are prefilled again later
          (priced as what that prefill adds to a step of the rest);
        * switch to a layout whose pool holds ``hold`` ([B] tokens each request is expected to reach):
          the switch's exposed cost, then the whole batch at that layout's seconds per token.

        The cheaper one is chosen; the reason lists every option's price (corrected, with a correction)."""
        d, cfg = self.dep, self.config
        hold = np.asarray(hold, dtype=np.int64)
        rem = np.asarray(remaining_tokens, dtype=np.float64)
        horizon = quantile(rem, cfg.horizon_quantile)
        work = horizon * max(1, int(batch.query_rows.sum()))
        costs = {l: self._price(l, batch) for l in cfg.layouts}
        secs = {l.value: c.seconds for l, c in costs.items()}
        gone = np.zeros(batch.size, dtype=bool)
        gone[np.asarray(victims, dtype=np.int64)] = True
        redo = StepBatch.make(batch.context[gone], batch.context[gone], batch.owners[gone])
        kept = StepBatch.make(batch.context[~gone], batch.query_rows[~gone], batch.owners[~gone])
        kept_s = self._price(current, kept).seconds if kept.size else 0.0
        # prefilling the victims again rides along a later step: its price is what it adds to one
        both = StepBatch.make(np.concatenate([kept.context, redo.context]),
                              np.concatenate([kept.query_rows, redo.query_rows]),
                              np.concatenate([kept.owners, redo.owners]))
        redo_s = self._price(current, both).seconds - kept_s if redo.size else 0.0
        kept_spt = kept_s / max(1, int(kept.query_rows.sum())) if kept.size else math.inf
        retract_price = redo_s + work * kept_spt
        short = ", ".join(f"rank {r} {n}" for r, n in enumerate(short_pages) if n > 0)
        head = (f"memory pressure in {current.value} (pages short: {short}): retracting {redo.size} of "
                f"{batch.size} requests costs {retract_price * 1e3:.1f} ms ({redo_s * 1e3:.1f} ms to prefill "
                f"{int(redo.context.sum())} tokens again, the rest at {kept_spt * 1e6:.1f} us/token)")
        options, reasons = [], []
        for l in cfg.layouts:
            if l is current:
                continue
            if not fits(l, hold, d.pools.get(l, 0), d.world_size, batch.owners):
                reasons.append(f"{l.value}: its pool does not hold the batch")
                continue
            sc = self.switch_cost(current, l, batch, costs[l])
            if not self._headroom_ok(l, hold, batch.owners, sc):
                reasons.append(f"{l.value}: no headroom for one layer's buffers")
                continue
            spt = costs[l].seconds / max(1, int(batch.query_rows.sum()))
            price = sc.overlapped_s + work * spt
            reasons.append(f"{l.value}: {price * 1e3:.1f} ms (switch {sc.overlapped_s * 1e3:.2f} ms, "
                           f"{spt * 1e6:.1f} us/token)")
            options.append((price, l, sc))
        if options:
            price, best, sc = min(options, key=lambda o: (o[0], o[1].value))
            if price < retract_price:
                why = "; ".join([head] + reasons + [f"switch to {best.value} instead"])
                return Decision(current, best, True, why, secs, sc.overlapped_s, sc.blocking_s, horizon,
                                rule=DecisionRule.PRESSURE_SWITCH)
        why = "; ".join([head] + reasons + ["retract"])
        return Decision(current, current, False, why, secs, horizon_steps=horizon, rule=DecisionRule.PRESSURE_RETRACT)
