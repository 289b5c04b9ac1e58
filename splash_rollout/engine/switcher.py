"""Switcher: a rank's side of a live layout switch, layer by layer (paper §4.1 steps 2–3).

The switching step runs in the destination layout. Before layer i computes, its state must be in
place: its projection shard for the destination head slice (kept, cut out of the replicated
weights — a discard — or all-gathered from the shards) and the KV tokens this rank lacks under the
destination ownership (all-to-all / all-gather of token rows between pages the driver allocated).
Overlapped mode issues layer i+1's collectives on the switch-transfer group before layer i
computes and waits for each layer's own state only; blocking mode moves everything first (the
baseline). Indexer keys travel in the same rows as the layer's latent KV. Bytes are counted by the
collective wrappers under ``switch/weights`` and ``switch/kv``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splash_rollout.distributed.collectives import Comm, Pending
from splash_rollout.distributed.faults import inject
from splash_rollout.engine.kv_pool import KVPool
from splash_rollout.engine.kv_switch import KVMove
from splash_rollout.engine.placement import NOT_HERE
from splash_rollout.engine.projections import ProjectionShard, slice_projections
from splash_rollout.layout.layouts import Layout
from splash_rollout.layout.rank_view import RankView
from splash_rollout.layout.switch_plan import Primitive, weight_primitive


@dataclass
class TokenRoutes:
    """This rank's share of the KV moves: rows it sends (per destination) and receives (per source)."""

    send_slots: list[list[int]]
    """[T] source slots, in the agreed order, of tokens this rank sends to each rank."""
    recv_slots: list[list[int]]
    """[T] destination slots of tokens this rank receives from each rank."""
    collective: bool = True
    """Whether any rank moves any token (the same on every rank): then every rank joins the KV
    all-to-all, even one with nothing to send or receive -- a collective only some ranks enter hangs."""

    @property
    def network(self) -> bool:
        return any(self.send_slots) or any(self.recv_slots)


def token_routes(moves: list[KVMove], rank: int, world_size: int, page_size: int) -> TokenRoutes:
    """Every token whose destination copy lives on a rank that did not store it comes from its
    (unique) source holder, once per destination page; all ranks derive the same order from the
    same moves."""
    send = [[] for _ in range(world_size)]
    recv = [[] for _ in range(world_size)]
    anyone = False
    filled: set[tuple[int, int]] = set()
    """(rank, destination page) already routed: a page several samples share moves once."""
    for m in moves:
        for p in range(len(m.dst_pages[0])):
            holders = [q for q in range(world_size) if m.src_pages[q][p] != NOT_HERE]
            if not holders:
                continue
            tokens = range(p * page_size, min((p + 1) * page_size, m.num_tokens))
            for r in range(world_size):
                if m.dst_pages[r][p] in (NOT_HERE, m.src_pages[r][p]) or (r, m.dst_pages[r][p]) in filled:
                    continue  # r does not need it, keeps it in place, or gets it with another sample
                filled.add((r, m.dst_pages[r][p]))
                # r's own copy when it is being relocated below a shrinking capacity, else the holder
                q = r if m.src_pages[r][p] != NOT_HERE else holders[0]
                anyone = True
                if q == rank:
                    send[r] += [m.src_pages[q][p] * page_size + x % page_size for x in tokens]
                if r == rank:
                    recv[q] += [m.dst_pages[r][p] * page_size + x % page_size for x in tokens]
    return TokenRoutes(send, recv, anyone)


