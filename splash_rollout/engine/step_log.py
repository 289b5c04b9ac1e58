"""What rank 0 records of each step: its phases' seconds and one row of the step log.

The step log is what the timeline, the layout driver's dwell and online correction, the benchmarks
and W&B read; building it lives here so the engine's step stays the algorithm.
"""
from __future__ import annotations

import time

from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.request_scheduler import ScheduledSeq, Scheduler


class StepClock:
    """Seconds of a step's phases, lap by lap (``control`` is measured before the step starts)."""

    def __init__(self, control_s: float) -> None:
        self.split = {"control": control_s}
        self._start = self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.split[phase] = now - self._last
        self._last = now

    @property
    def seconds(self) -> float:
        """The whole step, its control message included."""
        return self.split["control"] + self._last - self._start


def step_record(step: int, layout: str, scheduled: list[ScheduledSeq], batch: ForwardBatch, sched: Scheduler,
                clock: StepClock, control_bytes: int, threads: int, policy_s: float) -> dict:
    """One row of ``Engine.step_log`` (see its docstring)."""
    return {
        "step": step, "layout": layout, "requests": len(scheduled), "rows": batch.num_tokens,
        "prefill_rows": sum(s.num_new for s in scheduled
                            if not s.draft and (s.request.num_output_tokens == 0 or s.num_new > 1)),
        "draft_tokens": sum(len(s.draft) for s in scheduled), "verified": sum(bool(s.draft) for s in scheduled),
        "accepted_tokens": sched.accepted, "accepted_sq": sched.accepted_sq, "draft_cap": sched.draft_cap,
        "tokens_written": sched.written, "draft_sources": sched.by_source,
        "draft_positions": sched.by_position,
        "forks": sum(len(s.forks) for s in scheduled), "retracted": len(sched.retracted),
        "prefix_hit_tokens": sched.prefix_hit_tokens, "cached_tokens": sched.cached_tokens,
        "pages_used": sched.placement.pages_in_use, "pages_cached": sched.placement.pages_cached,
        "pages_promised": sched.pages_promised(),
        "pages_total": [m.num_pages for m in sched.placement.managers],
        "running": len(sched.running), "control_bytes": control_bytes, "threads": threads,
        "seconds": clock.seconds, "split_s": {**clock.split, "policy": policy_s}}
