"""Where a RolloutEngine's ranks live, and the functions every rank runs for it.

One engine (``engine.Engine``) for any T, hosted one of two ways:

* ``LocalHost``: the engine lives in this process -- one rank (T = 1), or every rank of a
  torch.distributed group the caller already runs (torchrun, a trainer; then every rank calls the
  same RolloutEngine method and gets rank 0's answer).
* ``SpawnedHost``: the engine spawns its T ranks (``WorkerGroup``) and calls them.

Both run the same module-level ``worker_*`` functions with a context (``groups``, ``state``,
``heartbeat``, ``interrupted``), so the RolloutEngine has one code path. Only plain request
records cross processes, never torch.Generator objects.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


from splash_rollout.distributed.collectives import Comm
from splash_rollout.distributed.groups import ProcessGroups
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.rollout.build import build_engine, compute_backend
from splash_rollout.rollout.validation import agree_across_ranks


@dataclass(frozen=True)
class RequestRecord:
    """What a rank needs to rebuild a Request."""

    request_id: int
    prompt_ids: list[int]
    spec: SamplingSpec
    max_len: int
    eos_token_ids: tuple[int, ...]

    output_ids: tuple[int, ...] = ()
    """Tokens the sample already has (a resumed partial sample): prefilled, then continued."""
    output_logprobs: tuple[float, ...] = ()

    @classmethod
    def of(cls, r: Request) -> "RequestRecord":
        return cls(r.request_id, list(r.prompt_ids), r.spec, r.max_len, tuple(r.eos_token_ids),
                   tuple(r.output_ids), tuple(r.output_logprobs))

    def request(self) -> Request:
        return Request(self.request_id, list(self.prompt_ids), self.spec, self.max_len, self.eos_token_ids,
                       list(self.output_ids), list(self.output_logprobs))


@dataclass(frozen=True)
class RequestResult:
    request_id: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    routing: Any = None
    """With ``return_routing``: [positions run, MoE layers, top_k] int16 (engine/routing_capture.py)."""


# ---- hosts --------------------------------------------------------------------------------------
@dataclass
class LocalContext:
    """The in-process counterpart of a spawned rank's ``WorkerContext``."""

    groups: ProcessGroups
    state: dict[str, Any] = field(default_factory=dict)
    abort: threading.Event = field(default_factory=threading.Event)

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    def heartbeat(self, info: Any = None) -> None:
        """Nobody waits on an in-process rank's sign of life."""

    def interrupted(self) -> bool:
        return self.abort.is_set()


class LocalHost:
    """The engine in this process: T = 1, or this rank of the caller's T-rank group (torchrun, a
    trainer), where every rank calls the engine with the same arguments."""

    worker_group = None
    """No spawned ranks."""

    def __init__(self, groups: ProcessGroups) -> None:
        self.ctx = LocalContext(groups)
        self.control = Comm(groups.control, groups.rank, groups.world_size, channel=groups.control_channel,
                            name="control")

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def local_engine(self) -> Engine | None:
        """This process's engine (None before it is built and after shutdown)."""
        return self.ctx.state.get("engine")

    @property
    def every_rank_calls(self) -> bool:
        """Whether the caller's other ranks make the same call (so an input error must reach them)."""
        return self.ctx.world_size > 1

    def agree(self, digest: str | None, error: BaseException | None) -> None:
        """Every rank holds the same requests, or every rank raises (a no-op on one rank)."""
        if self.every_rank_calls:
            agree_across_ranks(self.control.gather_objects, digest, error)

    def after_failure(self) -> None:
        """Nothing to stop: the ranks are the caller's."""

    def after_build(self) -> None:
        """The process is the caller's: its collector is the caller's to tune."""

    def run(self, fn, *args) -> Any:
        """``fn(ctx, *args)`` here; every rank returns rank 0's result."""
        result = fn(self.ctx, *args)
        return self.control.broadcast_object(result) if self.ctx.world_size > 1 else result

    def push_weights(self, named: dict, bucket_bytes: int) -> None:
        """Every rank here has the full tensors (it is the caller, or one of the caller's ranks): each
        cuts its own parts."""
        self.run(worker_update_weights, named)

    def interrupt(self) -> None:
        self.ctx.abort.set()

    def clear_interrupt(self) -> None:
        self.ctx.abort.clear()

    def shutdown(self, force: bool = False) -> None:
        self.ctx.state.clear()


class SpawnedHost:
    """T ranks this process spawned; a call runs on all of them and returns rank 0's result."""

    rank = 0
    local_engine = None
    """The engines live in the spawned ranks."""
    every_rank_calls = False
    """Only this process calls; it sends each call to the ranks."""

    def __init__(self, world_size: int, timeout_s: float, device: str = "cpu") -> None:
        from splash_rollout.distributed.launch import WorkerGroup

        self.group = WorkerGroup(world_size, backend=compute_backend(device, world_size), timeout_s=timeout_s)

    def run(self, fn, *args, timeout_s: float | None = None) -> Any:
        return self.group.run(fn, *args, timeout_s=timeout_s)[0]

    def after_build(self) -> None:
        """The ranks' processes hold only their engines: what exists now stays (``freeze_heap``)."""
        self.group.run(worker_freeze_heap)

    def push_weights(self, named: dict, bucket_bytes: int) -> None:
        """Each rank receives only its own parts of the push (asked of it first: they follow its
        current layout), in buckets of at most ``bucket_bytes``."""
        from splash_rollout.engine.weight_update import cut_push

        held = self.group.run(worker_held_parts)
        for buckets in cut_push(named, held, bucket_bytes):
            self.group.run_each(worker_update_parts, [(b,) for b in buckets])

    def interrupt(self) -> None:
        self.group.interrupt.set()

    def clear_interrupt(self) -> None:
        self.group.interrupt.clear()

    def shutdown(self, force: bool = False) -> None:
        self.group.shutdown(force=force)

    @property
    def worker_group(self):
        """The spawned ranks (``distributed.launch.WorkerGroup``)."""
        return self.group

    def agree(self, digest: str | None, error: BaseException | None) -> None:
        """The requests were built once, here: nothing to agree on."""

    def after_failure(self) -> None:
        """A failed call leaves the ranks out of step: stop them."""
        self.shutdown(force=True)


