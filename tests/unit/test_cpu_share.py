"""CpuShare: a step's threads follow the cores other processes leave free, and the caller's count comes back."""
from __future__ import annotations

import torch

from splash_rollout.engine.cpu_share import CpuShare


class FakeCores:
    """/proc as a script: each window, how many cores were busy and how much of it was us."""

    def __init__(self) -> None:
        self.wall = self.busy = self.mine = 0.0

    def advance(self, seconds: float, busy_cores: float, our_cores: float) -> None:
        self.wall += seconds
        self.busy += busy_cores * seconds
        self.mine += our_cores * seconds

    def __call__(self):
        return self.wall, self.busy, self.mine


def test_threads_follow_the_free_cores():
    cores = FakeCores()
    share = CpuShare(threads=4, sample=cores, cores=4, window_s=0.5, clock=lambda: cores.wall)
    cores.advance(1.0, busy_cores=4.0, our_cores=4.0)  # only us
    assert share.update() == 4
    cores.advance(1.0, busy_cores=4.0, our_cores=2.0)  # another job holds two cores
    assert share.update() == 2 and share.others == 2.0
    cores.advance(0.2, busy_cores=4.0, our_cores=0.0)  # inside the window: nothing re-read
    assert share.update() == 2
    cores.advance(1.0, busy_cores=4.0, our_cores=0.6)  # everything taken: still one thread
    assert share.update() == 1
    cores.advance(1.0, busy_cores=1.0, our_cores=1.0)  # the other job left
    assert share.update() == 4
    assert [change[1] for change in share.changes] == [2, 1, 4]


def test_a_core_counts_as_taken_above_half_use():
    cores = FakeCores()
    share = CpuShare(threads=2, sample=cores, cores=2, clock=lambda: cores.wall)
    cores.advance(1.0, busy_cores=2.4, our_cores=2.0)  # 0.4 of a core: a daemon, not a job
    assert share.update() == 2
    cores.advance(1.0, busy_cores=2.0, our_cores=1.3)  # 0.7 of a core taken
    assert share.update() == 1


def test_off_without_proc_or_when_disabled():
    assert not CpuShare(threads=2, sample=lambda: None).enabled
    cores = FakeCores()
    share = CpuShare(threads=2, sample=cores, cores=2, enabled=False, clock=lambda: cores.wall)
    cores.advance(1.0, busy_cores=2.0, our_cores=0.0)
    assert share.update() == 2 and share.changes == []


def test_step_gives_the_caller_its_thread_count_back():
    before = torch.get_num_threads()
    cores = FakeCores()
    share = CpuShare(threads=2, sample=cores, cores=2, clock=lambda: cores.wall)
    cores.advance(1.0, busy_cores=2.0, our_cores=0.0)
    with share.step() as threads:
        assert threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_reads_this_machine():
    share = CpuShare(threads=1)  # the real /proc reader (Linux CI): enabled, one thread at most
    assert share.update() == 1
