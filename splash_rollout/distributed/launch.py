"""Launching T ranks from one Python process: ``WorkerGroup``.

A plain Python process (a notebook, a test, ``RolloutEngine`` outside torchrun) spawns T worker
processes once; each joins the process groups and then serves calls: ``group.run(fn, *args)`` runs
``fn(ctx, *args)`` on every rank (``ctx`` is the rank's ``WorkerContext``) and returns the T results
in rank order. ``fn`` must be importable (a module-level function). Workers keep state between calls
in ``ctx.state``, which is how an engine lives in them.

Nothing waits forever: every call has a timeout, a worker that dies is noticed within a poll
interval and named in the error, and an exception on any rank comes back with its traceback. The
timeout bounds silence, not the call: a long call stays alive while its ranks send heartbeats
(``ctx.heartbeat(info)``, e.g. once per engine step), so a 10-minute rollout is fine and a rank that
stops answering is an error ``timeout_s`` after its last sign of life.

``group.interrupt`` is an event shared with every worker: the caller sets it (from any thread) to
ask a running call to stop early; functions poll ``ctx.interrupted()`` at safe points.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from splash_rollout.distributed.groups import DEFAULT_TIMEOUT_S, ProcessGroups, init_process_groups


class RankFailure(RuntimeError):
    """A rank died, timed out or raised; the message says which and why."""


@dataclass
class WorkerContext:
    """What a function run on a rank receives."""

    groups: ProcessGroups
    state: dict[str, Any] = field(default_factory=dict)
    interrupt: Any = None
    """The group's shared ``multiprocessing.Event`` (see ``WorkerGroup.interrupt``)."""
    _beat: Callable[[Any], None] | None = None
    _last_beat: float = 0.0

    def heartbeat(self, info: Any = None, min_interval_s: float = 0.2) -> None:
        """Tell the caller this rank is alive and working on the current call (rate-limited);
        ``info`` (small, picklable) shows up in ``WorkerGroup.progress``."""
        now = time.monotonic()
        if self._beat is not None and now - self._last_beat >= min_interval_s:
            self._last_beat = now
            self._beat(info)

    def interrupted(self) -> bool:
        """Whether the caller asked the running call to stop early."""
        return self.interrupt is not None and self.interrupt.is_set()

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float, threads: int,
                 calls: Any, results: Any, interrupt: Any = None) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        ctx = WorkerContext(init_process_groups(rank, world_size, "127.0.0.1", port, backend, timeout_s),
                            interrupt=interrupt)
        results.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        item = calls.get()
        if item is None:
            break
        call_id, fn, args, kwargs = item
        ctx._beat = lambda info, cid=call_id: results.put((rank, cid, ("beat", info)))
        try:
            results.put((rank, call_id, ("ok", fn(ctx, *args, **kwargs))))
        except BaseException:  # noqa: BLE001
            results.put((rank, call_id, ("error", traceback.format_exc())))
    from splash_rollout.distributed.groups import destroy_process_groups

    destroy_process_groups()


class WorkerGroup:
    """T spawned ranks serving ``run`` calls. Use as a context manager or call ``shutdown``."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads_per_rank: int | None = None, start_timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size: expected a positive integer, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._calls = [ctx.Queue() for _ in range(world_size)]
        self.interrupt = ctx.Event()
        """Set by the caller (any thread) to ask the running call to stop early; see ``WorkerContext``."""
        self.progress: dict[int, Any] = {}
        """rank -> the info of its latest heartbeat in the running call (empty between calls)."""
        self._procs = [ctx.Process(target=_worker_main, name=f"splash-rank{r}", daemon=True,
                                   args=(r, world_size, port, backend, timeout_s, threads, self._calls[r],
                                         self._results, self.interrupt))
                       for r in range(world_size)]
        self._next_call, self._closed = 0, False
        for p in self._procs:
            p.start()
        try:
            self._collect("ready", start_timeout_s, what="start")
        except BaseException:
            self.shutdown(force=True)
            raise

    def _check_alive(self, what: str) -> None:
        for rank, p in enumerate(self._procs):
            if not p.is_alive():
                raise RankFailure(f"rank {rank} died during {what} (exit code {p.exitcode})")

    def _blame_dead_rank(self, what: str, seen: str, grace_s: float = 1.0) -> None:
        """A peer's death shows up on survivors as a broken connection; name the dead rank instead."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for rank, p in enumerate(self._procs):
                if not p.is_alive():
                    raise RankFailure(f"rank {rank} died during {what} (exit code {p.exitcode}); {seen}")
            time.sleep(0.05)

    def _describe_errors(self, what: str, call_id: Any, errors: dict[int, str], grace_s: float = 3.0) -> str:
        """Wait briefly for the other ranks' errors: the first to arrive is often a peer's timeout,
        while the cause sits on another rank. Leads with an error that is not a timeout."""
        deadline = time.monotonic() + grace_s
        while len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                rank, cid, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            if cid == call_id and payload[0] == "error":  # (heartbeats are skipped)
                errors[rank] = payload[1]
        causes = [r for r, tb in errors.items() if "Timed out" not in tb and "Connection closed" not in tb]
        lead = min(causes) if causes else min(errors)
        others = "".join(f"\n  rank {r}: {tb.strip().splitlines()[-1]}" for r, tb in sorted(errors.items()) if r != lead)
        return f"rank {lead} raised during {what}:\n{errors[lead]}" + (f"\nother ranks:{others}" if others else "")

    def _collect(self, call_id: Any, timeout_s: float, what: str) -> list[Any]:
        """The T answers to one call. ``timeout_s`` bounds silence: every heartbeat restarts it."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(got))
                raise RankFailure(f"{what}: ranks {missing} did not answer (no result and no heartbeat) "
                                  f"within {timeout_s:.0f} s; last heartbeats: {self.progress or 'none'}")
            try:
                rank, cid, payload = self._results.get(timeout=min(0.5, remaining))
            except queue.Empty:
                self._check_alive(what)
                continue
            if cid == "error":
                raise RankFailure(f"rank {rank} failed to {what}:\n{payload}")
            if cid != call_id:
                continue  # a late answer to an abandoned call
            if call_id == "ready":
                got[rank] = None
                continue
            status, value = payload
            if status == "beat":
                self.progress[rank] = value
                deadline = time.monotonic() + timeout_s
                continue
            if status == "error":
                self._blame_dead_rank(what, f"rank {rank} saw: {value.strip().splitlines()[-1]}")
                raise RankFailure(self._describe_errors(what, call_id, {rank: value}))
            got[rank] = value
        return [got[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank; results in rank order."""
        if self._closed:
            raise RuntimeError("WorkerGroup: run() after shutdown()")
        self._check_alive(getattr(fn, "__name__", "call"))
        self._next_call += 1
        call_id = self._next_call
        self.progress = {}
        for q in self._calls:
            q.put((call_id, fn, args, kwargs))
        try:
            return self._collect(call_id, timeout_s or self.timeout_s, what=getattr(fn, "__name__", "call"))
        finally:
            self.progress = {}

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self, force: bool = False, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._calls:
                q.put(None)
            deadline = time.monotonic() + timeout_s
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(1.0)

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(force=exc[0] is not None)
