"""Requests that arrive while others run: a serving loop over the engine's ranks, and a handle per request.

Why: RL frameworks drive their rollout engines one trajectory at a time -- an agent loop awaits each
turn, a server answers each HTTP request -- and a request must not wait for a whole batch to end
before it can start. ``RolloutEngine.submit`` hands a prompt's group of ``n`` samples to the loop and
returns a ``RequestHandle`` at once; the loop, a thread in the engine's process, serves the ranks in
polls of ``poll_steps`` steps (``Engine.serve(max_steps=...)``: what runs stays running between
polls), and at each poll's start the requests submitted since join the running batch -- in whatever
layout it is, across switches -- and the aborted ones leave. After each poll every handle gets its
new tokens (``stream``) and the finished ones their group (``result`` / ``await``).

A request's tokens depend on its seed and its history, never on what it ran beside, so a submitted
request gives the samples ``generate`` gives for the same seeds. ``generate`` itself, called while
the loop has requests in flight, goes through it too (its requests join the others); when nothing
is in flight it serves its call directly, as before. The loop and every other call that talks to
the ranks take turns (``RolloutEngine._ranks_lock``): a poll at a time. A failure on the ranks fails
every handle in flight with that error and breaks the engine, as a failed ``generate`` does.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from splash_rollout.engine.request import Request
from splash_rollout.engine.step_log import StepRecord
from splash_rollout.rollout.group_handle import GroupHandle, TokenDelta
from splash_rollout.rollout.ranks import RequestRecord, RequestResult, worker_serve_async
from splash_rollout.rollout.types import Sample, SampleGroup

TOTALS = ("prefill_rows", "cached_tokens", "tokens_written", "switches")
STEP_LOG_KEEP = 4096
"""Steps of the loop's rolling log kept for ``/timeline`` and the metrics (older ones are dropped)."""
RATE_STEPS = 64
"""The tokens-per-second a loop reports is over its last this many steps."""


class RequestHandle(GroupHandle):
    """A prompt submitted to this engine: its samples are requests of the serving loop (one id each)."""

    def __init__(self, loop: "ServingLoop", requests: list[Request],
                 make_group: Callable[[dict, list[list[int]], int], SampleGroup]) -> None:
        """make_group(results by request id, per sample the weight version of each token, the version
        the group finished under) -> the group."""
        super().__init__(list(requests[0].prompt_ids) if requests else [], len(requests),
                         lambda samples: loop.abort([self.request_ids[i] for i in samples]))
        self.requests, self._make_group = requests, make_group
        self.request_ids = [r.request_id for r in requests]
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._results: dict[int, RequestResult] = {}

    def _progress(self, request_id: int, start: int, token_ids: list[int], logprobs: list[float],
                  version: int) -> None:
        """A running sample's tokens from output position ``start`` on, sampled under ``version``."""
        self._advance(self._index[request_id], start, token_ids, logprobs, version)

    def _finish(self, result: RequestResult, version: int) -> bool:
        """A sample ended (its last tokens sampled under ``version``); True once the whole group has."""
        self._results[result.request_id] = result
        self._advance(self._index[result.request_id], 0, result.output_ids, result.output_logprobs, version,
                      result.finish_reason)
        if len(self._results) < len(self.requests):
            return False
        self._complete(self._make_group(self._results, self._versions, version))
        return True

    def _name(self) -> str:
        return f"request {self.request_ids}"


@dataclass
class LoopLog:
    """What the loop's polls logged (rank 0's step, switch and decision records), rolling."""

    steps: list[StepRecord] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    total_steps: int = 0
    """Steps logged since the loop started (``steps`` keeps the last ``STEP_LOG_KEEP``)."""
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0))
    """Since the loop started, summed over its steps: prompt rows computed (``prefill_rows``), prompt
    tokens taken from the prefix cache instead (``cached_tokens``), tokens written, switches."""
    state: dict[str, Any] = field(default_factory=dict)
    """The engine after the last poll: running and waiting requests, layout, KV pages."""

    def add(self, steps, switches, decisions) -> None:
        self.steps.extend(steps)
        self.switches.extend(switches)
        self.decisions.extend(decisions)
        self.total_steps += len(steps)
        for s in steps:
            for key in ("prefill_rows", "cached_tokens", "tokens_written"):
                self.totals[key] += getattr(s, key)
        self.totals["switches"] += len(switches)
        del self.steps[:-STEP_LOG_KEEP]
        del self.switches[:-STEP_LOG_KEEP]
        del self.decisions[:-STEP_LOG_KEEP]

    def timeline(self, since: int | None = None) -> dict:
        """The layout timeline (``/timeline``'s JSON) of every step kept, or of those logged after
        ``since`` (an earlier ``total_steps``) with the switches and decisions from its first step on."""
        from splash_rollout.rollout.call_timeline import build_timeline

        if since is None:
            return build_timeline(self.steps, self.switches, self.decisions).to_dict()
        steps = list(self.steps[-(self.total_steps - since):]) if self.total_steps > since else []
        first = steps[0].step if steps else None
        later = (lambda rows: [r for r in rows if first is not None and r.get("step", -1) >= first])
        return build_timeline(steps, later(self.switches), later(self.decisions)).to_dict()


