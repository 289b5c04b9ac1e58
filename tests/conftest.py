"""Fixtures every test directory shares."""
import pytest


@pytest.fixture
def no_leftover_process_group():
    """A test that builds a Trainer in this process joins a 1-rank default process group; destroy
    it afterwards so later tests start from no group."""
    import torch.distributed as dist

    was = dist.is_initialized()
    yield
    if not was and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_torch_thread():
    """Tiny models on one torch thread: more threads only contend (and much more so when the
    cores are shared)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
