"""π(x; θ): which attention layout to run next step.

Paper §4.2: run the fastest layout whose KV fits; switch only when the candidate's lead, over the
steps the current batch is expected to keep running, pays the switch's exposed cost plus a margin.
``decide`` prices every layout once (``Board``) and asks its rules in order; the first that
decides returns a ``Decision`` whose ``rule`` says which:

1. ``NOTHING_FITS``: no layout holds the batch -- keep the current one;
2. ``INITIAL``: a call's first decision takes the fastest layout;
3. ``EXPLORE``: the fastest layout at its corrected price, measured too little, is tried (below);
4. ``CURRENT_FASTEST``: the current layout is the fastest (after doubt about the others);
5. ``DWELL``: stay at least ``min_dwell_steps`` in a layout (hysteresis against oscillating loads),
   unless the stay has been measured (``dwell_evidence_steps``): then the dwell is a parameter of
   rule 7 instead -- a switch must pay ``dwell_break_factor`` times its cost;
6. ``FORCED``: the current layout cannot hold the batch's real KV (what it holds after this step):
   move to the fastest one that can, with headroom for one layer's switch buffers (Eq. 5). Staying
   is judged on real KV, not on the expected totals: the estimate is an admission bound, and a batch
   whose real KV later outgrows the pool is what retraction (``relieve_pressure``) answers;
7. ``SWITCH`` / ``NO_GAIN``: the fastest candidate with headroom, faster by ``rel_margin``, whose
   ``lead × horizon`` exceeds the switch's round-trip exposed cost plus ``abs_margin_s`` (times the
   dwell's factor, inside a measured dwell); else keep. The horizon is a quantile of the running
   requests' decode steps left (the engine passes the median residual length learned from the
   call's stopped samples, scheduling/horizon.py), at most max_new_tokens.

Capacity counts when it changes admission (paper §5.3): with the requests queued behind the batch
(``Waiting``), each layout is priced on the batch *it* would run -- the running requests plus the
queued ones its pool admits -- and layouts compare by seconds per token processed, not per step
(scheduling/pricing.py; what fits where: scheduling/feasibility.py). A call's first decision, and
every decision with ``price_phase``, compares layouts over the phase ahead instead of one step.

With a ``StepTimeCorrection`` (scheduling/online.py; the engine's ``auto`` has one) every price is
θ's prediction corrected by the step times measured so far, and a layout is judged at its price
times exp(its doubt), the correction's uncertainty about a layout that has run little or not at
all, so θ's promise about a layout never run must be a large one before the policy moves into it
by rule 7. Doubt is resolved only by running the layout, so rule 3 does that: while the correction
has measured fewer than ``explore_observations`` steps of the layout that is fastest at its
corrected price, the policy tries it whenever its lead and saving pass rule 7's margins without the
doubt (measured: without it, a GRPO run whose steps all started in DOP never tried DP-attention at
the drain, where θ put it about 18 % ahead, and kept DOP for 21 of 24 steps' drains).

``relieve_pressure`` answers the other question -- out of KV pages, retract or switch -- on the same
prices. Every call returns a ``Decision`` record the engine stores in its timeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import numpy as np

from splash_rollout.config_fields import from_mapping
from splash_rollout.layout import ALL_LAYOUTS, Layout
from splash_rollout.scheduling.admission_plan import Waiting
from splash_rollout.scheduling.cost_model import StepBatch, StepCost
from splash_rollout.scheduling.deployment import Deployment
from splash_rollout.scheduling.horizon import quantile
from splash_rollout.scheduling.online import StepTimeCorrection
from splash_rollout.scheduling.phase import PhasePrefill
from splash_rollout.scheduling.pricing import StepPricer
from splash_rollout.scheduling.switch_cost import SwitchCost


DRIVER_FIELDS = ("decide_every_steps", "decide_batch_fraction", "observe_every_steps")
"""Former PolicyConfig fields: when an engine consults the policy is its driver's cadence
(engine/layout_driver.py ``DriverConfig``)."""


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
    explore_observations: int = 8
    """With an online correction, the fastest layout at its corrected price that the correction has
    measured fewer than this many steps of is tried (rule ``explore``) when its saving pays the
    switch, instead of being kept out by its doubt: a doubt only measurement resolves would otherwise
    keep a layout that never ran out for good. 0: never explore."""
    price_phase: bool = False
    """Compare layouts over the phase ahead instead of one step: the same prompt rows and horizon
    decode rows for every layout, the prompts that start now at its full-budget prefill step, the
    ones that enter as the batch finishes at the steps they trickle into (scheduling/phase.py),
    the rest of the horizon at the cost of the batch decoding. One step's shape flips between a
    prefill chunk and pure decode as requests finish and are admitted, and the layout that wins a
    chunk step (CP, on a long chunk) is not the one that wins the phase when decode steps dominate it."""
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "policy") -> "PolicyConfig":
        """A PolicyConfig from a mapping of its field names (a YAML or Hydra group); None values
        keep the defaults, ``layouts`` may be layout names. Unknown names are an error naming them."""
        parse = lambda names: tuple(Layout.parse(x, f"{where}.layouts") for x in names)  # noqa: E731
        return from_mapping(cls, values, where, convert={"layouts": parse},
                            moved={name: f"the driver's config (engine.driver.{name})" for name in DRIVER_FIELDS})

    def __post_init__(self) -> None:
        if self.rel_margin < 0 or self.abs_margin_s < 0 or self.min_dwell_steps < 0:
            raise ValueError("policy: margins and min_dwell_steps must be non-negative")
        if not self.dwell_break_factor >= 1.0:
            raise ValueError(f"dwell_break_factor: expected a number >= 1, got {self.dwell_break_factor}")
        if self.explore_observations < 0:
            raise ValueError(f"explore_observations: expected a non-negative integer, got {self.explore_observations}")
        if self.dwell_evidence_steps < 0:
            raise ValueError(f"dwell_evidence_steps: expected a non-negative integer, got {self.dwell_evidence_steps}")
        if not 0.0 <= self.horizon_quantile <= 1.0:
            raise ValueError(f"horizon_quantile: expected a value in [0, 1], got {self.horizon_quantile}")


class DecisionRule(str, Enum):
    """Which rule decided (``Decision.rule``): what programs and tests read; ``reason`` is for people."""

    NOTHING_FITS = "nothing_fits"
    """No layout holds the batch: keep the current one."""
    INITIAL = "initial"
    """A call's first decision: the fastest layout (priced over the phase ahead)."""
    EXPLORE = "explore"
    """The fastest layout at its corrected price has been measured too little to trust or rule
    out: it is tried, so the correction measures it, when its saving pays the switch."""
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


