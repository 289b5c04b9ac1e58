"""Microbenchmarks one rank runs for the calibration: matmul rate, memory read bandwidth, and the
latency / bandwidth of each collective the layouts use, over the real process groups.

Each probe repeats its operation and keeps the median; collectives are timed on the compute group
after a barrier, so every rank measures the same operation. A collective's cost model is
``latency + bytes / bandwidth``; two payload sizes give both numbers.
"""
from __future__ import annotations

import statistics
import time

import torch

from splash_rollout.distributed.collectives import Comm

SMALL, LARGE = 1 << 10, 4 << 20  # bytes per rank


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(n: int = 512, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2.0 * n**3 / _median_seconds(lambda: a @ b, repeats)


def attention_flops(rows: int = 16, heads: int = 8, rank: int = 64, keys: int = 1024, repeats: int = 10) -> float:
    q, c = torch.randn(rows, heads, rank), torch.randn(keys, rank)
    return 2.0 * 2 * rows * heads * rank * keys / _median_seconds(
        lambda: torch.einsum("nhs,sr->nhr", torch.einsum("nhr,sr->nhs", q, c).softmax(-1), c), repeats)


def read_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    x = torch.ones(nbytes // 4)
    return nbytes / _median_seconds(lambda: x.sum(), repeats)


def collective_costs(comm: Comm, repeats: int = 10) -> dict[str, tuple[float, float]]:
    """{name: (latency_s, bandwidth_Bps)} for all_gather, all_to_all and all_reduce."""
    t = comm.world_size
    out = {}
    for name in ("all_gather", "all_to_all", "all_reduce"):
        seconds = []
        for size in (SMALL, LARGE):
            rows = size // 4
            x = torch.ones(rows)

            def op():
                if name == "all_gather":
                    comm.all_gather_uneven(x, [rows] * t, tag="calibrate")
                elif name == "all_to_all":
                    comm.all_to_all_uneven(x[: rows // t * t], [rows // t] * t, [rows // t] * t, tag="calibrate")
                else:
                    comm.all_reduce(x.clone(), tag="calibrate")

            comm.barrier()
            seconds.append(_median_seconds(op, repeats))
        small_s, large_s = seconds
        bandwidth = (LARGE - SMALL) / max(large_s - small_s, 1e-9)
        out[name] = (max(small_s - SMALL / bandwidth, 1e-7), bandwidth)
    return out


def probe_rank(ctx) -> dict:
    """Every rank: its measurements (the profile takes the slowest rank's)."""
    comm = Comm(ctx.groups.compute, ctx.rank, ctx.world_size, channel=ctx.groups.compute_channel)
    control = Comm(ctx.groups.control, ctx.rank, ctx.world_size, channel=ctx.groups.control_channel)
    result = {"matmul_flops": matmul_flops(), "attention_flops": attention_flops(),
              "read_Bps": read_bandwidth(), "collectives": collective_costs(comm)}
    result["step_overhead_s"] = _median_seconds(lambda: control.broadcast_object({"plan": list(range(64))}), 10)
    return result
