"""Admission: how much KV growth the scheduler expects of each request, and so how many it admits.

A request may grow to prompt + max_new_tokens, but RL samples mostly stop far below their cap.
Reserving the cap for every request (``worst_case``) means a running request never meets a full
pool, at the price of a wide phase that admits a fraction of what the pool could hold. ``optimistic``
admission expects each request to produce ``ratio`` of the tokens it may still produce:

    expected_total = num_tokens + ceil(ratio * (max_total_tokens - num_tokens))

``ratio`` starts at ``init_ratio`` and decays by ``(init_ratio - min_ratio) / decay_steps`` per step
towards ``min_ratio`` while memory holds; a step that has to retract requests (free their pages,
keep their tokens, queue them again) raises it by ``retract_bump`` (at most 1), so admission backs
off after pressure; it starts afresh with every batch that arrives at an idle engine (a new rollout
step: its own lengths, and a resumed run admits exactly like an uninterrupted one). ``worst_case``
is the same rule with ``ratio`` fixed at 1.
Every rank's scheduler replica runs the same estimate, so they admit the same requests; the GPU-scale
simulator runs it too, so its drains admit like the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

ADMISSION_MODES = ("optimistic", "worst_case")


@dataclass(frozen=True)
class AdmissionSettings:
    mode: str = "optimistic"
    """``optimistic`` (expected growth, retraction when a step runs out of pages) or ``worst_case``
    (every request's cap is held for it; never retracts)."""
    init_ratio: float = 0.7
    min_ratio: float = 0.1
    decay_steps: int = 200
    """Steps for the ratio to decay from ``init_ratio`` to ``min_ratio`` while nothing is retracted."""
    retract_bump: float = 0.2

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"admission.mode: expected one of {ADMISSION_MODES}, got {self.mode!r}")
        if not 0.0 <= self.min_ratio <= self.init_ratio <= 1.0:
            raise ValueError(f"admission: expected 0 <= min_ratio <= init_ratio <= 1, got "
                             f"min_ratio={self.min_ratio}, init_ratio={self.init_ratio}")
        if self.decay_steps < 1:
            raise ValueError(f"admission.decay_steps: expected >= 1, got {self.decay_steps}")
        if not 0.0 <= self.retract_bump <= 1.0:
            raise ValueError(f"admission.retract_bump: expected in [0, 1], got {self.retract_bump}")


class GrowthEstimate:
    """The replica's current expectation of growth (the ratio above) and its updates."""

    def __init__(self, settings: AdmissionSettings = AdmissionSettings()) -> None:
        self.settings = settings
        self.reset()

    @property
    def optimistic(self) -> bool:
        return self.settings.mode == "optimistic"

    def expected_total(self, num_tokens: int, max_total_tokens: int) -> int:
        """Tokens a request holding ``num_tokens`` is expected to reach (at least one more while it runs)."""
        left = max(0, max_total_tokens - num_tokens)
        return min(max_total_tokens, num_tokens + max(1, math.ceil(self.ratio * left))) if left else num_tokens

    def reset(self) -> None:
        """A new batch of requests: its own length distribution, learned afresh."""
        self.ratio = 1.0 if self.settings.mode == "worst_case" else self.settings.init_ratio

    def stepped(self) -> None:
        s = self.settings
        if self.optimistic:
            self.ratio = max(s.min_ratio, self.ratio - (s.init_ratio - s.min_ratio) / s.decay_steps)

    def retracted(self) -> None:
        if self.optimistic:
            self.ratio = min(1.0, self.ratio + self.settings.retract_bump)
