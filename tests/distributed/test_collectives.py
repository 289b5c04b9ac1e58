"""Collective wrappers on gloo and through the shared-memory channel: uneven gathers and
exchanges, async handles, byte counts (the same whichever way the bytes travel)."""
import pytest
import torch

from splash_rollout.distributed.collectives import Comm
from splash_rollout.distributed.launch import RankFailure


def _comm(ctx, shm: bool = False):
    """The transfer group on gloo alone, or the compute group with its shared-memory channel."""
    if shm:
        if ctx.groups.compute_channel is None:
            raise RuntimeError("the compute group has no shared-memory channel on this host")
        return Comm(ctx.groups.compute, ctx.rank, ctx.world_size, channel=ctx.groups.compute_channel)
    return Comm(ctx.groups.transfer, ctx.rank, ctx.world_size)


def gather_uneven(ctx, async_op, shm=False):
    sizes = [r + 1 for r in range(ctx.world_size)]  # rank r holds r + 1 rows of 3 floats
    local = torch.full((ctx.rank + 1, 3), float(ctx.rank))
    comm = _comm(ctx, shm)
    out = comm.all_gather_uneven(local, sizes, tag="t", async_op=async_op)
    out = out.wait() if async_op else out
    return out.tolist(), comm.counter.total()


def exchange_uneven(ctx, shm=False):
    t, r = ctx.world_size, ctx.rank
    send_splits = [(r + q) % 3 for q in range(t)]  # rows rank r sends to q; zero for some pairs
    recv_splits = [(q + r) % 3 for q in range(t)]
    send = torch.cat([torch.full((n, 2), float(10 * r + q)) for q, n in enumerate(send_splits)])
    comm = _comm(ctx, shm)
    out = comm.all_to_all_uneven(send, send_splits, recv_splits, tag="kv")
    return out.tolist(), comm.counter.total("kv")


def reduce_and_objects(ctx, shm=False):
    comm = Comm(ctx.groups.control, ctx.rank, ctx.world_size, channel=ctx.groups.control_channel if shm else None)
    plan = comm.broadcast_object({"step": 3} if ctx.rank == 0 else None)
    payload = comm.broadcast_bytes(b"plan" * 700 if ctx.rank == 0 else None)
    x = torch.tensor([float(ctx.rank + 1)])
    _comm(ctx, shm).all_reduce(x)
    return plan, payload, x.item(), comm.gather_objects(ctx.rank * 2), comm.counter.total("step/control")


def boom(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one is unhappy")
    return ctx.rank


@pytest.mark.parametrize("async_op,shm", [(False, False), (True, False), (False, True)])
def test_all_gather_uneven_counts_payload_only(group4, async_op, shm):
    results = group4.run(gather_uneven, async_op, shm)
    expected = [[float(r)] * 3 for r in range(4) for _ in range(r + 1)]
    row = 3 * 4
    for rank, (rows, (sent, received)) in enumerate(results):
        assert rows == expected
        assert sent == (rank + 1) * row * 3
        assert received == (10 - rank - 1) * row


@pytest.mark.parametrize("shm", [False, True])
def test_all_to_all_uneven_routes_rows_and_counts_bytes(group4, shm):
    results = group4.run(exchange_uneven, shm)
    for r, (rows, (sent, received)) in enumerate(results):
        want = []
        for q in range(4):
            want += [[float(10 * q + r)] * 2] * ((q + r) % 3)
        assert rows == want
        assert sent == sum((r + q) % 3 for q in range(4) if q != r) * 8
        assert received == sum((q + r) % 3 for q in range(4) if q != r) * 8


@pytest.mark.parametrize("shm", [False, True])
def test_all_reduce_and_objects(group2, shm):
    for rank, (plan, payload, total, objs, (sent, received)) in enumerate(group2.run(reduce_and_objects, shm)):
        assert plan == {"step": 3} and payload == b"plan" * 700 and total == 3.0 and objs == [0, 2]
        assert (sent, received) == ((2800, 0) if rank == 0 else (0, 2800))


def test_an_exception_on_one_rank_names_it(group2):
    with pytest.raises(RankFailure, match="rank 1 raised during boom"):
        group2.run(boom)
    assert group2.run(reduce_and_objects)[0][2] == 3.0  # the group still serves


def die_on_rank_one(ctx, shm=False):
    import os
    import sys
    if ctx.rank == 1:
        print("rank one gives up", file=sys.stderr, flush=True)
        os._exit(3)
    x = torch.ones(1)
    _comm(ctx, shm).all_reduce(x)  # rank 0 waits for a peer that is gone
    return x.item()


@pytest.mark.parametrize("shm", [False, True])
def test_a_dead_rank_is_an_error_not_a_hang(shm):
    import time

    from splash_rollout.distributed.launch import WorkerGroup
    start = time.monotonic()
    with WorkerGroup(2, timeout_s=30, threads_per_rank=1) as group:
        with pytest.raises(RankFailure, match=r"rank 1 died during die_on_rank_one \(exit code 3\)(.|\n)*"
                                              r"rank 1 stderr \(last lines\):\nrank one gives up"):
            group.run(die_on_rank_one, shm)
    assert time.monotonic() - start < 60