# ---- what every rank runs (module level so they pickle by name) ----------------------------------------
def worker_build(ctx, config) -> dict:
    engine = build_engine(config, ctx.groups, heartbeat=ctx.heartbeat, should_abort=ctx.interrupted)
    ctx.state["engine"] = engine
    return {"num_pages": engine.state.pool.num_pages, "full_shapes": engine.full_shapes, **engine.resident_bytes()}


def worker_freeze_heap(ctx) -> None:
    from splash_rollout.rollout.process_settings import freeze_heap

    freeze_heap()


def worker_serve(ctx, records: list[RequestRecord], progress: bool = False):
    """Every rank serves the same records; rank 0 returns (results, step log, switch log, decisions)
    and clears its logs."""
    from splash_rollout.rollout.progress import RolloutProgress

    engine: Engine = ctx.state["engine"]
    bar = RolloutProgress(len(records), enabled=progress and ctx.rank == 0)
    try:
        finished = engine.serve([r.request() for r in records], on_step=bar.on_step if bar.enabled else None)
    finally:
        bar.close()
    if finished is None:
        return None
    results = [RequestResult(r.request_id, list(r.output_ids), list(r.output_logprobs), r.finish_reason or "abort",
                             engine.routing.take(r) if engine.routing is not None else None)
               for r in finished]
    steps, switches, decisions = engine.step_log, engine.switch_log, engine.decision_log
    engine.step_log, engine.switch_log = [], []
    engine.driver.decision_log = []
    return results, steps, switches, decisions


def worker_serve_async(ctx, records: list[RequestRecord], abort_ids: list[int], max_steps: int):
    """One poll of the serving loop (rollout/serving_loop.py) on every rank: end ``abort_ids``, add
    ``records`` that can ever run to what runs, serve up to ``max_steps`` steps. Rank 0 returns
    (results of the requests that ended -- finished or aborted --, {request id: (first new output
    position, new tokens, their logprobs)} for the ones still running, step log, switch log, new
    decisions, the engine's state, [(request id, KV pages it needs)] of the records refused because
    no pool this engine may use holds them)."""
    engine: Engine = ctx.state["engine"]
    aborted = engine.abort_requests(abort_ids)
    fresh = not engine.scheduler.has_unfinished  # a new burst of work: the driver's call statistics restart
    if fresh:
        engine.driver.decision_log = []
        ctx.state["decisions_seen"] = 0
    arrived = [r.request() for r in records]
    fits = [engine.can_ever_admit(q) for q in arrived]  # the same answer on every rank
    refused = [(q.request_id, q.pages_needed(engine.page_size)) for q, ok in zip(arrived, fits) if not ok]
    finished = engine.serve([q for q, ok in zip(arrived, fits) if ok], max_steps=max_steps, new_call=fresh)
    if ctx.rank != 0:
        return None
    reported = ctx.state.setdefault("reported", {})
    results = []
    for r in aborted + (finished or []):
        reported.pop(r.request_id, None)
        results.append(RequestResult(r.request_id, list(r.output_ids), list(r.output_logprobs),
                                     r.finish_reason or "abort",
                                     engine.routing.take(r) if engine.routing is not None else None))
    progress = {}
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        have, n = reported.get(r.request_id, 0), r.num_output_tokens
        if n > have:
            progress[r.request_id] = (have, r.output_ids[have:], r.output_logprobs[have:])
            reported[r.request_id] = n
    seen = ctx.state.get("decisions_seen", 0)
    decisions = engine.decision_log[seen:]
    ctx.state["decisions_seen"] = len(engine.decision_log)
    steps, switches = engine.step_log, engine.switch_log
    engine.step_log, engine.switch_log = [], []
    placement = engine.scheduler.placement
    state = {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
             "layout": engine.layout.value, "pages_used": placement.pages_in_use,
             "pages_cached": placement.pages_cached, "pages_total": [m.num_pages for m in placement.managers],
             "steps": engine.num_steps}
    return results, progress, steps, switches, decisions, state, refused


def worker_request_switch(ctx, dst: str, blocking: bool) -> None:
    ctx.state["engine"].request_switch(dst, blocking)


def worker_can_ever_admit(ctx, records: list[RequestRecord]) -> list[bool]:
    """Whether each request can ever run (every replica gives the same answer)."""
    return [ctx.state["engine"].can_ever_admit(r.request()) for r in records]


def worker_update_weights(ctx, named) -> None:
    ctx.state["engine"].update_weights(named)


def worker_held_parts(ctx) -> dict:
    return ctx.state["engine"].held_parts()


def worker_update_parts(ctx, parts) -> None:
    ctx.state["engine"].update_parts(parts)


def worker_sleep(ctx) -> None:
    ctx.state["engine"].sleep()


def worker_wake_up(ctx) -> None:
    ctx.state["engine"].wake_up()


def worker_memory_stats(ctx) -> list[dict]:
    engine: Engine = ctx.state["engine"]
    return engine.control.gather_objects(engine.memory_stats())
