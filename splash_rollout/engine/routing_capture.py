"""Which experts the engine routed each token to: recorded on the driver rank, per request.

With ``EngineConfig(outputs={"return_routing": True})`` every step's forward on rank 0 runs inside a routing
capture (``models.moe.routing_context``); the captured ids of the step's rows are split by request
and kept by position until the request's result is built (``take``). The router is replicated on
every rank and sees every row (the feed-forward block runs on every row of the step in every layout), so rank 0's capture is
the whole step's routing in every layout. Rows are written by position, so a position computed
again (a recomputed prefix, a drafted token's position after the draft was rejected) keeps its
latest routing. Costs num_positions x moe_layers x top_k
int16 per request while it runs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from splash_rollout.models.moe import routing_context


class RoutingRecorder:
    def __init__(self, num_moe_layers: int, top_k: int) -> None:
        self.num_moe_layers, self.top_k = num_moe_layers, top_k
        self._parts: dict[int, list[tuple[int, np.ndarray]]] = {}
        """request id -> (first position, ids [n, num_moe_layers, top_k] int16) per step it ran."""

    @contextlib.contextmanager
    def step(self, request_ids: list[int], batch) -> Iterator[None]:
        """Capture the routing of one step's forward (``batch``: its ForwardBatch; ``request_ids``:
        the scheduled requests in batch order)."""
        with routing_context(capture=True) as state:
            yield
        if not state.captured:
            return
        ids = torch.stack(state.captured, dim=1).to(torch.int16).cpu().numpy()  # [N, layers, k]
        starts = batch.query_start
        positions = batch.positions.cpu()
        for i, rid in enumerate(request_ids):
            a, b = starts[i], starts[i + 1]
            if b > a:
                self._parts.setdefault(rid, []).append((int(positions[a]), ids[a:b]))

    def inherit(self, src_id: int, dst_id: int, num_positions: int) -> None:
        """``dst`` took ``src``'s KV for positions [0, num_positions) without computing them (a shared
        prompt): it takes their routing too."""
        for p, a in self._parts.get(src_id, []):
            if p < num_positions:
                self._parts.setdefault(dst_id, []).insert(0, (p, a[: num_positions - p].copy()))

    def take(self, request) -> np.ndarray:
        """[num_positions, num_moe_layers, top_k] int16 of a finished request (its records are dropped):
        row p = the experts of the token at position p, for the positions whose token is kept and was
        run (prompt + response - 1). Speculation runs rows past those -- drafted tokens a verification
        rejected: their positions are run again with the kept token (written later, so they win), and
        those past the request's end are cut here."""
        parts = self._parts.pop(request.request_id, [])
        n = min(request.num_tokens - 1, max((p + len(a) for p, a in parts), default=0))
        out = np.zeros((n, self.num_moe_layers, self.top_k), dtype=np.int16)
        for p, a in parts:
            if p < n:
                out[p:p + len(a)] = a[: n - p]
        return out

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._parts.pop(rid, None)