@dataclass(frozen=True)
class Stay:
    """How long the engine has been in the current layout: what the dwell reads."""

    steps: int = 0
    """Steps run since entering the current layout."""
    measured: int = 0
    """Of those, steps the online correction was fed."""


@dataclass
class Board:
    """Every layout priced once for one decision: what the rules read."""

    current: Layout | None
    batch: StepBatch
    hold: np.ndarray
    """[B] int64: tokens each running request is expected to reach (what entering a layout needs)."""
    horizon: float
    costs: dict[Layout, StepCost]
    """The (corrected) cost of the step each layout would run."""
    admitted: dict[Layout, int]
    eff: dict[Layout, float]
    """Seconds for the same work (the reference step's rows) per layout; inf where it does not fit."""
    doubt: dict[Layout, float]
    order: list[tuple[float, int, Layout]]
    """Feasible layouts, cheapest first, each at eff x exp(doubt)."""
    extra: dict
    """The Decision fields every decision of this board carries (admissions, prices, correction)."""

    @property
    def feasible(self) -> list[Layout]:
        return [l for l, c in self.costs.items() if c.feasible]

    @property
    def current_fits(self) -> bool:
        return self.current in self.feasible

    @property
    def current_eff(self) -> float:
        return self.eff.get(self.current, math.inf)

    def faster_than_current(self):
        """(judged seconds, layout) of the candidates ahead of the current layout, cheapest first."""
        for seconds, _, cand in self.order:
            if cand is self.current:
                return
            yield seconds, cand

    def decision(self, chosen: Layout, rule: DecisionRule, reason: str, sc: SwitchCost | None = None) -> Decision:
        secs = {l.value: c.seconds for l, c in self.costs.items()}
        if sc is None:
            return Decision(self.current, chosen, False, reason, secs, horizon_steps=self.horizon, rule=rule,
                            **self.extra)
        return Decision(self.current, chosen, True, reason, secs, sc.overlapped_s, sc.blocking_s, self.horizon,
                        rule=rule, **self.extra)