class LayerSwitch:
    """The in-flight switch of one step: per-layer transfers issued ahead and installed on demand."""

    def __init__(self, src: Layout, dst: Layout, view: RankView, pool: KVPool, shards: list[ProjectionShard],
                 attns: list, routes: TokenRoutes, comm: Comm, blocking: bool = False,
                 pool_pages: int | None = None, on_install=None) -> None:
        self.src, self.dst, self.view, self.pool = src, dst, view, pool
        self.pool_pages = pool_pages
        """Destination pages per layer; each layer's KV tensors are resized in its turn."""
        self.on_install = on_install
        """Called with the bytes still in flight after each layer's transfer is issued or installed
        (memory tracking)."""
        self.shards, self.attns, self.routes, self.comm = shards, attns, routes, comm
        self.weights = weight_primitive(src, dst)
        self.pending: dict[int, tuple] = {}
        self.num_layers = len(shards)
        self.wait_s = 0.0
        """Time the step spent waiting for and installing switch state (the exposed overhead)."""
        self.first_layer_s = 0.0
        """Issue-to-installed time of layer 0, which nothing hides: one layer's transfer."""
        start = time.perf_counter()
        if blocking:
            for i in range(self.num_layers):
                self._issue(i)
                self._install(i)
                if i == 0:
                    self.first_layer_s = time.perf_counter() - start
            self.wait_s = time.perf_counter() - start
        else:
            self._issue(0)
        self._start = start

    # ---- per layer ---------------------------------------------------------------------------
    def before_layer(self, i: int) -> None:
        """Called by the runner before layer i computes: finish layer i, then start layer i+1 so its
        transfer runs while layer i computes (one layer's buffers in flight at a time)."""
        if not self._installed(i):
            start = time.perf_counter()
            if i not in self.pending:
                self._issue(i)
            self._install(i)
            self.wait_s += time.perf_counter() - start
            if i == 0:
                self.first_layer_s = time.perf_counter() - self._start
        if i + 1 < self.num_layers and i + 1 not in self.pending:
            self._issue(i + 1)

    def _installed(self, i: int) -> bool:
        return self.pending.get(i, ()) == "done"

    def _issue(self, i: int) -> None:
        weights = self._issue_weights(i)
        kv = self._issue_kv(i)
        self.pending[i] = (weights, kv)
        if self.on_install is not None:
            self.on_install(self.inflight_bytes())

    def inflight_bytes(self) -> int:
        """Receive buffers of issued layers not yet installed (gathered weights, KV rows)."""
        total = 0
        for i, state in self.pending.items():
            if state == "done":
                continue
            if state[0] is not None and self.weights is Primitive.ALL_GATHER:
                total += self.shards[i].nbytes * self.view.world_size
            if state[1] is not None:
                kv, idx = self._rows(i)
                row = (kv.shape[1] + (idx.shape[1] if idx is not None else 0)) * kv.element_size()
                total += row * sum(len(x) for x in self.routes.recv_slots)
        return total

    def _install(self, i: int) -> None:
        weights, kv = self.pending[i]
        if weights is not None:
            self.shards[i] = weights()
        inject("switch_transfer", i, self.view.rank)  # tests: SPLASH_FAULT (distributed/faults.py)
        if self.pool_pages is not None and self.pool.layer_pages(i) != self.pool_pages:
            self.pool.resize_layer(i, self.pool_pages)
        if kv is not None:
            kv()
        self.pending[i] = "done"
        if self.on_install is not None:
            self.on_install(self.inflight_bytes())

    # ---- weights -------------------------------------------------------------------------------
    def _issue_weights(self, i: int):
        shard, attn = self.shards[i], self.attns[i]
        if self.weights is Primitive.KEEP:
            return None
        if self.weights is Primitive.DISCARD:  # replicated -> sharded: cut our heads out, drop the rest
            heads = self.view.head_slice
            return lambda: slice_projections(attn, heads, shard.q_b, shard.kv_b, shard.o)
        t = self.view.world_size  # sharded -> replicated: all-gather the missing heads
        rows = [shard.q_b.shape[0]] * t, [shard.kv_b.shape[0]] * t, [shard.o.shape[1]] * t
        q_b = self.comm.all_gather_uneven(shard.q_b, rows[0], tag="switch/weights", async_op=True)
        kv_b = self.comm.all_gather_uneven(shard.kv_b, rows[1], tag="switch/weights", async_op=True)
        o_t = self.comm.all_gather_uneven(shard.o.t().contiguous(), rows[2], tag="switch/weights", async_op=True)
        heads = slice(0, self.view.num_heads)
        return lambda: ProjectionShard(heads, q_b.wait(), kv_b.wait(), o_t.wait().t().contiguous())

    # ---- KV --------------------------------------------------------------------------------------
    def _rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        kv = self.pool.kv[i].view(-1, self.pool.kv[i].shape[-1])
        idx = self.pool.index_k[i]
        return kv, (idx.view(-1, idx.shape[-1]) if idx is not None else None)

    def _issue_kv(self, i: int):
        if not self.routes.collective:
            return None
        kv, idx = self._rows(i)
        send_slots = torch.tensor([s for slots in self.routes.send_slots for s in slots], dtype=torch.int64, device=kv.device)
        rows = kv.index_select(0, send_slots)
        if idx is not None:
            rows = torch.cat([rows, idx.index_select(0, send_slots)], dim=1)  # indexer keys ride along
        pending: Pending = self.comm.all_to_all_uneven(
            rows, [len(s) for s in self.routes.send_slots], [len(s) for s in self.routes.recv_slots],
            tag="switch/kv", async_op=True)
        recv_slots = torch.tensor([s for slots in self.routes.recv_slots for s in slots], dtype=torch.int64, device=kv.device)

        width = kv.shape[1]

        def install() -> None:  # into the layer's tensors as they are now (possibly resized)
            got = pending.wait()
            kv_now, idx_now = self._rows(i)
            kv_now[recv_slots] = got[:, :width]
            if idx_now is not None:
                idx_now[recv_slots] = got[:, width:]

        return install
