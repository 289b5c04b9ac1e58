"""One replica of a fleet: a RolloutEngine inside a Ray actor, serving requests as they arrive.

Why a class of its own: the fleet (fleet.py) only ever talks to a replica through these methods,
so what crosses the process boundary is small and explicit -- token ids and sampling parameters in,
a ``SampleGroup`` out, weights in by object reference. The actor is asynchronous: many ``generate``
calls are open at once, each awaiting its handle from ``RolloutEngine.submit``, and they join the
engine's running batch at its next step, as the OpenAI server's requests do.

The engine spawns its T ranks from inside the actor (so they run on the actor's node, within the
resources its placement-group bundle reserved); Ray places the replica, the engine places its ranks.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any


class Replica:
    """The actor's body (``ray.remote(Replica)`` in fleet.py)."""

    def __init__(self, config, index: int) -> None:
        from splash_rollout.rollout.engine import RolloutEngine

        self.index = index
        self.engine = RolloutEngine(config)
        self.served = 0

    async def generate(self, prompt_ids: list[int], sampling) -> Any:
        """One prompt's group of ``sampling.n`` samples (a ``SampleGroup``)."""
        group = await self.engine.agenerate(prompt_ids, sampling)
        self.served += 1
        return group

    async def update_weights(self, named: dict, version: int) -> int:
        """Full weights (validated before any change: a bad push leaves the old ones). Runs beside the
        serving loop: it lands between two steps, running requests continue under ``version``."""
        await asyncio.to_thread(self.engine.update_weights, named, version)
        return self.engine.weight_version

    async def info(self) -> dict:
        """What the fleet reports of this replica (also its liveness check)."""
        loop = self.engine._loop
        totals = loop.log.totals if loop is not None else {}
        return {"replica": self.index, "pid": os.getpid(), "weight_version": self.engine.weight_version,
                "served": self.served, "in_flight": loop.in_flight if loop is not None else 0,
                "cached_tokens": totals.get("cached_tokens", 0), "prefill_rows": totals.get("prefill_rows", 0)}

    async def mark(self) -> int:
        """The steps served so far: ``timeline(since=mark)`` is what was served after this."""
        loop = self.engine._loop
        return loop.log.total_steps if loop is not None else 0

    async def timeline(self, since: int = 0) -> dict:
        """The layout timeline of the steps served after ``since`` (a ``mark()``; 0: all still kept),
        each phase and switch tagged with this replica's index."""
        from splash_rollout.rollout.timeline import build_timeline

        loop = self.engine._loop
        steps = list(loop.log.steps[-(loop.log.total_steps - since):]) if loop is not None and \
            loop.log.total_steps > since else []
        first = steps[0]["step"] if steps else None
        later = (lambda rows: [r for r in rows if first is not None and r.get("step", -1) >= first])
        timeline = build_timeline(steps, later(loop.log.switches) if loop else [],
                                  later(loop.log.decisions) if loop else []).to_dict()
        for key in ("phases", "switches", "decisions"):
            for row in timeline[key]:
                row["replica"] = self.index
        return timeline

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)
