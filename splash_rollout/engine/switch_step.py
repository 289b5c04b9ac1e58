"""A live switch on one rank: entering the destination layout inside a serving step, and its record.

At the step boundary every rank's scheduler replica re-places the running histories under the
destination (``kv_switch.switch_placement``: deterministic, so the ranks agree without being told
page ids); each rank derives from those moves which token rows it sends and receives, installs
the destination view and executor at once, and lets ``LayerSwitch`` bring layer i's weights and KV
while layer i-1 computes. Each rank measures its own bytes and waits; ``merge_measures`` adds every
rank's numbers to the driver's switch records at the end of a call.
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.distributed.collectives import Comm
from splash_rollout.engine.kv_switch import KVMove
from splash_rollout.engine.switcher import LayerSwitch, token_routes
from splash_rollout.layout.layouts import Layout
from splash_rollout.layout.rank_view import RankView


@dataclass(frozen=True)
class SwitchOrder:
    """A switch that happens in this step: every rank moves from ``src`` to ``dst`` layer by layer."""

    src: Layout
    dst: Layout
    moves: list[KVMove]
    blocking: bool = False
    pool_pages: int | None = None
    """KV pages per rank in ``dst`` (None: the pool keeps its size)."""


class RankSwitch:
    """This rank's side of one switching step: ``before_layer`` for the runner, then ``measure``."""

    def __init__(self, order: SwitchOrder, state, attns: list, transfer: Comm, tracked_bytes, page_size: int) -> None:
        self.tracked_bytes = tracked_bytes
        """() -> bytes of projection shards + KV pool on this rank (what a switch changes)."""
        view = state.view
        dst_view = RankView(order.dst, view.rank, view.world_size, view.num_heads)
        routes = token_routes(order.moves, view.rank, view.world_size, page_size)
        state.view = dst_view
        self.counter = transfer.counter
        self.sent0, self.received0 = self.counter.total("switch/")
        self.before = tracked_bytes()
        self.peak = self.before
        self.layers = LayerSwitch(order.src, order.dst, dst_view, state.pool, state.shards, attns, routes, transfer,
                                  blocking=order.blocking, pool_pages=order.pool_pages, on_install=self._track)

    def _track(self, inflight_bytes: int) -> None:
        self.peak = max(self.peak, self.tracked_bytes() + inflight_bytes)

    def before_layer(self, i: int) -> None:
        self.layers.before_layer(i)

    def measure(self) -> dict:
        sent, received = self.counter.total("switch/")
        s = self.layers
        return {"sent": sent - self.sent0, "received": received - self.received0, "wait_ms": 1e3 * s.wait_s,
                "layer_ms": 1e3 * s.first_layer_s, "num_layers": s.num_layers, "bytes_before": self.before,
                "bytes_after": self.tracked_bytes(), "peak_bytes": self.peak}


def merge_measures(control: Comm, measures: list[dict], switch_log: list[dict] | None) -> None:
    """Collective: the driver adds every rank's bytes and waits to the switches of this call
    (``switch_log`` is the driver's, None on the other ranks)."""
    everyone = control.gather_objects(measures)
    if switch_log is None:
        return
    done = [r for r in switch_log if r["deferred_reason"] is None and "bytes_sent" not in r]
    for k, record in enumerate(done):
        per_rank = [m[k] for m in everyone]
        record["bytes_sent"] = [m["sent"] for m in per_rank]
        record["bytes_received"] = [m["received"] for m in per_rank]
        record["tracked_bytes"] = [(m["bytes_before"], m["peak_bytes"], m["bytes_after"]) for m in per_rank]
        record["overhead_ms"] = max(m["wait_ms"] for m in per_rank)
        record["blocking_estimate_ms"] = (record["overhead_ms"] if record["blocking"] else
                                          max(m["layer_ms"] for m in per_rank) * per_rank[0]["num_layers"])
