"""Spawned gloo groups shared by every multi-rank test (spawning costs seconds; do it once)."""
import pytest

from splash_rollout.distributed.launch import WorkerGroup


@pytest.fixture(scope="session")
def group2():
    with WorkerGroup(2, timeout_s=60, threads_per_rank=1) as group:
        yield group


@pytest.fixture(scope="session")
def group4():
    with WorkerGroup(4, timeout_s=60, threads_per_rank=1) as group:
        yield group
