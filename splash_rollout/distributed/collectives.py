"""Collective wrappers that count the bytes each rank sends and receives, on the device their group runs on.

Every collective the engine and the switcher run goes through ``Comm`` so that a switch's measured
traffic can be checked against its ``SwitchPlan`` byte for byte. Convention (payload bytes, the
same as ``layout.switch_plan``): a rank *sends* each byte it contributes once per peer that needs
it and *receives* each byte that a peer contributes to it; its own contribution to itself is free.
Padding used to make gloo's uneven gathers even is never counted. all-reduce is counted as a ring,
2 (T - 1) / T of the buffer each way.

gloo on CPU refuses uneven list forms, so uneven gathers pad to the largest piece and use
``all_gather_into_tensor``; uneven exchanges use ``all_to_all_single`` with split sizes.

Each ``Comm`` knows its group's device (the engine's for the compute and transfer groups, the CPU
for the control group) and refuses, naming the collective, a tensor that lives elsewhere: host data
(counts, digests, the sampled tokens) travels on the gloo control group, device tensors on NCCL.
On NCCL a reduce-scatter is the native one; gloo has none, so there it is an all-reduce and a slice.

With a ``channel`` (``distributed/shm_channel.py``: ranks on one host), the synchronous CPU
collectives that fit its slots go through shared memory instead of the process group; the bytes
counted are the same either way, since they are the payload, not the transport.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


@dataclass
class ByteCounter:
    """Bytes this rank sent and received, per tag (e.g. ``switch/weights``, ``switch/kv``, ``step``)
    and per (tag, collective) (``("step/attn", "all_to_all")``: what ``layout/traffic.py`` states)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_op: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    """(tag, collective) -> [bytes sent, bytes received]."""

    def add(self, tag: str, sent: int, received: int, op: str = "other") -> None:
        self.sent[tag] += int(sent)
        self.received[tag] += int(received)
        both = self.by_op.setdefault((tag, op), [0, 0])
        both[0] += int(sent)
        both[1] += int(received)

    def total(self, prefix: str = "") -> tuple[int, int]:
        """(sent, received) over tags starting with ``prefix``."""
        return (sum(v for k, v in self.sent.items() if k.startswith(prefix)),
                sum(v for k, v in self.received.items() if k.startswith(prefix)))

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.by_op.clear()


class Pending:
    """An issued asynchronous collective; ``wait()`` returns its result."""

    def __init__(self, work: Any, finish: Callable[[], Any]):
        self._work, self._finish, self._done, self._result = work, finish, False, None

    def wait(self) -> Any:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result, self._done = self._finish(), True
        return self._result


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (everything after dim 0)."""
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n * t.element_size()


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on another device than its group runs on (NCCL takes CUDA
    tensors of the rank's own GPU, gloo CPU tensors): a bug that would otherwise hang or crash inside
    the backend. The message names the collective, its tag, the group and both devices."""


