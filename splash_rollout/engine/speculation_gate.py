"""When to speculate (``speculation="auto"``): rank 0 prices each step with and without drafts.

A drafted decode row costs a query row; what it buys is the tokens verification keeps. With α the
measured probability that a drafted token is kept given the ones before it were (kept drafts over
kept drafts plus rejections, from the drafter's own record) and f the share of decoding requests
the drafter had a draft for -- both measured within the current call, shrunk toward every call's so
far (``prior_weight`` drafts' worth; before any, α = ``prior_alpha``): a group of 8 samples of one
prompt drafts from its siblings, a call of single samples of fresh prompts barely drafts at all --
a cap of k drafts per request yields per decoding request

    1 + f * (α + α² + ... + α^k)          tokens a step, for
    t(B decode rows + f·B·k drafted rows)  seconds (the cost model, in the current layout),

until that cap has been in force for ``min_verified`` verified drafts: from then on its measured
drafted rows and kept tokens per verified request replace k and the sum (drafts are often shorter
than the cap -- the drafter stops where the group's samples disagree -- and the chance a draft is
kept falls along it, so the geometric sum over-promises long caps),

against 1 token for t(B rows). While requests wait, the gate takes the cap (0, 1, 2, 4, ... up to
``max_draft``) with the most tokens per second: the queue refills the batch, so throughput is the
call's time -- and there a drafted step costs more than its rows (requests finish at staggered
steps, so the queue's prompts arrive in more, smaller chunks), so once both kinds have run
``regime_steps`` steps at a batch width, their measured tokens per second decide drafting on or off
there (the kind θ would not choose is run once for that many steps to measure it; the first quarter
of a run is not counted: it still carries the previous kind's aftermath). Once nothing waits, the call lasts as long as its slowest request: with S steps left
(the median budget left of the running requests), K a request's kept tokens per step (mean m and
variance v, from the per-cap record) and B requests, the slowest of them gains about
max(0, m·S - sqrt(2 ln B)·sqrt(v·S)) tokens over those steps -- drafts that speed the average
request up do not end a wide lockstep batch sooner -- and the cap with the most progress of that
request per second wins. θ prices rows, not what a drafted step adds around them (proposing,
verifying, sampling more rows; on a CPU, products that leave the few-row kernels), so the gate
also measures: for the decode steps it sees (``observe``), the ratio of measured to predicted
seconds, apart for steps with and without drafts and per batch width (powers of two of the decoding
requests: what an extra row costs depends on how many there are; exponential averages, starting at
1); a drafted step's price is scaled by how much more than θ drafted steps of that width have cost
than plain ones. Until each kind has been measured ``min_observed`` times at a width, one step in
``explore_every`` runs the kind the gate did not choose (the tokens are the same either way; only
time is at stake) -- a drafted one only while the drafter is expected to have a draft for at least
one of the step's requests (hit rate x decoding requests >= 1): a step asked for drafts that gets
none runs plain, measures nothing and would be asked again every ``explore_every`` steps. Where the
batch is wide, a row costs about what a token is worth and the answer is 0; as it drains a step's
fixed cost dominates, extra rows are nearly free and drafts pay.
The cap is decided on rank 0 and sent to every rank in the step's control message, so every
scheduler replica drafts alike. A change of cap is logged with its reason (``log``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from splash_rollout.engine.drafter import DraftStats
from splash_rollout.scheduling.cost_model import StepBatch


@dataclass(frozen=True)
class GateChoice:
    cap: int
    """Most drafted tokens per request this step (0: no speculation)."""
    reason: str
    tokens_per_s: dict[int, float]
    """Predicted tokens per second per cap considered."""


class SpeculationGate:
    def __init__(self, price: Callable[[StepBatch], float], stats: DraftStats, max_draft: int = 8,
                 prior_alpha: float = 0.5, prior_weight: float = 16.0, reprice_steps: int = 8,
                 min_observed: int = 4, explore_every: int = 4, min_verified: int = 16,
                 regime_steps: int = 16, draft_cost: Callable[[int, int], float | None] | None = None,
                 draft_layer_share: float = 0.0, explore_margin: float = 0.8) -> None:
        """price: predicted seconds of a step batch in the current layout (the cost model, corrected
        online where the engine has a correction); stats: the drafter's running record; draft_cost:
        (cap, drafting requests) -> seconds the drafter itself spends on such a step, measured (a draft
        model's chained passes), or None before it has measured any -- then each of the cap's passes
        past the first is priced at ``draft_layer_share`` of a plain step (the MTP module: one decoder
        layer of the model's; its first draft comes off the pass it runs every step anyway);
        None: drafting is free (the n-gram index's lookups are next to a step). explore_margin: a kind
        the gate did not choose is run to be measured only where it is predicted at least this share
        of the chosen one's tokens per second (a draft model's drafts are not tried where the model
        already prices them out)."""
        self.price, self.stats, self.max_draft = price, stats, max_draft
        self.draft_cost, self.draft_layer_share, self.explore_margin = draft_cost, draft_layer_share, explore_margin
        self.prior_alpha, self.prior_weight, self.reprice_steps = prior_alpha, prior_weight, reprice_steps
        self.min_observed, self.explore_every = min_observed, explore_every
        self.min_verified = min_verified
        self.regime_steps = regime_steps
        self.throughput: dict[tuple[int, bool], list[float]] = {}
        """(width, drafted) -> decayed [steps, tokens, seconds] of the steps run while requests waited."""
        self._block: tuple[int, int, int] | None = None
        """(width, cap, last step) of a run of steps measuring a kind while requests wait."""
        self._run: tuple[bool, int] = (False, 0)
        """(drafted, length) of the current run of one kind of step."""
        self._last_throughput_width: int | None = None
        """The width of the step just chosen under the throughput objective (None: the other objective)."""
        self.verified: dict[int, list[float]] = {}
        """cap -> [verified requests, drafted tokens, kept tokens, sum of kept squared] while it was in
        force (decayed)."""
        self._explored_at = -explore_every
        self.caps = tuple(sorted({0, *(2 ** i for i in range(max_draft.bit_length()) if 2 ** i <= max_draft),
                                  max_draft}))
        self.measured: dict[tuple[int, bool], float] = {}
        """(width, drafted) -> measured / predicted seconds of recent decode steps (``width``)."""
        self.observed: dict[tuple[int, bool], int] = {}
        self.log: list[dict] = []
        """Each change of cap: {step, cap, reason, tokens_per_s}."""
        self._at_call = DraftStats()
        """The drafter's record when this call started."""
        self._theta: tuple | None = None
        """(batch key, step priced, θ's seconds per cap): repriced when the batch changes or after
        ``reprice_steps`` steps."""
        self._choice = GateChoice(0, "no step yet", {})
        self._reported = 0
        """Entries of ``log`` handed out by ``take_change``."""
        self._seen: dict[tuple[int, bool], int] = {}
        """Decode steps handed to ``observe`` per (width, drafted)."""

    def new_call(self) -> None:
        """A generate call starts: its α and hit rate are measured afresh (toward every call's)."""
        self._at_call = dataclasses.replace(self.stats)

    def alpha(self) -> float:
        """Probability a drafted token is kept after the ones before it were, in this call (shrunk
        toward every call's, itself toward ``prior_alpha``)."""
        s, c = self.stats, self._at_call
        overall = (s.accepted + self.prior_alpha * self.prior_weight) / (s.accepted + s.rejections + self.prior_weight)
        kept, tried = s.accepted - c.accepted, (s.accepted + s.rejections) - (c.accepted + c.rejections)
        return (kept + overall * self.prior_weight) / (tried + self.prior_weight)

    def hit_rate(self) -> float:
        """Share of this call's requests asked that had a draft (shrunk toward every call's, itself
        toward 1/2 with two asks' weight)."""
        s, c = self.stats, self._at_call
        overall = (s.drafted_requests + 1.0) / (s.asked + 2.0)
        hits, asks = s.drafted_requests - c.drafted_requests, s.asked - c.asked
        return (hits + overall * self.prior_weight) / (asks + self.prior_weight)

    @staticmethod
    def width(requests: int) -> int:
        """The batch-width bucket of a step with ``requests`` decoding requests: 1, 2-3, 4-7, ..."""
        return max(1, int(requests)).bit_length()

    def observe(self, step: StepBatch, seconds: float, drafted: bool, weight: float = 0.3,
                every: int = 4) -> None:
        """A decode step that ran (its rows per request, context) and took ``seconds``. Priced (by θ:
        a cost) only while its kind has few measurements at its width, then one step in ``every``."""
        key = (self.width(step.size), drafted)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self.observed.get(key, 0) >= self.min_observed and self._seen[key] % every:
            return
        predicted = self.price(step)
        if predicted > 0 and seconds > 0:
            ratio = seconds / predicted
            self.measured[key] = self.measured.get(key, ratio) + weight * (ratio - self.measured.get(key, ratio))
            self.observed[key] = self.observed.get(key, 0) + 1

    def record(self, cap: int, verified: int, drafted: int, accepted: int, accepted_sq: int = 0,
               decay: float = 0.98) -> None:
        """A step that ran under ``cap``: ``verified`` requests verified ``drafted`` tokens, kept
        ``accepted`` (``accepted_sq``: the sum of each request's kept count squared)."""
        if cap <= 0 or verified <= 0:
            return
        acc = self.verified.setdefault(cap, [0.0, 0.0, 0.0, 0.0])
        for i, x in enumerate((verified, drafted, accepted, accepted_sq)):
            acc[i] = decay * acc[i] + x

    def spread(self, cap: int) -> float:
        """Variance of the tokens a drafting request keeps under ``cap`` (measured, else its mean)."""
        acc = self.verified.get(cap)
        mean = self.per_request(cap)[1]
        if acc is not None and acc[0] >= self.min_verified:
            return max(0.0, acc[3] / acc[0] - mean * mean)
        return mean

    def slowest_gain(self, cap: int, requests: int, f: float, steps_left: float) -> float:
        """Tokens per step the slowest of ``requests`` is expected to gain under ``cap`` over
        ``steps_left`` steps (a request drafts with probability ``f``)."""
        mean, var = self.per_request(cap)[1], self.spread(cap)
        m = f * mean
        v = max(0.0, f * (var + mean * mean) - m * m)
        z = math.sqrt(2.0 * math.log(requests)) if requests > 1 else 0.0
        s = max(1.0, steps_left)
        return max(0.0, m * s - z * math.sqrt(v * s)) / s

    def per_request(self, cap: int) -> tuple[float, float]:
        """(drafted rows, kept tokens) a drafting request adds under ``cap``: measured once the cap has
        ``min_verified`` verifications, else ``cap`` rows and the geometric sum over α."""
        acc = self.verified.get(cap)
        if acc is not None and acc[0] >= self.min_verified:
            return acc[1] / acc[0], acc[2] / acc[0]
        alpha = self.alpha()
        return float(cap), sum(alpha ** i for i in range(1, cap + 1))

    def draft_overhead(self, requests: int) -> float:
        """How much more than θ a drafted step of this width costs, relative to a plain one (1 until
        both were seen there)."""
        w = self.width(requests)
        if (w, True) not in self.measured or (w, False) not in self.measured:
            return 1.0
        return self.measured[(w, True)] / self.measured[(w, False)]

    def choose_for(self, step: int, scheduler) -> GateChoice:
        """The cap for the scheduler's next step: its decoding requests, the prompt rows it will run
        besides them (running prefills, then the queue's head, within the token budget) and the queue."""
        decoding = [r for r in scheduler.running if r.fork_of is None and not r.in_prefill]
        budget = max(0, scheduler.max_num_batched_tokens - len(decoding))
        prefill = 0
        prefilling = (r for r in scheduler.running if r.fork_of is None and r.in_prefill)
        for r in itertools.chain(prefilling, scheduler.waiting):
            if prefill >= budget:
                break
            prefill += r.num_uncomputed_tokens
        context = np.fromiter((r.num_tokens for r in decoding), dtype=np.int64, count=len(decoding))
        left = np.fromiter((r.max_total_tokens - r.num_tokens for r in decoding), dtype=np.int64, count=len(decoding))
        return self.choose(step, context, min(prefill, budget), queued=len(scheduler.waiting), tokens_left=left)

    def take_change(self) -> dict | None:
        """The newest ``log`` entry if the cap changed since the last call, else None."""
        if len(self.log) == self._reported:
            return None
        self._reported = len(self.log)
        return self.log[-1]

    def choose(self, step: int, context: np.ndarray, prefill_rows: int = 0, queued: int = 1,
               tokens_left: np.ndarray | None = None) -> GateChoice:
        """The cap for a step whose decoding requests have ``context`` ([B] int64) tokens, next to
        ``prefill_rows`` rows of prompt chunks, with ``queued`` requests waiting; ``tokens_left``: [B]
        tokens each may still write (for the no-queue objective)."""
        steps_left = None
        if not queued and not prefill_rows and tokens_left is not None and tokens_left.size:
            steps_left = float(np.median(tokens_left))
        self._last_throughput_width = self.width(context.size) if steps_left is None and context.size else None
        if self._last_throughput_width is not None:
            return self._by_throughput(step, context, prefill_rows)
        choice = self._logged(step, self._decided(step, context, prefill_rows, steps_left))
        other = 0 if choice.cap else min(2, self.max_draft)
        seen = self.observed.get((self.width(context.size), bool(other)), 0)
        if (context.size and not prefill_rows and seen < self.min_observed
                and step - self._explored_at >= self.explore_every
                and (not other or self.hit_rate() * context.size >= 1) and self._worth_exploring(choice, other)):
            self._explored_at = step  # measure the kind not chosen: what the correction needs
            return GateChoice(other, f"measuring a {'drafted' if other else 'plain'} step", choice.tokens_per_s)
        return choice

    def measure(self, tokens: int, seconds: float, drafted: bool, decay: float = 0.97) -> None:
        """The step just chosen wrote ``tokens`` in ``seconds``; counted toward its kind's throughput at
        its width when it ran under the throughput objective (requests waiting or prompt chunks in it)
        -- in its steady state: the first quarter of a run of one kind still carries the previous
        kind's aftermath (a drafted run's staggered finishes bring the queue's prompt chunks into the
        steps after it) and is not counted."""
        w = self._last_throughput_width
        self._run = (drafted, self._run[1] + 1) if self._run[0] == drafted else (drafted, 1)
        if w is None or seconds <= 0 or self._run[1] <= self.regime_steps // 4:
            return
        acc = self.throughput.setdefault((w, drafted), [0.0, 0.0, 0.0])
        for i, x in enumerate((1.0, float(tokens), seconds)):
            acc[i] = decay * acc[i] + x

    def measured_rate(self, width: int, drafted: bool) -> float | None:
        """Measured tokens per second of this kind of step at ``width`` while requests waited, once it
        has most of a run's steady state (decayed), else None."""
        acc = self.throughput.get((width, drafted))
        steady = self.regime_steps - self.regime_steps // 4
        if acc is None or acc[0] < 0.75 * steady:  # 12 steps decayed at 0.97 weigh ~10.3
            return None
        return acc[1] / acc[2]

    def _by_throughput(self, step: int, context: np.ndarray, prefill_rows: int) -> GateChoice:
        """While requests wait, the queue refills the batch and the call's time is its throughput. What
        a drafted step costs there is more than its rows: requests finish at staggered steps, so the
        queue's prompts are admitted in more, smaller chunks (the 256-prompt queued call: twice the
        steps carrying prompt chunks, each costing about what a larger chunk did). θ sees one step,
        not that, so here the gate measures both kinds as runs of ``regime_steps`` steps at each batch
        width and keeps the faster; θ's choice stands until both are measured."""
        w = self.width(context.size)
        modelled = self._decided(step, context, prefill_rows, None)
        if self.regime_steps <= 0:
            return self._logged(step, modelled)
        in_run = self._block is not None and self._block[0] == w and step <= self._block[2]
        if not in_run:
            best_drafted = max((c for c in self.caps if c), key=lambda c: (modelled.tokens_per_s.get(c, 0.0), -c))
            plain, drafted = self.measured_rate(w, False), self.measured_rate(w, True)
            if plain is not None and drafted is not None:
                why = (f"{int(context.size)} decoding, requests waiting: measured {plain:.0f} tok/s plain vs "
                       f"{drafted:.0f} drafted at this width")
                return self._logged(step, GateChoice(best_drafted if drafted > plain else 0, why,
                                                     modelled.tokens_per_s))
            unmeasured_cap = 0 if plain is None else best_drafted
            if (modelled.cap > 0) == (unmeasured_cap > 0):  # θ runs the unmeasured kind: measured as it runs
                return self._logged(step, modelled)
            if not self._worth_exploring(modelled, unmeasured_cap):  # priced out: not worth a run to measure
                return self._logged(step, modelled)
            self._block = (w, unmeasured_cap, step + self.regime_steps - 1)  # θ would not run it: a run of it
        cap = self._block[1]
        return self._logged(step, GateChoice(cap, f"measuring a run of {'drafted' if cap else 'plain'} steps "
                                             "while requests wait", modelled.tokens_per_s))

    def _logged(self, step: int, choice: GateChoice) -> GateChoice:
        """``choice``, its change of cap appended to ``log``."""
        if choice.cap != self._choice.cap or not self.log:
            self.log.append({"step": step, "cap": choice.cap, "reason": choice.reason,
                             "tokens_per_s": {str(k): v for k, v in choice.tokens_per_s.items()}})
        self._choice = choice
        return choice

    def _decided(self, step: int, context: np.ndarray, prefill_rows: int, steps_left: float | None) -> GateChoice:
        b = int(context.size)
        if b == 0:
            choice = GateChoice(0, "no decoding request", {})
        else:
            f = self.hit_rate()
            drafted = max(1, int(round(f * b)))  # requests that get a draft
            lengths = tuple(int(round(self.per_request(c)[0])) for c in self.caps)
            key = (b, prefill_rows, drafted, lengths)
            if self._theta is None or self._theta[0] != key or step - self._theta[1] >= self.reprice_steps:
                self._theta = (key, step, self._theta_seconds(context, prefill_rows, drafted, lengths))
            choice = self._rated(b, drafted, f, self._theta[2], steps_left)
        return choice

    def _theta_seconds(self, context: np.ndarray, prefill_rows: int, drafted: int,
                       lengths: tuple[int, ...]) -> dict[int, float]:
        """θ's seconds of the step per cap (the first ``drafted`` requests drafting that cap's
        ``lengths`` tokens)."""
        b = int(context.size)
        owners = np.zeros(b + (1 if prefill_rows else 0), dtype=np.int64)
        out = {}
        for cap, length in zip(self.caps, lengths):
            rows = np.ones(b, dtype=np.int64)
            if cap:
                rows[:drafted] += max(1, length)
            ctx = context + rows - 1  # a decode row's context is the request's tokens, drafts added
            if prefill_rows:
                rows, ctx = np.append(rows, prefill_rows), np.append(ctx, prefill_rows)
            out[cap] = self.price(StepBatch.make(ctx, rows, owners))
        return out

    def _drafting_seconds(self, cap: int, drafted: int, plain_seconds: float) -> float:
        """What the drafter spends on a step of ``cap`` for ``drafted`` requests (``draft_cost``)."""
        if self.draft_cost is None:
            return 0.0
        measured = self.draft_cost(cap, drafted)
        return measured if measured is not None else (cap - 1) * self.draft_layer_share * plain_seconds

    def _worth_exploring(self, choice: GateChoice, other: int) -> bool:
        """Whether the kind not chosen is predicted close enough to the chosen one to measure it."""
        rates = choice.tokens_per_s
        return not other or rates.get(other, 0.0) >= self.explore_margin * rates.get(choice.cap, 0.0)

    def _rated(self, b: int, drafted: int, f: float, theta: dict[int, float],
               steps_left: float | None) -> GateChoice:
        """Per cap, with θ's seconds, the measured overhead and the measured yield: tokens per second
        while requests wait; the slowest request's tokens per second once none does."""
        alpha, overhead = self.alpha(), self.draft_overhead(b)
        rates = {}
        for cap, seconds in theta.items():
            if cap:
                seconds = seconds * overhead + self._drafting_seconds(cap, drafted, theta[0])
            if steps_left is None:
                gain = self.per_request(cap)[1] if cap else 0.0
                rates[cap] = (b + drafted * gain) / seconds if seconds > 0 else 0.0
            else:
                gain = self.slowest_gain(cap, b, f, steps_left) if cap else 0.0
                rates[cap] = (1.0 + gain) / seconds if seconds > 0 else 0.0
        best = max(self.caps, key=lambda c: (rates[c], -c))
        unit = "tok/s" if steps_left is None else f"tok/s for the slowest request, {steps_left:.0f} steps left"
        why = (f"{b} decoding, alpha {alpha:.2f}, draft hit rate {f:.2f}, drafted steps at {overhead:.2f}x "
               f"θ's relative price: cap {best} predicts {rates[best]:.1f} {unit} vs {rates[0]:.1f} without")
        return GateChoice(best, why, rates)
