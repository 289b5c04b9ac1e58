"""Collectives through shared memory for ranks on one host: microseconds where gloo takes a millisecond.

gloo moves every collective over loopback TCP with its own threads; on a small CPU host a 2 KB
all-reduce between two ranks takes about 1 ms, and an engine step makes about ten of them (one
after each attention and feed-forward block, plus the control message). Ranks on one host can
instead write their contribution into a mapped file and read each other's.

Layout of the mapping (one per process group): ``world_size`` 64-byte lines, each holding a rank's
arrival counter and its process id, then two banks (even and odd operations) of ``world_size`` slots of ``slot_bytes`` each.
Operation ``s`` (counted from 1 on every rank, in the same order -- the engine's collectives are
symmetric) writes into bank ``s % 2``:

1. wait until every rank has arrived at ``s - 1`` (so nobody still reads bank ``s % 2`` from
   operation ``s - 2``); for symmetric operations this already holds;
2. copy this rank's bytes into its slot, fence, publish ``counter[rank] = s``;
3. wait until the ranks it reads from have published ``s``, then read their slots.

Publishing after the copy and reading after the counter is ordered on x86-64, where stores are not
reordered with stores nor loads with loads; the fence (a locked instruction) also orders any
non-temporal stores a large copy may use. Other architectures fall back to gloo (``supported()``).

Reductions add the slots in rank order on every rank, so every rank gets the same bits. Waits spin
briefly, then sleep in growing naps; a peer whose process has exited, or one silent for
``timeout_s``, raises ``TimeoutError`` naming the operation and the rank, never a hang. The file is unlinked as soon as every rank has mapped it, so
nothing is left behind if a rank dies.
"""
from __future__ import annotations

import mmap
import os
import platform
import tempfile
import threading
import time
import uuid

import numpy as np
import torch

LINE_BYTES = 64
DEFAULT_SLOT_BYTES = 1 << 20
"""Bytes of one rank's contribution to one operation (1 MiB); larger reductions and gathers move in
slot-sized pieces, one operation each."""
SPIN_S = 1e-3
"""Poll (yielding the core to anyone who wants it) this long before napping; most waits inside a step are shorter."""
MAX_NAP_S = 1e-3


