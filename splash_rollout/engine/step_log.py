"""What rank 0 records of each step: its phases' seconds and one typed row of the step log.

The step log is what the timeline, the layout driver's dwell and online correction, the speculation
gate, the benchmarks and W&B read; its fields are documented once, here, and building a row lives
here so the engine's step stays the algorithm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

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


@dataclass
class StepRecord:
    """One row of ``Engine.step_log``: what one engine step did, as rank 0 saw it.

    Counts are over the whole replica (every rank's requests); ``pages_*`` are per rank. Every field
    but ``step`` and ``layout`` has a zero default, so a reader (or a test) may build a partial row.
    """

    step: int
    """The engine step's index (0-based, counted over the engine's life)."""
    layout: str
    """The layout the step ran in (``Layout.value``: tp / dp / dop / cp)."""
    requests: int = 0
    """Requests the step scheduled."""
    rows: int = 0
    """Token rows the forward computed (prefill chunks, decode rows, drafted rows)."""
    prefill_rows: int = 0
    """Rows of prompt (or of a chunk of one) the step computed."""
    draft_tokens: int = 0
    """Drafted tokens the step verified."""
    verified: int = 0
    """Requests whose row carried a draft."""
    accepted_tokens: int = 0
    """Drafted tokens kept."""
    accepted_sq: int = 0
    """Sum over verified requests of (tokens kept)^2: the spread the speculation gate reads."""
    draft_cap: int = 0
    """The longest draft a request could carry this step (0: speculation off)."""
    tokens_written: int = 0
    """Tokens the step appended to requests (sampled plus kept drafts)."""
    draft_sources: dict[str, list[int]] = field(default_factory=dict)
    """Per draft source (group, history, own, prompt, mtp): [verified, drafted, kept]."""
    draft_positions: list[list[int]] = field(default_factory=list)
    """Per draft position j (0-based): [drafts reaching it with all earlier tokens kept, kept at j]."""
    forks: int = 0
    """Samples forked off a prompt's leader (prefix sharing) this step."""
    retracted: int = 0
    """Requests retracted under memory pressure (their KV freed, to be prefilled again)."""
    prefix_hit_tokens: int = 0
    """Prompt tokens taken from another sample or the prefix cache instead of computed."""
    cached_tokens: int = 0
    """... of which from the prefix cache."""
    pages_used: list[int] = field(default_factory=list)
    """KV pages in use, per rank."""
    pages_cached: list[int] = field(default_factory=list)
    """KV pages the prefix cache holds, per rank."""
    pages_promised: list[int] = field(default_factory=list)
    """KV pages admission expects the running requests to still take, per rank."""
    pages_total: list[int] = field(default_factory=list)
    """KV pages in each rank's pool."""
    running: int = 0
    """Requests running after the step."""
    control_bytes: int = 0
    """Bytes of the step's control message (rank 0 to the others)."""
    threads: int = 0
    """CPU threads the step computed with (one CPU rank shares the cores)."""
    seconds: float = 0.0
    """The whole step, its control message included."""
    split_s: dict[str, float] = field(default_factory=dict)
    """``seconds`` by phase: control, schedule, batch, forward, sample, ...; ``mtp`` (the MTP drafter's
    passes), ``policy`` (the layout driver's time consulting and feeding the policy since the previous
    row, mostly inside control)."""
    speculation: dict | None = None
    """The speculation gate's note where it changed the draft cap before this step, else None."""


def step_record(step: int, layout: str, scheduled: list[ScheduledSeq], batch: ForwardBatch, sched: Scheduler,
                clock: StepClock, control_bytes: int, threads: int, policy_s: float,
                speculation: dict | None) -> StepRecord:
    """One row of ``Engine.step_log``."""
    return StepRecord(
        step=step, layout=layout, requests=len(scheduled), rows=batch.num_tokens,
        prefill_rows=sum(s.num_new for s in scheduled
                         if not s.draft and (s.request.num_output_tokens == 0 or s.num_new > 1)),
        draft_tokens=sum(len(s.draft) for s in scheduled), verified=sum(bool(s.draft) for s in scheduled),
        accepted_tokens=sched.accepted, accepted_sq=sched.accepted_sq, draft_cap=sched.draft_cap,
        tokens_written=sched.written, draft_sources=sched.by_source, draft_positions=sched.by_position,
        forks=sum(len(s.forks) for s in scheduled), retracted=len(sched.retracted),
        prefix_hit_tokens=sched.prefix_hit_tokens, cached_tokens=sched.cached_tokens,
        pages_used=sched.placement.pages_in_use, pages_cached=sched.placement.pages_cached,
        pages_promised=sched.pages_promised(), pages_total=[m.num_pages for m in sched.placement.managers],
        running=len(sched.running), control_bytes=control_bytes, threads=threads,
        seconds=clock.seconds, split_s={**clock.split, "policy": policy_s}, speculation=speculation)
