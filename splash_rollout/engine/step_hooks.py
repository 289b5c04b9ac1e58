"""StepHooks: the optional work around one step's forward, behind one seam.

The step itself is the algorithm (schedule, batch, forward, sample); features that ride along it
hook in here instead of sitting inline: each hook may wrap the forward (``around_forward``) and act
once it has run (``after_forward``). The engine builds the list at construction from its settings,
so a step never asks whether a feature is on.

* ``CopyOnWrite``: the samples of a prompt share its KV pages; a follower that will write into the
  leader's last, partly filled prompt page gets its own copy once the leader's forward filled it.
* ``RoutingCapture`` (``return_routing``, rank 0): every MoE layer's routed experts of the step,
  and a follower that took a prefix without computing it takes its routing too.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Sequence

import torch

from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool
from splash_rollout.engine.routing_capture import RoutingRecorder
from splash_rollout.engine.request_scheduler import ScheduledSeq, Scheduler


class StepHook:
    """A no-op hook; features override what they need."""

    def around_forward(self, scheduled: list[ScheduledSeq], batch: ForwardBatch) -> ContextManager:
        return contextlib.nullcontext()

    def after_forward(self, scheduled: list[ScheduledSeq]) -> None:
        pass


class CopyOnWrite(StepHook):
    def __init__(self, scheduler: Scheduler, pool_of, rank: int) -> None:
        self.scheduler, self.pool_of, self.rank = scheduler, pool_of, rank
        """``pool_of()``: this rank's KV pool now (a switch may resize it)."""

    def after_forward(self, scheduled: list[ScheduledSeq]) -> None:
        mine = [c for c in self.scheduler.copies if c.rank == self.rank]
        pool: KVPool = self.pool_of()
        with torch.inference_mode():  # the pool's tensors are inference tensors after a switch resized them
            pool.copy_pages([c.src for c in mine], [c.dst for c in mine])


class RoutingCapture(StepHook):
    def __init__(self, recorder: RoutingRecorder, scheduler: Scheduler) -> None:
        self.recorder, self.scheduler = recorder, scheduler

    def around_forward(self, scheduled: list[ScheduledSeq], batch: ForwardBatch) -> ContextManager:
        return self.recorder.step([s.request.request_id for s in scheduled], batch)

    def after_forward(self, scheduled: list[ScheduledSeq]) -> None:
        for taker, source, n in self.scheduler.prefix_sources:
            self.recorder.inherit(source.request_id, taker.request_id, n)


class StepHooks:
    """The engine's hooks, in order: wrapped around the forward outermost-first, then run after it."""

    def __init__(self, hooks: Sequence[StepHook]) -> None:
        self.hooks = list(hooks)

    @contextlib.contextmanager
    def forward(self, scheduled: list[ScheduledSeq], batch: ForwardBatch):
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.around_forward(scheduled, batch))
            yield
        for hook in self.hooks:
            hook.after_forward(scheduled)
