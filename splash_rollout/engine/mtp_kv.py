"""The MTP drafter's attention entries: per request, the module's latent KV (and indexer keys) by position.

Rank 0 alone holds them (engine/mtp_drafter.py), apart from the engine's paged pool: the module sees
only the positions it was run over (a request's entries may have gaps), and its chained rows are
provisional -- the next verified rows replace everything from their first position on.

Each request owns a slot of a few shared buffers ([slots, capacity, ...]: the normed latent, the
roped k_pe, the position, a DSA model's indexer key), both axes grown by doubling. A pass over B
requests then enters its rows with one indexed write per buffer and reads the B histories, padded
to the longest, with one indexed read per buffer -- no per-request tensor operations, which at a few
microseconds each would cost more than the module's arithmetic in a long tail of few requests.
"""
from __future__ import annotations

import bisect

import torch


class MTPKV:
    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        """[slots, capacity, ...] each, in the order ``append`` was first given its parts."""
        self.slot: dict[int, int] = {}
        """request id -> its slot."""
        self.free: list[int] = []
        self.positions: dict[int, list[int]] = {}
        """request id -> the positions of its entries, ascending (slot row i holds positions[i])."""
        self.state: dict[int, torch.Tensor] = {}
        """request id -> [hidden] the module's output at its last entry (what its next draft starts from)."""

    def last_position(self, request_id: int) -> int | None:
        held = self.positions.get(request_id)
        return held[-1] if held else None

    def keep_before(self, request_id: int, position: int) -> None:
        """Drop the request's entries at or past ``position``."""
        held = self.positions.get(request_id)
        if held:
            n = bisect.bisect_left(held, position)
            if n < len(held):
                del held[n:]
                self.state.pop(request_id, None)

    def drop(self, request_id: int) -> None:
        slot = self.slot.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)
        self.positions.pop(request_id, None)
        self.state.pop(request_id, None)

    def append(self, request_ids: list[int], positions: list[list[int]], parts: list[torch.Tensor]) -> None:
        """Enter rows: request i's ``positions[i]`` (each past its last entry, after ``keep_before``),
        its rows contiguous in ``parts`` ([R, ...] each, requests in order)."""
        if not self.buffers:
            self.buffers = [torch.zeros((4, 16, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
            self.free = [3, 2, 1, 0]
        for rid in request_ids:
            self._own_slot(rid)
        need = max(len(self.positions[rid]) + len(ps) for rid, ps in zip(request_ids, positions))
        self._grow(capacity=need)
        slots, places = [], []
        for rid, ps in zip(request_ids, positions):
            held = self.positions[rid]
            slots += [self.slot[rid]] * len(ps)
            places += range(len(held), len(held) + len(ps))
            held += ps
        device = parts[0].device
        slot_index = torch.tensor(slots, dtype=torch.int64, device=device)
        place_index = torch.tensor(places, dtype=torch.int64, device=device)
        for buf, part in zip(self.buffers, parts):
            buf[slot_index, place_index] = part.to(buf.dtype)

    def gather(self, request_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The requests' entries padded to the longest: ([B, S, ...] per buffer (padding zeros where a
        slot never held one, stale values otherwise: mask with the lengths), lengths [B] int64)."""
        device = self.buffers[0].device
        lengths = [len(self.positions[rid]) for rid in request_ids]
        keys = max(lengths)
        slots = torch.tensor([self.slot[rid] for rid in request_ids], dtype=torch.int64, device=device)
        return [buf[slots, :keys] for buf in self.buffers], torch.tensor(lengths, device=device)

    def copy(self, source: int, request_id: int, before: int) -> None:
        """``request_id`` starts with ``source``'s entries before position ``before`` (a follower forked
        off its leader's last prompt row)."""
        self.drop(request_id)
        held = self.positions.get(source)
        if not held or not self.buffers:
            return
        n = bisect.bisect_left(held, before)
        self._own_slot(request_id)
        src, dst = self.slot[source], self.slot[request_id]
        for buf in self.buffers:
            buf[dst, :n] = buf[src, :n]
        self.positions[request_id] = held[:n]

    def _own_slot(self, request_id: int) -> None:
        if request_id in self.slot:
            return
        if not self.free:
            self._grow(slots=2 * self.buffers[0].shape[0])
        self.slot[request_id] = self.free.pop()
        self.positions[request_id] = []

    def _grow(self, slots: int = 0, capacity: int = 0) -> None:
        old_slots, old_capacity = self.buffers[0].shape[:2]
        new_slots = max(old_slots, slots)
        new_capacity = old_capacity if capacity <= old_capacity else max(capacity, 2 * old_capacity)
        if (new_slots, new_capacity) == (old_slots, old_capacity):
            return
        grown = []
        for buf in self.buffers:
            new = buf.new_zeros((new_slots, new_capacity, *buf.shape[2:]))
            new[:old_slots, :old_capacity] = buf
            grown.append(new)
        self.buffers = grown
        self.free = list(range(new_slots - 1, old_slots - 1, -1)) + self.free
