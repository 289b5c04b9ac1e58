"""One replica of a fleet: a RolloutEngine inside a Ray actor, serving requests as they arrive.

Why a class of its own: the fleet (fleet.py) only ever talks to a replica through these methods,
so what crosses the process boundary is small and explicit -- token ids and sampling parameters in,
a ``SampleGroup`` (and, when asked, the tokens as they come) out, weights in by object reference
(staged and validated, then committed). The actor is asynchronous: many ``stream`` calls are open
at once, each following its handle from ``RolloutEngine.submit``, and they join the engine's running
batch at its next step, as the OpenAI server's requests do.

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
        self._staged: tuple[int, dict] | None = None
        """(push, full tensors) validated and not yet committed."""

    async def stream(self, prompt_ids: list[int], sampling, deltas: bool):
        """One prompt's group of ``sampling.n`` samples, as messages (a Ray streaming generator):
        ``("admitted", request ids per sample)`` once the engine took it (or the ValueError refusing
        it), with ``deltas`` then ``("tokens", [(sample, token ids, logprobs, weight version, finish
        reason or None), ...])`` at most once per engine step, and last ``("group", SampleGroup)``."""
        handle = self.engine.submit(prompt_ids, sampling)
        await handle.wait_admitted()
        yield "admitted", handle.request_ids
        if deltas:
            async for batch in handle.stream_batches():
                version = self.engine.weight_version
                yield "tokens", [(d.sample, d.token_ids, d.logprobs, version, d.finish_reason) for d in batch]
        group = await handle
        self.served += 1
        yield "group", group

    async def abort(self, request_ids: list[int]) -> int:
        """End these samples at the engine's next step (finish_reason ``abort``)."""
        return self.engine.abort_requests(request_ids)

    async def abort_submitted(self) -> int:
        return self.engine.abort_submitted()

    async def state(self) -> dict:
        """``RolloutEngine.serving_state()`` and this replica's index (the server's /metrics)."""
        return self.engine.serving_state() | {"replica": self.index}

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.engine.wake_up)

    async def stage(self, push: int, buckets: list) -> None:
        """Phase one of a fleet push: fetch every bucket (object references, each a dict of full
        tensors) and validate the whole push against this engine's parameters, changing nothing. A
        ValueError names the first problem; the push is then discarded everywhere."""
        from splash_rollout.engine.weight_update import served_part, validate_update

        named: dict = {}
        for part in await asyncio.gather(*buckets):
            named.update(part)
        named = served_part(named, self.engine._full_shapes)
        await asyncio.to_thread(validate_update, named, self.engine._full_shapes, True)
        self._staged = (push, named)

    async def commit(self, push: int, version: int) -> int:
        """Phase two: the staged push into the engine as ``version``. Runs beside the serving loop: it
        lands between two steps, running requests continue under ``version``."""
        if self._staged is None or self._staged[0] != push:
            raise RuntimeError(f"replica {self.index}: commit of push {push}, which is not the one staged")
        named, self._staged = self._staged[1], None
        await asyncio.to_thread(self.engine.update_weights, named, version, False)
        return self.engine.weight_version

    async def discard(self, push: int) -> None:
        if self._staged is not None and self._staged[0] == push:
            self._staged = None

    async def info(self) -> dict:
        """What the fleet reports of this replica (also its liveness check)."""
        state = self.engine.serving_state()
        return {"replica": self.index, "pid": os.getpid(), "weight_version": self.engine.weight_version,
                "served": self.served, "in_flight": state["in_flight"], "cached_tokens": state["cached_tokens"],
                "prefill_rows": state["prefill_rows"]}

    async def mark(self) -> int:
        """The steps served so far: ``timeline(since=mark)`` is what was served after this."""
        return self.engine.serving_state()["total_steps"]

    async def timeline(self, since: int = 0) -> dict:
        """The layout timeline of the steps served after ``since`` (a ``mark()``; 0: all still kept),
        each phase and switch tagged with this replica's index."""
        timeline = self.engine.serving_timeline(since)
        for key in ("phases", "switches", "decisions"):
            for row in timeline[key]:
                row["replica"] = self.index
        return timeline

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)
