"""Fixtures and collection rules every test directory shares.

Under ``pytest -n 2 --dist loadgroup`` (pytest-xdist) the multi-rank tests run one after another on
one worker -- each spawns its own ranks, so two of them at once would put four busy ranks on two
cores -- while the single-process tests share out over both workers on one torch thread each.
"""
import os
import sys

import pytest

DISTRIBUTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed") + os.sep


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(DISTRIBUTED):
            item.add_marker(pytest.mark.xdist_group("ranks"))


if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker shares the cores with the other one
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def no_leftover_process_group():
    """A test that builds a Trainer in this process joins a 1-rank default process group; destroy
    it afterwards so later tests start from no group."""
    import torch.distributed as dist

    was = dist.is_initialized()
    yield
    if not was and dist.is_initialized():
        dist.destroy_process_group()
        groups = sys.modules.get("deepspeed.utils.groups")  # DeepSpeed caches a clone of the world group
        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release()


@pytest.fixture
def one_torch_thread():
    """Tiny models on one torch thread: more threads only contend (and much more so when the
    cores are shared)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