class Comm:
    """One rank's collectives over one process group, with byte counting. Every tensor handed to it
    must live on ``device`` (checked on every call, on every rank count: a device comparison)."""

    def __init__(self, group: Any, rank: int, world_size: int, counter: ByteCounter | None = None,
                 channel: Any = None, device: torch.device | str = "cpu", name: str = "compute"):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.counter = counter if counter is not None else ByteCounter()
        self.channel = channel if world_size > 1 else None
        """A ``ShmChannel`` over the same ranks, or None (every collective through ``group``)."""
        self.device = torch.device(device)
        """Where every tensor of this group's collectives lives (the engine's device; the CPU for control)."""
        self.name = name
        """The group's role, for messages: ``compute``, ``transfer`` or ``control``."""
        self.backend = dist.get_backend(group) if world_size > 1 and group is not None else "none"
        """The process group's backend: ``nccl`` has a native reduce-scatter, gloo does not."""

    def _check(self, tensor: torch.Tensor, op: str, tag: str) -> None:
        """Refuse, by name, a tensor on another device than the group's."""
        device = tensor.device
        if device.type != self.device.type or (self.device.index is not None and device.index != self.device.index):
            raise CollectiveDeviceError(f"{op} ({tag}) on the {self.name} group: rank {self.rank}'s tensor is on "
                                        f"{device}, the group's collectives run on {self.device}")

    def _via_channel(self, tensor: torch.Tensor, row_bytes: int = 0) -> bool:
        """Whether this operation goes through shared memory (the same answer on every rank: it
        depends only on shapes and dtypes every rank agrees on)."""
        return self.channel is not None and tensor.device.type == "cpu" and self.channel.rows_fit(row_bytes)

    # ---- all-reduce -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, tag: str = "step") -> torch.Tensor:
        """Sum in place over the group. tensor: any shape; returns it."""
        self._check(tensor, "all_reduce", tag)
        t = self.world_size
        if t > 1:
            if tensor.is_contiguous() and self._via_channel(tensor):
                self.channel.all_reduce_(tensor)
            else:
                dist.all_reduce(tensor, group=self.group)
            ring = tensor.numel() * tensor.element_size() * 2 * (t - 1) // t
            self.counter.add(tag, ring, ring, "all_reduce")
        return tensor

    # ---- uneven all-gather ------------------------------------------------------------------
    def all_gather_uneven(self, local: torch.Tensor, sizes: Sequence[int], tag: str = "step",
                          async_op: bool = False) -> torch.Tensor | Pending:
        """Concatenate every rank's rows in rank order.

        local: [sizes[rank], *row] on this rank; sizes: [T] rows per rank (the same list on every
        rank). Returns [sum(sizes), *row] (or a Pending that yields it).
        """
        t, r = self.world_size, self.rank
        self._check(local, "all_gather_uneven", tag)
        if len(sizes) != t or local.shape[0] != sizes[r]:
            raise ValueError(f"all_gather_uneven: rank {r} holds {local.shape[0]} rows, sizes say {list(sizes)}")
        row_shape, row_bytes = tuple(local.shape[1:]), _row_bytes(local)
        self.counter.add(tag, sizes[r] * row_bytes * (t - 1), (sum(sizes) - sizes[r]) * row_bytes, "all_gather")
        if t == 1:
            out = local.clone()
            return Pending(None, lambda: out) if async_op else out
        if not async_op and self._via_channel(local, row_bytes):
            out = local.new_empty((sum(sizes),) + row_shape)
            return self.channel.all_gather_rows_(out, local, sizes)
        most = max(sizes)
        padded = local.new_zeros((most,) + row_shape)
        padded[: sizes[r]] = local
        gathered = local.new_empty((t * most,) + row_shape)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        work = gather(gathered, padded, group=self.group, async_op=async_op)

        def finish() -> torch.Tensor:
            pieces = [gathered[q * most: q * most + sizes[q]] for q in range(t)]
            return torch.cat(pieces, dim=0)

        return Pending(work, finish) if async_op else finish()

    # ---- uneven reduce-scatter ---------------------------------------------------------------
    def reduce_scatter_uneven(self, full: torch.Tensor, sizes: Sequence[int], tag: str = "step") -> torch.Tensor:
        """This rank's rows of the sum over the group: full [sum(sizes), *row] (the same shape on every
        rank) -> [sizes[rank], *row], rows [sum(sizes[:rank]), ...) of the sum, added in rank order
        (the same bits ``all_reduce`` gives those rows)."""
        t, r = self.world_size, self.rank
        self._check(full, "reduce_scatter_uneven", tag)
        if len(sizes) != t or full.shape[0] != sum(sizes):
            raise ValueError(f"reduce_scatter_uneven: rank {r} holds {full.shape[0]} rows, sizes say {list(sizes)}")
        lo = sum(sizes[:r])
        if t == 1:
            return full
        row_shape, row_bytes = tuple(full.shape[1:]), _row_bytes(full)
        self.counter.add(tag, (full.shape[0] - sizes[r]) * row_bytes, sizes[r] * row_bytes * (t - 1), "reduce_scatter")
        if self._via_channel(full, row_bytes):
            out = full.new_empty((sizes[r],) + row_shape)
            return self.channel.reduce_scatter_rows_(out, full, sizes)
        if self.backend == "nccl":  # native: each rank's block padded to the largest, one reduce-scatter
            most = max(sizes)
            padded = full if len(set(sizes)) == 1 else full.new_zeros((t * most,) + row_shape)
            if padded is not full:
                starts = [sum(sizes[:q]) for q in range(t)]
                for q in range(t):
                    padded[q * most: q * most + sizes[q]] = full[starts[q]: starts[q] + sizes[q]]
            out = full.new_empty((most,) + row_shape)
            dist.reduce_scatter_tensor(out, padded.contiguous(), group=self.group)
            return out[: sizes[r]]
        summed = full.contiguous().clone()  # gloo has no reduce-scatter of tensors: all-reduce, keep ours
        dist.all_reduce(summed, group=self.group)
        return summed[lo: lo + sizes[r]]

    # ---- uneven all-to-all ------------------------------------------------------------------
    def all_to_all_uneven(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                          tag: str = "step", async_op: bool = False) -> torch.Tensor | Pending:
        """Rows send[sum(send_splits[:q]) : ...] go to rank q; returns the rows received, in rank order.

        send: [sum(send_splits), *row]; recv_splits: [T] rows from each rank (must match the
        peers' send_splits). Ranks with zero rows still join. Returns [sum(recv_splits), *row].
        """
        t, r = self.world_size, self.rank
        self._check(send, "all_to_all_uneven", tag)
        if len(send_splits) != t or len(recv_splits) != t or send.shape[0] != sum(send_splits):
            raise ValueError(f"all_to_all_uneven: rank {r} sends {send.shape[0]} rows with splits "
                             f"{list(send_splits)} / receives {list(recv_splits)} over {t} ranks")
        row_shape, row_bytes = tuple(send.shape[1:]), _row_bytes(send)
        self.counter.add(tag, (sum(send_splits) - send_splits[r]) * row_bytes,
                         (sum(recv_splits) - recv_splits[r]) * row_bytes, "all_to_all")
        out = send.new_empty((sum(recv_splits),) + row_shape)
        if t == 1:
            out.copy_(send)
            return Pending(None, lambda: out) if async_op else out
        if not async_op and self.channel is not None and send.device.type == "cpu" \
                and self.channel.all_to_all_(out, send, send_splits, recv_splits):
            return out
        work = dist.all_to_all_single(out, send.contiguous(), output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self.group, async_op=async_op)
        return Pending(work, lambda: out) if async_op else out

    # ---- small objects on the control group -------------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """rank ``src`` sends a picklable object, every rank returns it (control group only)."""
        box = [obj if self.rank == src else None]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def broadcast_bytes(self, payload: bytes | None, tag: str = "step/control", src: int = 0) -> bytes:
        """Rank ``src`` sends ``payload`` (its length first), every rank returns it. Counted under
        ``tag``: the payload once per receiving peer on the sender, once on each receiver."""
        if self.world_size == 1:
            return payload
        if self.channel is not None:
            out = self.channel.broadcast_bytes(payload, src)
            n = len(out)
            self.counter.add(tag, n * (self.world_size - 1) if self.rank == src else 0, 0 if self.rank == src else n,
                             "broadcast")
            return out
        size = torch.tensor([len(payload) if self.rank == src else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.group)
        n = int(size)
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == src
                  else torch.empty(n, dtype=torch.uint8))
        if n:
            dist.broadcast(buffer, src=src, group=self.group)
        self.counter.add(tag, n * (self.world_size - 1) if self.rank == src else 0, 0 if self.rank == src else n,
                         "broadcast")
        return payload if self.rank == src else buffer.numpy().tobytes()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
