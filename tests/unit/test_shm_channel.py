"""The shared-memory channel: every operation against what the process group would give.

Ranks are threads of this process, each with its own mapping of the same file (the channel only
shares memory, so threads exercise the same protocol as processes, without spawning)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from splash_rollout.distributed.shm_channel import ShmChannel, shm_dir, supported

pytestmark = pytest.mark.skipif(not supported(), reason="the channel publishes with x86-64 store ordering")


def run_ranks(world_size: int, fn, slot_bytes: int = 4096, timeout_s: float = 20.0):
    """fn(channel) on ``world_size`` threads, each its own channel end; returns their results."""
    path = os.path.join(shm_dir(), f"splash-test-{os.getpid()}-{threading.get_ident()}")
    channels = [ShmChannel(path, 0, world_size, slot_bytes, timeout_s, create=True)]
    try:
        channels += [ShmChannel(path, r, world_size, slot_bytes, timeout_s) for r in range(1, world_size)]
    finally:
        os.unlink(path)
    results, errors = [None] * world_size, [None] * world_size

    def body(r):
        try:
            results[r] = fn(channels[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in channels:
        c.close()
    return results, errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_adds_in_rank_order_with_the_same_bits_on_every_rank(world_size):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(37, 5, generator=gen, dtype=torch.float32) * 10 ** r for r in range(world_size)]
    expected = inputs[0].clone()
    for x in inputs[1:]:
        expected += x

    def fn(ch):
        outs = []
        for _ in range(5):  # more operations than banks: the slots are reused safely
            x = inputs[ch.rank].clone()
            outs.append(ch.all_reduce_(x))
        return outs

    results, errors = run_ranks(world_size, fn)
    assert errors == [None] * world_size
    for outs in results:
        for out in outs:
            assert torch.equal(out, expected)


def test_tensors_larger_than_a_slot_move_in_pieces():
    """A reduction of 3 slots' worth, an uneven gather and an uneven reduce-scatter of 305 rows (128 to
    a slot) through a 4 KiB slot: the same result as one big operation (a reduce-scatter gives each
    rank the bits an all-reduce gives its rows), and the rank that has no rows still takes part."""
    world_size = 3
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2500, generator=gen, dtype=torch.float32) for _ in range(world_size)]
    expected = inputs[0] + inputs[1] + inputs[2]
    sizes = [5, 0, 300]
    rows = [torch.arange(n * 8, dtype=torch.float32).view(n, 8) + 1000 * r for r, n in enumerate(sizes)]
    partials = [torch.randn(sum(sizes), 8, generator=gen, dtype=torch.float64) * 10 ** r for r in range(world_size)]

    def fn(ch):
        summed = ch.all_reduce_(inputs[ch.rank].clone())
        gathered = ch.all_gather_rows_(torch.empty(sum(sizes), 8), rows[ch.rank], sizes)
        everywhere = ch.all_reduce_(partials[ch.rank].clone())
        scattered = ch.reduce_scatter_rows_(torch.empty(sizes[ch.rank], 8, dtype=torch.float64), partials[ch.rank], sizes)
        return summed, gathered, everywhere, scattered

    results, errors = run_ranks(world_size, fn)
    assert errors == [None] * world_size
    starts = [0, 5, 5]
    for r, (summed, gathered, everywhere, scattered) in enumerate(results):
        assert torch.equal(summed, expected)
        assert torch.equal(gathered, torch.cat(rows))
        assert torch.equal(scattered, everywhere[starts[r]: starts[r] + sizes[r]])


def test_all_gather_and_uneven_all_to_all():
    world_size = 3
    send_splits = {0: [2, 0, 1], 1: [1, 1, 1], 2: [0, 3, 2]}  # rows rank r sends to each rank
    rows = {r: torch.arange(sum(s) * 4, dtype=torch.float64).view(-1, 4) + 100 * r for r, s in send_splits.items()}

    def fn(ch):
        r = ch.rank
        gathered = ch.all_gather_(torch.empty(world_size * 2, 3), torch.full((2, 3), float(r)))
        assert ch.all_gather_(torch.empty(0, 3), torch.empty(0, 3)).shape == (0, 3)  # nobody has rows
        recv = [send_splits[q][r] for q in range(world_size)]
        out = torch.empty(sum(recv), 4, dtype=torch.float64)
        assert ch.all_to_all_(out, rows[r], send_splits[r], recv)
        return gathered, out

    results, errors = run_ranks(world_size, fn)
    assert errors == [None] * world_size
    for r, (gathered, out) in enumerate(results):
        assert gathered.tolist() == [[float(q)] * 3 for q in range(world_size) for _ in range(2)]
        expected = []
        for q in range(world_size):
            start = sum(send_splits[q][:r])
            expected.append(rows[q][start: start + send_splits[q][r]])
        assert torch.equal(out, torch.cat(expected))


def test_all_to_all_that_does_not_fit_moves_nothing_on_any_rank():
    def fn(ch):
        big = 600 if ch.rank == 1 else 2  # rank 1's rows overflow its 4 KiB slot
        send = torch.ones(big, 2, dtype=torch.float64)
        out = torch.zeros(4, 2, dtype=torch.float64)
        ok = ch.all_to_all_(out, send, [big // 2, big - big // 2], [1, 1])
        after = ch.all_reduce_(torch.tensor([1.0]))  # the sequence goes on in step
        return ok, out, after

    results, errors = run_ranks(2, fn)
    assert errors == [None, None]
    for ok, out, after in results:
        assert ok is False and torch.count_nonzero(out) == 0 and after.item() == 2.0


@pytest.mark.parametrize("size", [0, 5, 4088, 4089, 20000])
def test_broadcast_of_any_length_then_the_next_operation(size):
    payload = bytes((7 * i) % 251 for i in range(size))

    def fn(ch):
        got = ch.broadcast_bytes(payload if ch.rank == 1 else None, src=1)
        again = ch.broadcast_bytes(b"next" if ch.rank == 0 else None, src=0)
        total = ch.all_reduce_(torch.tensor([float(ch.rank)]))
        return got, again, total.item()

    results, errors = run_ranks(3, fn)
    assert errors == [None] * 3
    assert all(r == (payload, b"next", 3.0) for r in results)


def test_a_missing_peer_is_an_error_that_names_it_not_a_hang():
    def fn(ch):
        if ch.rank == 1:
            return None  # never joins the operation
        ch.all_reduce_(torch.zeros(3))

    results, errors = run_ranks(2, fn, timeout_s=0.5)
    assert errors[1] is None
    assert isinstance(errors[0], TimeoutError)
    assert "rank 0 waited" in str(errors[0]) and "for rank 1" in str(errors[0]) and "all_reduce" in str(errors[0])


def test_a_peer_whose_process_exited_is_noticed_before_the_timeout():
    import subprocess
    import sys
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    waited = {}

    def fn(ch):
        if ch.rank == 1:
            ch._pids[1] = dead.pid  # rank 1's process is gone
            return None
        t = time.perf_counter()
        try:
            ch.all_reduce_(torch.zeros(3))
        finally:
            waited["s"] = time.perf_counter() - t

    results, errors = run_ranks(2, fn, timeout_s=30.0)
    assert isinstance(errors[0], TimeoutError) and "its process has exited" in str(errors[0])
    assert waited["s"] < 10.0  # well before the 30 s timeout
