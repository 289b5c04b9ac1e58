"""Launching T ranks from one Python process: ``WorkerGroup``.

A plain Python process (a script, ``python -c``, a program on stdin, a notebook, a test,
``RolloutEngine`` outside torchrun) starts T rank processes once; each joins the process groups
and then serves calls: ``group.run(fn, *args)`` runs ``fn(ctx, *args)`` on every rank (``ctx`` is
the rank's ``WorkerContext``) and returns the T results in rank order. ``fn`` must be importable
(a module-level function). Workers keep state between calls in ``ctx.state``, which is how an
engine lives in them.

Each rank is a fresh ``python -m splash_rollout.distributed.worker`` process (what torchrun does)
with the caller's ``sys.path``, working directory and environment, connected to the caller by a
private socket pair (``rank_process.py``); it never re-imports the caller's main program to start, so nothing in the
caller needs an ``if __name__ == "__main__":`` guard. The protocol is in ``worker.py``.

Nothing waits forever: every call has a timeout, a worker that dies is noticed at once (its socket
closes) and named in the error together with the tail of its stderr, and an exception on any rank
comes back with its traceback. The timeout bounds silence, not the call: a long call stays alive
while its ranks send heartbeats (``ctx.heartbeat(info)``, e.g. once per engine step), so a
10-minute rollout is fine and a rank that stops answering is an error ``timeout_s`` after its last
sign of life.

``group.interrupt`` asks a running call to stop early: the caller sets it (from any thread), every
rank's reader thread sets its own event, and functions poll ``ctx.interrupted()`` at safe points.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from splash_rollout.distributed.failure import RankFailure
from splash_rollout.distributed.groups import DEFAULT_TIMEOUT_S, ProcessGroups
from splash_rollout.distributed.rank_process import Interrupt, RankProcess, rank_argv, rank_env

__all__ = ["RankFailure", "WorkerContext", "WorkerGroup", "free_port"]


@dataclass
class WorkerContext:
    """What a function run on a rank receives."""

    groups: ProcessGroups
    state: dict[str, Any] = field(default_factory=dict)
    interrupt: threading.Event | None = None
    """Set by the rank's reader thread while the caller's ``WorkerGroup.interrupt`` is set."""
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


START_ATTEMPTS = 3
"""Starts of a group on fresh rendezvous ports before its port lost to another process is an error."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """T rank processes serving ``run`` calls. Use as a context manager or call ``shutdown``."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads_per_rank: int | None = None, start_timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size: expected a positive integer, got {world_size}")
        worker = sys.modules.get("splash_rollout.distributed.worker")
        if worker is not None and worker.loading_caller_main:
            raise RuntimeError("WorkerGroup: a rank loaded the caller's main program to find a call's function, and "
                               "that program starts ranks when imported; put its top-level code under "
                               "`if __name__ == \"__main__\":` or move the function into a module")
        self.world_size, self.timeout_s = world_size, timeout_s
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._ranks: list[RankProcess] = []
        self.interrupt = Interrupt(self._ranks)
        """Set by the caller (any thread) to ask the running call to stop early; see ``WorkerContext``."""
        self.progress: dict[int, Any] = {}
        """rank -> the info of its latest heartbeat in the running call (empty between calls)."""
        self._next_call = 0
        for attempt in range(1, START_ATTEMPTS + 1):
            # the rendezvous port is free when picked but not held: another process (a second group
            # starting on this host) can take it before rank 0 listens; then start again on a new one
            argv = rank_argv(world_size, free_port(), backend, timeout_s, threads)
            self._has_main_file = "--main-path" in argv
            try:
                self._start(argv, rank_env(), start_timeout_s)
                break
            except RankFailure as e:
                if attempt == START_ATTEMPTS or "EADDRINUSE" not in str(e):
                    raise

    def _start(self, argv: list[str], env: dict, start_timeout_s: float) -> None:
        """Spawn the ranks on ``argv`` and wait until every one is ready (shut down if one is not)."""
        self._answers: queue.Queue = queue.Queue()
        """(rank, pickled message), or (rank, None) once the rank's socket closed."""
        self._ranks.clear()
        self._closed = False
        try:
            for r in range(self.world_size):
                self._ranks.append(RankProcess(r, argv + ["--rank", str(r)], env, self._answers))
            self._collect("ready", start_timeout_s, what="start")
        except BaseException:
            self.shutdown(force=True)
            raise

    def _decode(self, rank: int, data: bytes, what: str) -> tuple:
        try:
            return pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - e.g. a class this process cannot import
            raise RankFailure(f"rank {rank}: its answer to {what} cannot be unpickled here: "
                              f"{type(e).__name__}: {e}") from e

    def _check_alive(self, what: str) -> None:
        for r in self._ranks:
            if r.exitcode is not None:
                raise r.died(what)

    def _blame_dead_rank(self, what: str, seen: str, grace_s: float = 1.0) -> None:
        """A peer's death shows up on survivors as a broken connection; name the dead rank instead."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for r in self._ranks:
                if r.exitcode is not None:
                    raise r.died(what, seen)
            time.sleep(0.05)

    def _describe_errors(self, what: str, call_id: Any, errors: dict[int, str], grace_s: float = 3.0) -> str:
        """Wait briefly for the other ranks' errors: the first to arrive is often a peer's timeout,
        while the cause sits on another rank. Leads with an error that is not a timeout."""
        deadline = time.monotonic() + grace_s
        while len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                rank, data = self._answers.get(timeout=0.2)
            except queue.Empty:
                continue
            if data is None:
                continue
            msg = self._decode(rank, data, what)
            if msg[0] == "error" and msg[1] == call_id:  # (heartbeats are skipped)
                errors[rank] = msg[2]
        causes = [r for r, tb in errors.items() if "Timed out" not in tb and "Connection closed" not in tb]
        lead = min(causes) if causes else min(errors)
        others = "".join(f"\n  rank {r}: {tb.strip().splitlines()[-1]}" for r, tb in sorted(errors.items()) if r != lead)
        return f"rank {lead} raised during {what}:\n{errors[lead]}" + (f"\nother ranks:{others}" if others else "")

    def _on_closed(self, rank: int, what: str) -> RankFailure:
        """Rank ``rank``'s socket closed: it died (or is dying); wait for its exit code and stderr."""
        proc = self._ranks[rank]
        try:
            proc.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return RankFailure(f"rank {rank} closed its connection during {what} but is still running")
        return proc.died(what)

    def _collect(self, call_id: Any, timeout_s: float, what: str) -> list[Any]:
        """The T answers to one call (``"ready"``: to start). ``timeout_s`` bounds silence: every
        heartbeat restarts it."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, Any] = {}
        while len(got) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(got))
                raise RankFailure(f"{what}: ranks {missing} did not answer (no result and no heartbeat) "
                                  f"within {timeout_s:.0f} s; last heartbeats: {self.progress or 'none'}")
            try:
                rank, data = self._answers.get(timeout=min(0.5, remaining))
            except queue.Empty:
                self._check_alive(what)
                continue
            if data is None:
                raise self._on_closed(rank, what)
            msg = self._decode(rank, data, what)
            kind = msg[0]
            if kind == "hello":
                self._check_same_package(rank, msg[1])
            elif kind == "start_error":
                raise RankFailure(f"rank {rank} failed to {what}:\n{msg[1]}")
            elif kind == "ready":
                if call_id == "ready":
                    got[rank] = None
            elif msg[1] != call_id:
                continue  # a late answer to an abandoned call
            elif kind == "beat":
                self.progress[rank] = msg[2]
                deadline = time.monotonic() + timeout_s
            elif kind == "error":
                self._blame_dead_rank(what, f"rank {rank} saw: {msg[2].strip().splitlines()[-1]}")
                raise RankFailure(self._describe_errors(what, call_id, {rank: msg[2]}))
            else:
                got[rank] = msg[2]
        return [got[r] for r in range(self.world_size)]

    @staticmethod
    def _check_same_package(rank: int, path: str) -> None:
        import splash_rollout

        ours = os.path.abspath(splash_rollout.__file__)
        if os.path.realpath(path) != os.path.realpath(ours):
            raise RankFailure(f"rank {rank} imported splash_rollout from {path}, this process from {ours}; "
                              f"check PYTHONPATH and the working directory")

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank; results in rank order."""
        return self.run_each(fn, [args] * self.world_size, timeout_s=timeout_s, **kwargs)

    def run_each(self, fn: Callable[..., Any], args_by_rank: list[tuple], timeout_s: float | None = None,
                 **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args_by_rank[r], **kwargs)`` on every rank r (each rank gets only its own
        arguments: a weight push sends each rank its own parts); results in rank order."""
        what = getattr(fn, "__name__", "call")
        if self._closed:
            raise RuntimeError("WorkerGroup: run() after shutdown()")
        if len(args_by_rank) != self.world_size:
            raise ValueError(f"{what}: {len(args_by_rank)} argument sets for {self.world_size} ranks")
        if getattr(fn, "__module__", None) == "__main__" and not self._has_main_file:
            raise ValueError(f"{what}: defined in __main__ of a program without a file (python -c, stdin, a "
                             f"notebook), which the ranks cannot import; define it in a module")
        payloads: dict[int, bytes] = {}
        try:
            for r, args in enumerate(args_by_rank):
                key = id(args)  # the same argument set (``run``) is pickled once
                payloads[key] = payloads.get(key) or pickle.dumps((fn, tuple(args), kwargs),
                                                                  protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - e.g. a lambda, a nested function, an open file
            raise TypeError(f"{what}: a WorkerGroup call needs a module-level function and picklable "
                            f"arguments: {type(e).__name__}: {e}") from e
        self._check_alive(what)
        self._next_call += 1
        call_id = self._next_call
        self.progress = {}
        try:
            for r, args in zip(self._ranks, args_by_rank):
                try:
                    r.send(("call", call_id, payloads[id(args)]))
                except OSError:
                    raise self._on_closed(r.rank, what) from None
            return self._collect(call_id, timeout_s or self.timeout_s, what=what)
        finally:
            self.progress = {}

    @property
    def alive(self) -> bool:
        return not self._closed and all(r.exitcode is None for r in self._ranks)

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    @property
    def exit_codes(self) -> list[int | None]:
        """Each rank's exit code (negative: killed by that signal), None while it runs."""
        return [r.exitcode for r in self._ranks]

    def shutdown(self, force: bool = False, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for r in self._ranks:
                try:
                    r.send(("stop",))
                except OSError:
                    pass  # already gone
        deadline = time.monotonic() + timeout_s
        for r in self._ranks:
            r.close(kill=force, timeout_s=max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(force=exc[0] is not None)
