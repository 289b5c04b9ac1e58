"""Peak anonymous memory of a process and its children while something runs: a sampler thread over /proc.

Why anonymous memory: a rank that loads its weights from memory-mapped safetensors files touches the
files' pages, which the kernel counts in the process's resident set (``RssFile``) although they are
page cache -- shared by every rank on the host, reclaimable, and gone from the process once it
unmaps the file. What a rank really holds is ``RssAnon``. The kernel keeps no peak of it, so a
thread reads ``/proc/PID/status`` of this process and of every child it starts (the engine's ranks)
every ``interval_s`` and keeps each one's largest reading. A spike shorter than the interval can be
missed; a copy of the sizes that matter here (tens of MB and up) lasts longer than that.
"""
from __future__ import annotations

import os
import threading
import time


def anon_bytes(pid: int) -> int | None:
    """``RssAnon`` of a process, bytes (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """The resident set of a process, bytes (anonymous and file pages)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


class AnonPeak:
    """Samples this process and its children from ``start()`` to ``stop()``; ``peaks`` maps each pid
    seen to its largest ``RssAnon``. Use as a context manager."""

    def __init__(self, interval_s: float = 0.002, rescan_s: float = 0.05) -> None:
        self.interval_s, self.rescan_s = interval_s, rescan_s
        self.root = os.getpid()
        self.baseline = anon_bytes(self.root) or 0
        """This process's RssAnon when the probe was made."""
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anon-peak", daemon=True)

    def _run(self) -> None:
        pids, next_scan = [self.root], 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_scan:
                pids = [self.root] + children(self.root)
                next_scan = now + self.rescan_s
            for pid in pids:
                value = anon_bytes(pid)
                if value is not None and value > self.peaks.get(pid, 0):
                    self.peaks[pid] = value
            time.sleep(self.interval_s)

    def start(self) -> "AnonPeak":
        self._thread.start()
        return self

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks

    def __enter__(self) -> "AnonPeak":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
