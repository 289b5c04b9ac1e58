"""How many more tokens a running request will decode: the policy's switch horizon.

A switch pays when the candidate layout's lead per step, times the steps the batch keeps running,
exceeds its cost (policy.py). ``max_new_tokens - generated`` bounds those steps, but RL samples stop
at EOS long before the cap (GRPO run on glm5-nano: cap 112, median response 16 tokens), so the bound
overstates a tail switch's saving several-fold. This module estimates the residual length from the
responses of the same call that have already ended, with the Kaplan-Meier product-limit estimator:
a sample that stopped is an event at its length; one still running (or cut at its cap) is censored
at its current length -- it is known to be at least that long, not how much longer. The estimate is
the median residual life, ``t* - g`` with ``S(t*) <= S(g) / 2``; with too few stops to say, the cap
is used.

Past the longest length observed (stopped, censored or running), the samples say nothing more, and
a running request that has outlived every one of them would otherwise get the whole cap while one
a token younger gets the distance to the next stop: the horizon jumped between the two by 40x as
requests aged. There the survival curve is continued at the hazard the samples showed over the later half of the
observed range (stops per token at risk there; the whole range when none stopped in it):
S(t) = S(t_max) exp(-h (t - t_max)), capped at the request's cap. A request past every observation
gets ln 2 / h, and one whose halving point lies just past the last observation a residual just
past it; as a request ages past the last stop its estimate steps by at most about ln 2 / h (the
product-limit steps where few are at risk), not to the cap. (A prior that spreads what is
left of the cap uniformly was tried first: for a long-tailed response length it handed every old
request about half of its cap, thousands of steps, and the batch's median still flipped between
the young requests' hundreds and that.)
"""
from __future__ import annotations

import numpy as np

MIN_STOPS = 8
"""Stopped samples needed before the estimate replaces the cap."""


def _late_hazard(times: np.ndarray, deaths: np.ndarray, at_risk: np.ndarray, everyone: np.ndarray) -> float:
    """Stops per token at risk over the later half of the observed range [t_max / 2, t_max]: the
    events there over the tokens the samples alive in it spent in it; over the whole range when
    none stopped in the later half (0 only without any stop)."""
    t_max = float(everyone[-1])
    for lo in (0.5 * t_max, 0.0):
        events = float(deaths[times >= lo].sum())
        exposure = float(np.clip(everyone - lo, 0.0, None).sum())
        if events and exposure > 0:
            return events / exposure
    return 0.0


def residual_tokens(generated, max_new, stopped_lengths, censored_lengths=(), min_stops: int = MIN_STOPS
                    ) -> np.ndarray:
    """Median residual decode length per request.

    generated, max_new: [R] tokens each request has produced and may produce in all.
    stopped_lengths: [E] response lengths of samples of this call that ended by EOS / a stop string.
    censored_lengths: [C] lengths known only as lower bounds (running requests, samples cut at their
    cap); the running requests themselves are added from ``generated``.
    Returns [R] int64, each within [0, max_new - generated].
    """
    g = np.asarray(generated, dtype=np.int64).reshape(-1)
    cap = np.maximum(np.asarray(max_new, dtype=np.int64).reshape(-1) - g, 0)
    stops = np.asarray(stopped_lengths, dtype=np.int64).reshape(-1)
    if stops.size < min_stops or g.size == 0:
        return cap
    censored = np.concatenate([np.asarray(censored_lengths, dtype=np.int64).reshape(-1), g])
    times, deaths = np.unique(stops, return_counts=True)  # event times (increasing), stops at each
    everyone = np.sort(np.concatenate([stops, censored]))
    at_risk = everyone.size - np.searchsorted(everyone, times, side="left")  # lengths >= each time
    survival = np.cumprod(1.0 - deaths / at_risk)  # S(t) just after each event time, non-increasing
    # S(g): survival just after the last event time <= g (1 before the first)
    k = np.searchsorted(times, g, side="right") - 1
    s_g = np.where(k >= 0, survival[np.clip(k, 0, None)], 1.0)
    # first event time where S has halved since g (the 1e-12: products of fractions); S being
    # non-increasing and S(g) > that threshold, it lies after g
    half = np.searchsorted(-survival, -(0.5 * s_g + 1e-12), side="left")
    found = (half < times.size) & (s_g > 1e-11)
    residual = times[np.minimum(half, times.size - 1)] - g
    # not halved within the observations: the tail, S(t) = S(t_max) exp(-h (t - t_max)) past t_max
    # at the hazard h seen over the later half of the observed range (Nelson-Aalen increments over
    # the time at risk there); its halving point t* solves S(t*) = S(g) / 2, capped as always
    t_max = int(everyone[-1])
    last = float(survival[-1])
    h = _late_hazard(times, deaths, at_risk, everyone)
    frac = np.divide(0.5 * s_g, last, out=np.ones_like(s_g), where=last > 0)  # in (0, 1] where used
    t_star = t_max + np.log(1.0 / np.minimum(frac, 1.0)) / h if h > 0 else np.full(g.shape, np.inf)
    tail = np.ceil(np.minimum(t_star - g, cap) - 1e-9).astype(np.int64)  # g <= t_max: ages are observations
    return np.where(found, np.minimum(residual, cap), np.clip(tail, 0, cap))


def quantile(values: np.ndarray, q: float) -> float:
    """``np.quantile(values, q)`` (linear interpolation) of a [B] array, 0 when empty, without
    np.quantile's per-call overhead (a tenth of a decision's time at small B)."""
    if not values.size:
        return 0.0
    v = np.sort(values)
    pos = q * (v.size - 1)
    lo = int(pos)
    hi = min(lo + 1, v.size - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))
