"""CpuShare: compute each step with as many threads as there are cores nobody else is using.

Why it exists: every product, attention call and expert block of a CPU step is an OpenMP parallel
region, and a region ends at a barrier that waits for its slowest thread. When another process
(an RL trainer, a second engine, a test run) keeps the same cores busy, one of the engine's threads
is regularly descheduled, and each of the ~100 barriers of a step then waits for a scheduler time
slice instead of microseconds. Measured on 2 cores with a 2-thread job beside the engine: the tail
workload decoded at 7-21 tokens/s with 2 threads and 89-125 tokens/s with 1 -- far below a fair
share with 2, about a fair share with 1. One thread has no barrier to miss.

So the engine watches the cores it may run on (its CPU affinity): every ``window_s`` it reads how
busy they were (``/proc/stat``) and how much of that was its own process (``/proc/self/stat``); the
rest is other processes. A step then uses ``min(threads, free cores)`` threads, at least one, and
the caller's thread count is restored after the step. Ranks of one engine on one host see each
other as other processes, which is what they are to the cores: T ranks of t threads on T*t cores
keep t each. Where ``/proc`` is missing (not Linux), the share is off and ``threads`` is used.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator

import torch

Sample = tuple[float, float, float]
"""(wall seconds, busy seconds of the watched cores, this process's CPU seconds)."""


def _proc_sample(cores: frozenset[int]) -> Callable[[], Sample | None]:
    """A reader of the watched cores' busy time and this process's CPU time, or one that returns None
    where /proc is not readable."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def sample() -> Sample | None:
        try:
            with open("/proc/stat") as f:
                busy = 0
                for line in f:
                    if not line.startswith("cpu") or line.startswith("cpu "):
                        continue
                    name, *fields = line.split()
                    if int(name[3:]) in cores:
                        values = [int(v) for v in fields[:8]]
                        busy += sum(values) - values[3] - values[4]  # everything but idle and iowait
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            mine = int(own[11]) + int(own[12])  # utime + stime of every thread of this process
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), busy / tick, mine / tick

    return sample


class CpuShare:
    """Threads for the next step: ``threads`` while the cores are free, fewer while others hold them."""

    def __init__(self, threads: int, enabled: bool = True, window_s: float = 0.5,
                 sample: Callable[[], Sample | None] | None = None, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threads < 1:
            raise ValueError(f"CpuShare: threads must be >= 1, got {threads}")
        affinity = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                             else range(os.cpu_count() or 1))
        self.threads = threads
        """The most threads a step may use (the caller's count when the engine was built)."""
        self.cores = cores if cores is not None else len(affinity)
        self.window_s = window_s
        self._sample = sample or _proc_sample(affinity)
        self._clock = clock
        """Wall seconds on the samples' clock: a window is checked without reading /proc."""
        self._last = self._sample() if enabled else None
        self.enabled = enabled and self._last is not None
        self.current = threads
        """Threads the steps use now."""
        self.others = 0.0
        """Cores other processes kept busy over the last window."""
        self.changes: list[tuple[float, int, float]] = []
        """(time, new thread count, other processes' cores) at every change, for the run's record."""

    def update(self) -> int:
        """Re-read the cores once a window has passed; returns the threads for the next step."""
        if not self.enabled or self._clock() - self._last[0] < self.window_s:
            return self.current
        now = self._sample()
        if now is None:
            return self.current
        wall, busy, mine = (b - a for a, b in zip(self._last, now))
        self._last = now
        self.others = max(0.0, (busy - mine) / wall)
        # a core counts as taken when another process used more than half of it
        free = self.cores - int(self.others + 0.5)
        wanted = max(1, min(self.threads, free))
        if wanted != self.current:
            self.current = wanted
            self.changes.append((now[0], wanted, round(self.others, 2)))
        return self.current

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """Run a step with ``update()`` threads, then give the caller its own count back."""
        threads = self.update()
        before = torch.get_num_threads()
        if threads != before:
            torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
