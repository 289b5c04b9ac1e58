"""When the driver consults the policy: at events that can change its answer, not at every step.

Between two events the inputs of a decision move little: the running batch decodes one token per
request, the queue waits, the horizon shrinks by one. A new decision is due when one of them moves
for real, measured against the batch the last decision saw (B, at least 1): ``batch_fraction`` x B
requests admitted from the queue, or finished, or the running batch grown or shrunk by that many; a
switch the policy chose was deferred (decide again rather than retry blindly); the driver asked for
one (``ask``: the measured steps of a stay may end its dwell); a new call -- and at
least every ``every_steps`` steps, so the dwell and the horizon are looked at as they run out. At
B = 4 one finished request is an event; at B = 200 it takes 50, and the admissions and finishes of
a wide phase cost a decision every few steps instead of one per step. ``due`` names the event, or
returns None.
"""
from __future__ import annotations


class DecisionEvents:
    def __init__(self, every_steps: int = 16, batch_fraction: float = 0.25) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps: expected a positive integer, got {every_steps}")
        if not 0.0 < batch_fraction <= 1.0:
            raise ValueError(f"batch_fraction: expected a value in (0, 1], got {batch_fraction}")
        self.every_steps = every_steps
        self.batch_fraction = batch_fraction
        self._last: tuple[int, int, int] | None = None
        """(step, running, waiting) at the last decision; None: the next boundary decides."""
        self._finished = 0
        """Requests that finished since the last decision."""
        self._asked: str | None = None
        """An event the driver named (``ask``), due at the next boundary."""

    def reset(self) -> None:
        """A new call (new requests, a new length distribution): the next boundary decides."""
        self._last = None
        self._finished = 0
        self._asked = None

    def ask(self, reason: str) -> None:
        """Make a decision due at the next boundary, for ``reason`` (the event's name)."""
        self._asked = reason

    def finished(self, count: int) -> None:
        self._finished += int(count)

    def due(self, step: int, running: int, waiting: int, deferred: bool = False) -> str | None:
        """The event that makes a decision due before ``step`` (running / waiting: requests now), or None."""
        if self._last is None:
            return "call"
        last_step, last_running, last_waiting = self._last
        if deferred:
            return "deferred"
        if self._asked is not None:
            return self._asked
        moved = self.batch_fraction * max(last_running, 1)  # requests that make a change real
        if last_waiting - waiting >= moved:
            return "admitted"
        if self._finished >= moved:
            return "finished"
        if abs(running - last_running) >= moved:
            return "batch moved"
        if step - last_step >= self.every_steps:
            return "every"
        return None

    def decided(self, step: int, running: int, waiting: int) -> None:
        """Record the state a decision was made on."""
        self._last = (int(step), int(running), int(waiting))
        self._finished = 0
        self._asked = None