def supported() -> bool:
    """Whether this host's memory ordering lets the channel publish with plain stores."""
    return platform.machine().lower() in ("x86_64", "amd64")


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmChannel:
    """One rank's end of a shared-memory channel among ``world_size`` ranks of one host."""

    def __init__(self, path: str, rank: int, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout_s: float = 60.0, create: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"ShmChannel: rank {rank} outside world_size {world_size}")
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        self.path = path
        header = LINE_BYTES * world_size
        size = header + 2 * world_size * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise RuntimeError(f"ShmChannel: {path} holds {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        lines = np.frombuffer(self._map, dtype=np.int64, count=world_size * LINE_BYTES // 8)
        self._counters = lines[:: LINE_BYTES // 8]  # [T] int64, one per cache line (a strided view)
        self._pids = lines[1:: LINE_BYTES // 8]  # [T] int64: each rank's process id (0 until it maps)
        self._pids[rank] = os.getpid()
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header)  # [2 * T * slot_bytes]
        self._fence = threading.Lock()
        self.seq = 0
        """Operations this rank has started."""

    # ---- slots ----------------------------------------------------------------------------
    def _slot(self, seq: int, rank: int) -> torch.Tensor:
        start = ((seq % 2) * self.world_size + rank) * self.slot_bytes
        return self._data[start: start + self.slot_bytes]

    def _publish(self, seq: int) -> None:
        with self._fence:  # a locked instruction: every store of the copy is visible before the counter
            pass
        self._counters[self.rank] = seq

    def _wait(self, seq: int, ranks, what: str) -> None:
        """Until every rank in ``ranks`` has published ``seq`` or more."""
        counters = self._counters
        start = time.perf_counter()
        nap = 1e-5
        for q in ranks:
            while counters[q] < seq:
                waited = time.perf_counter() - start
                if waited < SPIN_S:
                    os.sched_yield()  # busy, but a peer waiting for this core gets it
                    continue
                if waited > self.timeout_s or (nap == MAX_NAP_S and not self._alive(q)):
                    cause = ("its process has exited" if not self._alive(q) else
                             "it is stuck or left the collective sequence")
                    raise TimeoutError(f"shared-memory {what} (operation {seq}): rank {self.rank} waited "
                                       f"{waited:.1f} s for rank {q}, which is at operation {int(counters[q])}; "
                                       f"{cause}")
                time.sleep(nap)
                nap = min(2 * nap, MAX_NAP_S)

    def _alive(self, rank: int) -> bool:
        pid = int(self._pids[rank])
        if pid <= 0 or pid == os.getpid():
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            return True
        return True

    def _begin(self, what: str) -> int:
        self.seq += 1
        if self.seq > 2:  # bank seq % 2 was last read in operation seq - 2
            self._wait(self.seq - 1, range(self.world_size), what)
        return self.seq

    # ---- operations -----------------------------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, CPU, any size) over the ranks in place, adding the
        contributions in rank order on every rank. A tensor larger than a slot moves in slot-sized
        pieces, one operation each (every rank agrees on the count: it depends on the shape only)."""
        flat = tensor.view(-1)
        per_op = max(self.slot_bytes // flat.element_size(), 1)
        for start in range(0, max(flat.numel(), 1), per_op):
            self._all_reduce_piece(flat[start: start + per_op])
        return tensor

    def _all_reduce_piece(self, piece: torch.Tensor) -> None:
        nbytes = piece.numel() * piece.element_size()
        seq = self._begin("all_reduce")
        self._slot(seq, self.rank)[:nbytes].copy_(piece.view(torch.uint8))
        self._publish(seq)
        self._wait(seq, range(self.world_size), "all_reduce")
        _sum_in_rank_order([self._slot(seq, q)[:nbytes].view(piece.dtype) for q in range(self.world_size)], piece)

    def all_gather_(self, out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``out`` [T * n, ...] gets every rank's ``local`` [n, ...] (same shape on every rank) in rank order."""
        return self.all_gather_rows_(out, local, [local.shape[0]] * self.world_size)

    def all_gather_rows_(self, out: torch.Tensor, local: torch.Tensor, sizes) -> torch.Tensor:
        """``out`` [sum(sizes), ...] gets every rank's ``local`` [sizes[rank], ...] in rank order (no
        padding). Rows move in slot-sized pieces: operation k carries rows [k*c, (k+1)*c) of every
        rank, c = rows per slot; the number of operations depends only on ``sizes`` and the row
        shape, which every rank agrees on. A row wider than a slot raises ValueError before any
        operation (the caller checks ``rows_fit`` first)."""
        row_elems, row_bytes, per_op = self._row_pieces(local, "all_gather_rows_")
        flat = local.contiguous().view(local.shape[0], row_elems).view(torch.uint8)  # [n, row_bytes]
        dst = out.view(out.shape[0], row_elems).view(torch.uint8)  # [sum(sizes), row_bytes]
        starts = [sum(sizes[:q]) for q in range(self.world_size)]
        for first in range(0, max(max(sizes), 1), per_op):
            seq = self._begin("all_gather")
            mine = flat[first: first + per_op]
            if mine.numel():
                self._slot(seq, self.rank)[: mine.numel()].copy_(mine.reshape(-1))
            self._publish(seq)
            self._wait(seq, range(self.world_size), "all_gather")
            for q in range(self.world_size):
                rows = max(min(sizes[q] - first, per_op), 0)
                if rows:
                    at = starts[q] + first
                    dst[at: at + rows].copy_(self._slot(seq, q)[: rows * row_bytes].view(rows, row_bytes))
        return out

    def reduce_scatter_rows_(self, out: torch.Tensor, full: torch.Tensor, sizes) -> torch.Tensor:
        """``out`` [sizes[rank], ...] gets rows [sum(sizes[:rank]), ...) of the sum over ranks of
        ``full`` [sum(sizes), ...], added in rank order (the bits an all-reduce gives those rows).
        Operation k carries rows [k*c, (k+1)*c) of ``full``, c = rows per slot; a rank writes only
        the rows the others read and reads its own rows from ``full``."""
        row_elems, row_bytes, per_op = self._row_pieces(full, "reduce_scatter_rows_")
        src = full.contiguous().view(full.shape[0], row_elems)  # [N, row]
        dst = out.view(out.shape[0], row_elems)  # [n, row]
        lo = sum(sizes[: self.rank])
        hi = lo + sizes[self.rank]
        for first in range(0, max(src.shape[0], 1), per_op):
            last = min(first + per_op, src.shape[0])
            seq = self._begin("reduce_scatter")
            rows_of = lambda q: self._slot(seq, q)[: (last - first) * row_bytes].view(full.dtype).view(  # noqa: E731
                last - first, row_elems)  # rank q's rows [first, last) of this operation
            mine = rows_of(self.rank)
            for a, b in ((first, min(last, lo)), (max(first, hi), last)):  # the rows around this rank's own
                if a < b:
                    mine[a - first: b - first].copy_(src[a:b])
            self._publish(seq)
            self._wait(seq, range(self.world_size), "reduce_scatter")
            a, b = max(first, lo), min(last, hi)
            if a < b:
                parts = [src[a:b] if q == self.rank else rows_of(q)[a - first: b - first]
                         for q in range(self.world_size)]
                _sum_in_rank_order(parts, dst[a - lo: b - lo])
        return out

    def _row_pieces(self, t: torch.Tensor, what: str) -> tuple[int, int, int]:
        """(elements of a row of ``t``, its bytes, rows per slot); ValueError if a row exceeds a slot."""
        row_elems = 1
        for d in t.shape[1:]:
            row_elems *= d
        row_bytes = row_elems * t.element_size()
        if not self.rows_fit(row_bytes):
            raise ValueError(f"{what}: a row of {row_bytes} bytes exceeds the {self.slot_bytes}-byte slot")
        return row_elems, row_bytes, max(self.slot_bytes // max(row_bytes, 1), 1)

    def rows_fit(self, row_bytes: int) -> bool:
        """Whether one row fits a slot (then any number of rows can be gathered here)."""
        return row_bytes <= self.slot_bytes

    def all_to_all_(self, out: torch.Tensor, send: torch.Tensor, send_splits, recv_splits) -> bool:
        """Rows ``send[sum(send_splits[:q]) : ...]`` to rank q; ``out`` gets the rows from each rank in
        rank order. Each rank writes a header (whether its rows fit, where each destination's rows
        start) and, if they fit, its rows. Returns False on every rank, having moved nothing, when
        any rank's rows do not fit its slot (the caller then uses the process group)."""
        flat = send.contiguous().view(-1).view(torch.uint8)
        row_bytes = flat.numel() // max(sum(send_splits), 1) if sum(send_splits) else 0
        header_bytes = 8 * (self.world_size + 1)
        fits = header_bytes + flat.numel() <= self.slot_bytes
        starts = np.zeros(self.world_size + 1, dtype=np.int64)
        starts[0] = 1 if fits else 0
        starts[1:] = np.cumsum([0] + [row_bytes * n for n in send_splits[:-1]])
        seq = self._begin("all_to_all")
        slot = self._slot(seq, self.rank)
        slot[:header_bytes].copy_(torch.from_numpy(starts.view(np.uint8)))
        if fits:
            slot[header_bytes: header_bytes + flat.numel()].copy_(flat)
        self._publish(seq)
        self._wait(seq, range(self.world_size), "all_to_all")
        heads = [self._slot(seq, q)[:header_bytes].view(torch.int64) for q in range(self.world_size)]
        if not all(int(h[0]) for h in heads):
            return False
        dst = out.view(-1).view(torch.uint8)
        row_out = dst.numel() // max(sum(recv_splits), 1) if sum(recv_splits) else 0
        at = 0
        for q in range(self.world_size):
            n = recv_splits[q] * row_out
            begin = header_bytes + int(heads[q][1 + self.rank])
            dst[at: at + n].copy_(self._slot(seq, q)[begin: begin + n])
            at += n
        return True

    def broadcast_bytes(self, payload: bytes | None, src: int) -> bytes:
        """``src``'s payload (any length: sent in slot-sized pieces) on every rank."""
        if self.rank == src:
            pieces = [payload[i: i + self.slot_bytes - 8] for i in range(0, max(len(payload), 1), self.slot_bytes - 8)]
            for k, piece in enumerate(pieces):
                seq = self._begin("broadcast")
                slot = self._slot(seq, src)
                header = np.array([len(payload) if k == 0 else len(piece)], dtype=np.int64).view(np.uint8)
                slot[:8].copy_(torch.from_numpy(header))
                if piece:
                    slot[8: 8 + len(piece)].copy_(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
                self._publish(seq)
            return payload
        chunks, total, got = [], None, 0
        while total is None or got < total:
            seq = self._begin("broadcast")
            self._publish(seq)  # arrival: this rank has finished reading operation seq - 1
            self._wait(seq, (src,), "broadcast")
            slot = self._slot(seq, src)
            first = total is None
            size = int(slot[:8].view(torch.int64)[0])
            total = size if first else total
            take = min(total, self.slot_bytes - 8) if first else size
            chunks.append(slot[8: 8 + take].numpy().tobytes())
            got += take
        return b"".join(chunks)

    def close(self) -> None:
        self._data = None
        self._counters = None
        try:
            self._map.close()
        except BufferError:  # a view of the mapping is still alive somewhere: the OS frees it at exit
            pass


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] + parts[1] + ..., added left to right (rank order: the same bits on every rank)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out += part


def open_channel(group, rank: int, world_size: int, timeout_s: float,
                 slot_bytes: int = DEFAULT_SLOT_BYTES) -> ShmChannel | None:
    """Collective over ``group`` (gloo): a channel when every rank can map the same file (one host,
    x86-64), else None on every rank."""
    import torch.distributed as dist

    box = [os.path.join(shm_dir(), f"splash-{uuid.uuid4().hex}") if rank == 0 and supported() else None]
    dist.broadcast_object_list(box, src=0, group=group)
    path = box[0]

    def try_map() -> ShmChannel | None:
        if path is None or not supported():
            return None
        try:
            return ShmChannel(path, rank, world_size, slot_bytes, timeout_s, create=rank == 0)
        except (OSError, RuntimeError):
            return None

    channel = try_map() if rank == 0 else None
    dist.barrier(group=group)  # the file exists before the others open it
    if rank != 0:
        channel = try_map()
    mapped = [None] * world_size
    dist.all_gather_object(mapped, channel is not None, group=group)
    if rank == 0 and path is not None:
        try:
            os.unlink(path)  # every rank has it mapped (or gave up): nothing outlives the group
        except OSError:
            pass
    if not all(mapped):
        if channel is not None:
            channel.close()
        return None
    return channel
