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
requests aged. There the survival curve is continued by a prior from the cap: it falls linearly
from its last value to zero at the request's cap (the residual uniform on what the cap leaves).
The estimate is then continuous in the request's age: a request past every observation gets half
of what its cap leaves, and one whose halving point lies just past the last observation gets a
residual just past it.
"""
from __future__ import annotations

import numpy as np

MIN_STOPS = 8
"""Stopped samples needed before the estimate replaces the cap."""


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
    # not halved within the observations: the tail prior, S(t) = S(t_max) (c - t) / (c - t_max) on
    # [t_max, c] for the request's cap c = max_new; its halving point t* solves S(t*) = S(g) / 2
    t_max = int(everyone[-1])
    last = float(survival[-1])
    c = np.maximum(np.asarray(max_new, dtype=np.int64).reshape(-1), t_max)
    frac = np.divide(0.5 * s_g, last, out=np.ones_like(s_g), where=last > 0)  # in (0, 1] where used
    t_star = c - (c - t_max) * np.minimum(frac, 1.0)
    tail = np.ceil(t_star - g - 1e-9).astype(np.int64)  # g <= t_max: every running age is an observation
    return np.where(found, np.minimum(residual, cap), np.clip(tail, 0, cap))