class LayoutPolicy:
    """π over one deployment. The caller passes the current layout and how long it has been in it;
    the only state is the optional online correction (in the pricer), which ``observe_step`` feeds."""

    def __init__(self, deployment: Deployment, config: PolicyConfig = PolicyConfig(),
                 correction: StepTimeCorrection | None = None):
        """correction: corrects θ's step times from measured ones (None: θ's predictions as they are)."""
        self.dep = deployment
        self.config = config
        self.pricer = StepPricer(deployment, config.layouts, correction)
        self.fit = self.pricer.fit
        self.rules = (self._nothing_fits, self._initial, self._explore, self._current_fastest, self._dwell,
                      self._forced, self._paying_switch)
        """Asked in order by ``decide``; each returns a Decision or None (pass)."""

    @property
    def correction(self) -> StepTimeCorrection | None:
        return self.pricer.correction

    def observe_step(self, layout: Layout, batch, measured_s: float, signature: tuple | None = None) -> None:
        """A step that ran in ``layout`` and took ``measured_s``: fed to the correction (StepPricer.observe_step)."""
        self.pricer.observe_step(layout, batch, measured_s, signature)

    # ---- decide --------------------------------------------------------------------------------------
    def decide(self, current: Layout | None, batch: StepBatch, remaining_tokens, steps_in_layout: int = 0,
               reserved=None, waiting: Waiting | None = None, prefill_left: int | PhasePrefill | None = None,
               measured_steps: int = 0) -> Decision:
        """Next layout for ``batch``. ``remaining_tokens``: [B] max_new_tokens left per request;
        ``steps_in_layout``: steps run since entering ``current``, ``measured_steps`` of which the
        correction was fed (the dwell and its evidence);
        ``reserved``: [B] tokens each request may reach (prompt + max_new_tokens) for the fit check;
        ``waiting``: the queue behind the batch (each layout is priced on what its pool admits);
        ``prefill_left``: prompt rows the running batch and the queue still have to prefill (phase
        pricing): a ``PhasePrefill`` (which start now, which enter as the batch finishes), or an int
        of rows that all start now (default: this step's chunk rows and the queue's prompts)."""
        board = self.board(current, batch, remaining_tokens, reserved, waiting, prefill_left)
        stay = Stay(steps_in_layout, measured_steps)
        for rule in self.rules:
            decision = rule(board, stay)
            if decision is not None:
                return decision
        raise AssertionError("the last rule always decides")

    def prices_phase(self, current: Layout | None, batch: StepBatch, waiting: Waiting | None) -> bool:
        """Whether layouts compare over the phase ahead rather than one step: with ``price_phase``,
        and always for a call's first decision (nothing running yet: it chooses the layout of the wide
        phase, and one step's admissions are prefill rows at much the same price per row in every
        layout, saying nothing of how many requests each pool then keeps decoding)."""
        return self.config.price_phase or (current is None and batch.size == 0 and waiting is not None)

    def board(self, current: Layout | None, batch: StepBatch, remaining_tokens, reserved=None,
              waiting: Waiting | None = None, prefill_left: int | PhasePrefill | None = None) -> Board:
        """Every layout priced for ``decide``'s rules."""
        pricer = self.pricer
        hold = batch.context if reserved is None else np.asarray(reserved, dtype=np.int64)
        priced = pricer.admitted_costs(batch, hold, waiting, current)
        prior = {l.value: c.seconds for l, (c, _, _) in priced.items()} if self.correction is not None else {}
        priced = {l: (pricer.corrected(c, st), st, a) for l, (c, st, a) in priced.items()}
        costs = {l: c for l, (c, _, _) in priced.items()}
        rows = {l: max(1, st.rows) for l, (_, st, _) in priced.items()}
        feasible = [l for l, c in costs.items() if c.feasible]
        horizon = quantile(np.asarray(remaining_tokens, dtype=np.float64), self.config.horizon_quantile)
        # compare layouts on the same amount of work: seconds for the reference step's rows
        ref_rows = rows[current] if current in feasible else max((rows[l] for l in feasible), default=1)
        if self.prices_phase(current, batch, waiting):
            if prefill_left is None:
                prefill_left = int(batch.query_rows[batch.query_rows > 1].sum()) + (
                    int(waiting.prompt.sum()) if waiting is not None else 0)
            spt = pricer.phase_seconds_per_token(priced, batch, horizon, prefill_left, hold, waiting)
        else:
            spt = {l: c.seconds / rows[l] for l, c in costs.items()}
        eff = {l: spt[l] * ref_rows if costs[l].feasible else math.inf for l in costs}
        factors = self.correction.factors() if self.correction is not None else None
        admitted = {l: a for l, (_, _, a) in priced.items()}
        extra = {"admitted": {l.value: a for l, a in admitted.items()},
                 "seconds_per_token": {l.value: spt[l] if costs[l].feasible else math.inf for l in costs},
                 "prior_step_costs": prior, "correction": factors.to_dict() if factors is not None else {}}
        # a layout is judged at its corrected price times its doubt (online.Factors.uncertainty):
        # one that has not run must lead by more before the policy moves into it
        doubt = {l: (0.0 if factors is None or l is current else factors.uncertainty(l.value)) for l in costs}
        order = sorted((eff[l] * math.exp(doubt[l]), i, l) for i, l in enumerate(costs) if costs[l].feasible)
        return Board(current, batch, hold, horizon, costs, admitted, eff, doubt, order, extra)

    # ---- the rules, in order ---------------------------------------------------------------------------
    def _nothing_fits(self, b: Board, stay: Stay) -> Decision | None:
        if b.order:
            return None
        keep = b.current if b.current is not None else self.config.layouts[0]
        return b.decision(keep, DecisionRule.NOTHING_FITS, "no layout holds the batch; keep")

    def _initial(self, b: Board, stay: Stay) -> Decision | None:
        if b.current is not None:
            return None
        fastest = b.order[0][2]
        return b.decision(fastest, DecisionRule.INITIAL, f"initial: {fastest.value} is fastest")

    def _explore(self, b: Board, stay: Stay) -> Decision | None:
        """The fastest layout at its corrected price (before doubt), measured fewer than
        ``explore_observations`` steps and kept out by its doubt alone, when the current one fits and
        the candidate's lead and saving pass the margins a switch must (inside a measured dwell, its
        ``dwell_break_factor``; inside an unmeasured one, never)."""
        cfg, factors = self.config, (self.correction.factors() if self.correction is not None else None)
        if factors is None or not cfg.explore_observations or not b.current_fits:
            return None
        payback = self._payback(b, stay)  # inside a measured dwell, as in rule 7: the dwell's factor
        if payback is None:
            return None
        cand = min(b.feasible, key=lambda l: b.eff[l])
        seen = factors.observations.get(cand.value, 0)
        if cand is b.current or not b.doubt[cand] or seen >= cfg.explore_observations:
            return None
        cur_eff, lead = b.current_eff, b.current_eff - b.eff[cand]
        if b.eff[cand] * math.exp(b.doubt[cand]) <= cur_eff * (1.0 - cfg.rel_margin):
            return None  # it leads even after its doubt: rule 7's to judge
        sc, price = self._switch_price(b, cand)
        if (b.eff[cand] > cur_eff * (1.0 - cfg.rel_margin) or lead * b.horizon <= payback * (price + cfg.abs_margin_s)
                or not self.fit.holds_switch(cand, b.hold, b.batch.owners, sc.layer_buffer_bytes)):
            return None
        times = f"{payback:g} x " if payback != 1.0 else ""
        dwell = f"dwell {stay.steps}/{cfg.min_dwell_steps} steps, {stay.measured} measured; " if payback != 1.0 else ""
        why = (f"{dwell}explore {cand.value}: {seen} of {cfg.explore_observations} steps measured; at its corrected "
               f"price it leads by {lead / cur_eff:.1%} and saves {lead * b.horizon * 1e3:.1f} ms over "
               f"{b.horizon:.0f} steps > {times}switch {price * 1e3:.2f} ms (round trip) -- its "
               f"{b.doubt[cand]:.0%} doubt is for measuring, not assuming")
        return b.decision(cand, DecisionRule.EXPLORE, why, sc)

    def _payback(self, b: Board, stay: Stay) -> float | None:
        """How many round-trip switch costs a switch's saving must cover: 1, the dwell's factor inside
        a measured dwell, None inside an unmeasured one (no switch by saving)."""
        if not self._young(b, stay):
            return 1.0
        return self.config.dwell_break_factor if self._measured(stay) else None

    def _switch_price(self, b: Board, cand: Layout) -> tuple[SwitchCost, float]:
        """(the switch into ``cand``, its exposed seconds as charged: twice with ``round_trip``)."""
        sc = self.pricer.switch_cost(b.current, cand, b.batch, b.costs[cand])
        return sc, sc.overlapped_s * (2.0 if self.config.round_trip else 1.0)

    def _current_fastest(self, b: Board, stay: Stay) -> Decision | None:
        if not (b.current_fits and b.order[0][2] is b.current):
            return None
        cheaper = [l.value for l in b.feasible if b.eff[l] < b.current_eff]  # at their prices, before doubt
        why = f"current is fastest after doubt about {', '.join(cheaper)}" if cheaper else "current is fastest"
        return b.decision(b.current, DecisionRule.CURRENT_FASTEST, why)

    def _young(self, b: Board, stay: Stay) -> bool:
        return b.current_fits and stay.steps < self.config.min_dwell_steps

    def _measured(self, stay: Stay) -> bool:
        """Whether the stay has been measured long enough for its dwell to end early."""
        cfg = self.config
        return self.correction is not None and cfg.dwell_evidence_steps and stay.measured >= cfg.dwell_evidence_steps

    def _dwell(self, b: Board, stay: Stay) -> Decision | None:
        if not self._young(b, stay) or self._measured(stay):
            return None
        return b.decision(b.current, DecisionRule.DWELL, f"dwell {stay.steps}/{self.config.min_dwell_steps} steps")

    def _forced(self, b: Board, stay: Stay) -> Decision | None:
        if b.current_fits:
            return None
        reasons = []
        for _, cand in b.faster_than_current():
            sc = self.pricer.switch_cost(b.current, cand, b.batch, b.costs[cand])
            if not self.fit.holds_switch(cand, b.hold, b.batch.owners, sc.layer_buffer_bytes):
                reasons.append(f"{cand.value}: no headroom for one layer's buffers")
                continue
            why = "; ".join(reasons + [f"{b.current.value} cannot hold the batch; forced to {cand.value}"])
            return b.decision(cand, DecisionRule.FORCED, why, sc)
        return b.decision(b.current, DecisionRule.NO_GAIN, "; ".join(reasons) or "no better layout")

    def _paying_switch(self, b: Board, stay: Stay) -> Decision:
        """The fastest candidate whose saving over the horizon pays ``payback`` x its switch, or keep."""
        cfg = self.config
        reasons = []
        payback = self._payback(b, stay) or cfg.dwell_break_factor  # None: the dwell rule kept it already
        if self._young(b, stay):  # a measured stay: its dwell is a factor
            reasons.append(f"dwell {stay.steps}/{cfg.min_dwell_steps} steps, {stay.measured} measured: "
                           f"a switch must pay {payback:g}x its cost")
        cur_eff = b.current_eff
        for seconds, cand in b.faster_than_current():
            sc, price = self._switch_price(b, cand)
            if not self.fit.holds_switch(cand, b.hold, b.batch.owners, sc.layer_buffer_bytes):
                reasons.append(f"{cand.value}: no headroom for one layer's buffers")
                continue
            lead = cur_eff - seconds
            if seconds > cur_eff * (1.0 - cfg.rel_margin):
                unsure = f" after {b.doubt[cand]:.0%} doubt" if b.doubt[cand] else ""
                reasons.append(f"{cand.value} leads by {lead / cur_eff:.1%}{unsure} < {cfg.rel_margin:.0%}")
                break
            gain = lead * b.horizon
            if gain <= payback * (price + cfg.abs_margin_s):
                times = f"{payback:g} x " if payback != 1.0 else ""
                reasons.append(f"{cand.value} saves {gain * 1e3:.2f} ms over {b.horizon:.0f} steps <= {times}(switch "
                               f"{price * 1e3:.2f} ms (round trip) + margin)")
                continue
            why = f"{cand.value} saves {gain * 1e3:.1f} ms over {b.horizon:.0f} steps > switch {sc.overlapped_s * 1e3:.2f} ms"
            if b.admitted[cand] != b.admitted[b.current]:
                why += f" (admits {b.admitted[cand]} queued vs {b.admitted[b.current]})"
            return b.decision(cand, DecisionRule.SWITCH, "; ".join(reasons + [why]), sc)  # and why faster ones were passed over
        keep_reason = "; ".join(reasons) or "no better layout"  # a dwell that did not end leads them
        return b.decision(b.current, DecisionRule.DWELL if payback != 1.0 else DecisionRule.NO_GAIN, keep_reason)

    # ---- out of pages ------------------------------------------------------------------------------------
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
        cfg = self.config
        hold = np.asarray(hold, dtype=np.int64)
        rem = np.asarray(remaining_tokens, dtype=np.float64)
        horizon = quantile(rem, cfg.horizon_quantile)
        work = horizon * max(1, int(batch.query_rows.sum()))
        costs = {l: self.pricer.price(l, batch) for l in cfg.layouts}
        secs = {l.value: c.seconds for l, c in costs.items()}
        gone = np.zeros(batch.size, dtype=bool)
        gone[np.asarray(victims, dtype=np.int64)] = True
        redo = StepBatch.make(batch.context[gone], batch.context[gone], batch.owners[gone])
        kept = StepBatch.make(batch.context[~gone], batch.query_rows[~gone], batch.owners[~gone])
        kept_s = self.pricer.price(current, kept).seconds if kept.size else 0.0
        # prefilling the victims again rides along a later step: its price is what it adds to one
        both = StepBatch.make(np.concatenate([kept.context, redo.context]),
                              np.concatenate([kept.query_rows, redo.query_rows]),
                              np.concatenate([kept.owners, redo.owners]))
        redo_s = self.pricer.price(current, both).seconds - kept_s if redo.size else 0.0
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
            if not self.fit.holds(l, hold, batch.owners):
                reasons.append(f"{l.value}: its pool does not hold the batch")
                continue
            sc = self.pricer.switch_cost(current, l, batch, costs[l])
            if not self.fit.holds_switch(l, hold, batch.owners, sc.layer_buffer_bytes):
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