class ServingLoop:
    """The thread that serves submitted requests on the engine's ranks (see the module doc)."""

    def __init__(self, engine, poll_steps: int = 1, own_thread: bool = True) -> None:
        """``own_thread``: start the loop's thread now; False: the caller runs ``run()`` in a thread of
        its own (``RolloutEngine.serve_here``)."""
        if not isinstance(poll_steps, int) or isinstance(poll_steps, bool) or poll_steps < 1:
            raise ValueError(f"poll_steps: expected an integer >= 1, got {poll_steps!r}")
        self.engine, self.poll_steps = engine, poll_steps
        self.log = LoopLog()
        self._cond = threading.Condition()
        self._pending: list[tuple[Request, RequestHandle]] = []
        self._aborts: set[int] = set()
        self._active: dict[int, RequestHandle] = {}
        """request id -> its handle, from submission until it ends."""
        self._stopping = False
        self.error: BaseException | None = None
        """What ended the loop (a failure on the ranks), None while it serves."""
        self.tokens_out = 0
        """Tokens handed to handles since the loop started."""
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()
        if own_thread:
            self._thread = threading.Thread(target=self.run, name="splash-serving-loop", daemon=True)
            self._thread.start()

    # ---- callers (any thread) ---------------------------------------------------------------------
    def submit(self, requests: list[Request], handle: RequestHandle) -> RequestHandle:
        with self._cond:
            if self.error is not None or self._stopping:
                raise RuntimeError(f"serving loop: not serving ({self.error or 'shut down'})")
            for r in requests:
                self._pending.append((r, handle))
                self._active[r.request_id] = handle
            self._cond.notify()
        return handle

    def abort(self, request_ids) -> int:
        """End these requests at the next step boundary; returns how many of them were in flight."""
        with self._cond:
            live = [rid for rid in request_ids if rid in self._active]
            self._aborts.update(live)
            self._cond.notify()
            return len(live)

    def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        with self._cond:
            self._aborts.update(self._active)
            self._cond.notify()
            return len(self._active)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        with self._cond:
            return len(self._active)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Abort what is in flight, let the loop hand the aborted samples back, and end the thread."""
        self.abort_all()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._ended.wait(timeout_s)

    # ---- the loop's thread ------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stop()`` (and what is in flight has been handed back) or a failure on the ranks."""
        try:
            self._serve()
        finally:
            self._ended.set()

    def _serve(self) -> None:
        self.engine._enter_compute_thread()
        while True:
            with self._cond:
                while not (self._pending or self._aborts or self._active or self._stopping):
                    self._cond.wait(0.5)  # a timeout: a signal handler of the main thread gets to run
                if self._stopping and not self._active and not self._pending:
                    return
                batch, self._pending = self._pending, []
                aborts, self._aborts = sorted(self._aborts), set()
            records = [RequestRecord.of(r) for r, _ in batch]
            try:
                out, version = self.engine._poll_ranks(records, aborts, self.poll_steps)
            except BaseException as error:  # noqa: BLE001 - every handle in flight hears it
                with self._cond:
                    self.error = error
                    handles = set(self._active.values()) | {h for _, h in batch}
                    self._active.clear()
                for h in handles:
                    h._fail(error)
                return
            self._deliver(out, batch, version)

    def _deliver(self, out, batch: list, version: int) -> None:
        results, progress, steps, switches, decisions, state, refused = out
        self.log.add(steps, switches, decisions)
        self.log.state = state
        refused_handles = {}
        for rid, pages in refused:
            with self._cond:
                handle = self._active.pop(rid, None)
            if handle is not None:
                refused_handles[handle] = pages
        for handle, pages in refused_handles.items():
            with self._cond:
                for rid in handle.request_ids:
                    self._active.pop(rid, None)
            handle._fail(ValueError(
                f"prompts[0]: needs {pages} KV pages (prompt + max_new_tokens), more than one rank's pool holds in "
                f"any layout this engine may use; lower max_new_tokens or raise memory.memory_budget_gib / "
                f"memory.num_pages"))
        for _, handle in batch:
            if handle not in refused_handles:
                handle._admit()
        for rid, (start, tokens, logprobs) in progress.items():
            handle = self._active.get(rid)
            if handle is not None:
                handle._progress(rid, start, tokens, logprobs, version)
        for res in results:
            with self._cond:
                handle = self._active.pop(res.request_id, None)
            if handle is not None:
                self.tokens_out += len(res.output_ids)
                handle._finish(res, version)


def sample_group(index: int, requests: list[Request], results: dict[int, RequestResult],
                 versions: list[list[int]], version: int) -> SampleGroup:
    """A handle's group from its requests' results, each token's weight version and the version the
    group finished under (each sample's ``weight_version``)."""
    samples = []
    for r, v in zip(requests, versions):
        res = results[r.request_id]
        samples.append(Sample(list(r.prompt_ids), list(res.output_ids), list(res.output_logprobs), res.finish_reason,
                              r.spec.seed, version, list(v), r.spec, res.routing))
    return SampleGroup(index, samples)


__all__ = ["RequestHandle", "ServingLoop", "TokenDelta", "sample_group", "worker_serve_async"]
