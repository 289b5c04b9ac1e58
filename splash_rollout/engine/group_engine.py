"""GroupEngine: the engine on one rank of a T-rank group — driver on rank 0, worker everywhere.

SPMD, DESIGN.md §4. Rank 0 owns the request queue, admission, the page tables of every rank
(``KVPlacement``) and the layout; each step it broadcasts a ``StepPlan`` over the CPU control
group, every rank runs its part of the forward through its layout's attention executor, and rank 0
samples. ``serve`` is what every rank calls for one batch of requests; it returns the finished
requests on rank 0 and None elsewhere.

Each rank holds only its share of the weights: the switchable projections of its layout's head
slice (``ProjectionShard``), its feed-forward shard, and the replicated rest; and its own KV pool.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from splash_rollout.distributed.collectives import Comm
from splash_rollout.distributed.groups import ProcessGroups
from splash_rollout.engine.attention import AttentionBackend, get_backend
from splash_rollout.engine.executors.cp import CPExecutor
from splash_rollout.engine.executors.dop import DOPExecutor
from splash_rollout.engine.executors.dp import DPExecutor
from splash_rollout.engine.executors.tp import TPExecutor
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec
from splash_rollout.engine.kv_switch import KVMove, retire_source_pages, switch_placement
from splash_rollout.engine.switcher import LayerSwitch, token_routes
from splash_rollout.engine.weight_update import apply_update, validate_update
from splash_rollout.engine.model_runner import ModelRunner
from splash_rollout.engine.parallel_mlp import shard_feed_forward
from splash_rollout.engine.placement import KVPlacement
from splash_rollout.engine.projections import ProjectionShard, drop_full_projections, slice_projections
from splash_rollout.engine.request import Request
from splash_rollout.engine.sampler import SamplingBatch, sample
from splash_rollout.engine.scheduler import ScheduledSeq, Scheduler
from splash_rollout.engine.sleep import TensorOffload, memory_stats, release_memory, restore_memory
from splash_rollout.layout.bytes import AttentionBytes
from splash_rollout.layout.footprint import pool_tokens
from splash_rollout.layout.layouts import Layout
from splash_rollout.layout.rank_view import RankView
from splash_rollout.models.config import ModelConfig

EXECUTORS = {Layout.TP: TPExecutor, Layout.DP: DPExecutor, Layout.DOP: DOPExecutor, Layout.CP: CPExecutor}
_BYTES_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "bf16"}


@dataclass
class RankState:
    """What an attention executor reads from its rank; a switch replaces ``view`` and ``shards``."""

    view: RankView
    pool: KVPool
    backend: AttentionBackend
    shards: list[ProjectionShard]
    """Per layer: this rank's Q-B / KV-B / O for ``view.head_slice``."""
    comm: Comm
    """Compute-group collectives (counted under ``step/*``)."""


@dataclass(frozen=True)
class PlannedSeq:
    """One request's part of a step, as broadcast to every rank."""

    request_id: int
    new_token_ids: list[int]
    """[num_new] the tokens whose rows run this step."""
    start: int
    num_new: int
    rank_pages: list[list[int]]
    """[T][num_logical_pages] page tables, -1 where a rank does not store the page."""
    samples: bool
    owner: int


@dataclass(frozen=True)
class SwitchOrder:
    """A switch that happens in this step: every rank moves from ``src`` to ``dst`` layer by layer."""

    src: Layout
    dst: Layout
    moves: list[KVMove]
    blocking: bool = False
    pool_pages: int | None = None
    """KV pages per rank in ``dst`` (None: the pool keeps its size)."""


@dataclass(frozen=True)
class StepEvent:
    """What rank 0 tells ``GroupEngine.on_step`` after each step of a ``serve`` call."""

    step: int
    layout: str
    done: int
    """Requests of this call finished so far."""
    total: int
    """Requests of this call (finished + still queued or running)."""
    new_tokens: int
    """Tokens sampled in this step."""
    seconds: float


@dataclass(frozen=True)
class StepPlan:
    step: int
    layout: Layout
    seqs: list[PlannedSeq]
    switch: SwitchOrder | None = None


def sizes_for(config: ModelConfig, dtype: torch.dtype) -> AttentionBytes:
    """The ownership model's byte table for this engine's dtype (weights and KV stored alike)."""
    name = _BYTES_NAME[dtype]
    return AttentionBytes.from_model(config, name, name)


def pages_per_rank(config: ModelConfig, layout: Layout, world_size: int, budget_bytes: int, page_size: int,
                   dtype: torch.dtype) -> int:
    """KV pages one rank gets from ``budget_bytes`` after its layout's attention weights (Table 2)."""
    sizes = sizes_for(config, dtype)
    weights = (sizes.w_a // world_size if layout.shards_projections else sizes.w_a) + sizes.w_replicated
    return pool_tokens(budget_bytes, weights, sizes.kv_bytes_per_token_total, page_size) // page_size


class GroupEngine:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, groups: ProcessGroups, *, layout: Layout,
                 num_pages: int, page_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 attention_backend: str = "torch_ref", dtype: torch.dtype = torch.float32,
                 pages_by_layout: dict[Layout, int] | None = None) -> None:
        """pages_by_layout: KV pages per rank in each layout under one memory budget (memory follows
        the layout on a switch); None keeps ``num_pages`` in every layout."""
        t, rank = groups.world_size, groups.rank
        self.full_shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.state_dict().items()}
        """Unsharded parameter shapes and dtypes: what ``update_weights`` validates against."""
        self.config, self.groups, self.page_size = config, groups, page_size
        self.rank, self.world_size = rank, t
        self.comm = Comm(groups.compute, rank, t)
        self.transfer = Comm(groups.transfer, rank, t, self.comm.counter)
        self.control = Comm(groups.control, rank, t)
        if t > 1:
            shard_feed_forward(model, rank, t, self.comm)
        view = RankView(layout, rank, t, config.num_heads)
        shards = [slice_projections(layer.self_attn, view.head_slice) for layer in model.model.layers]
        for layer in model.model.layers:
            drop_full_projections(layer.self_attn)
        pool = KVPool(KVPoolSpec.from_model(config), num_pages, page_size, dtype)
        self.state = RankState(view, pool, get_backend(attention_backend), shards, self.comm)
        self.model = model
        self.pages_by_layout = pages_by_layout
        self.runner = ModelRunner(model, EXECUTORS[layout](self.state))
        self.num_steps = 0
        self.pending_switch: tuple[Layout, bool] | None = None
        """Rank 0: a requested switch (destination, blocking) applied at the next step boundary."""
        self.switch_schedule: dict[int, Layout] = {}
        """Rank 0: step number -> layout to switch to at that step (tests and benchmarks)."""
        self.switch_log: list[dict] = []
        """Rank 0: one record per switch or deferral."""
        self.policy = None
        """Rank 0: a scheduling.LayoutPolicy when the layout is chosen automatically (layout="auto")."""
        self.decision_log: list[dict] = []
        """Rank 0: the policy's decisions that chose a layout (with predicted per-layout step costs)."""
        self.ended_lengths: tuple[list[int], list[int]] = ([], [])
        """Rank 0: response lengths of this serve call's samples that stopped (EOS / stop string)
        and that hit their cap: what the policy's horizon estimate learns from (scheduling/horizon.py)."""
        self.steps_in_layout = 0
        self.switch_measures: list[dict] = []
        """Every rank: bytes and waits of each switch it took part in (merged into switch_log)."""
        self.step_log: list[dict] = []
        """Rank 0: one record per step (layout, rows, requests, prefill rows, seconds)."""
        self.on_step: Callable[[StepEvent], None] | None = None
        """Rank 0: called after every step of ``serve`` (a progress bar); must not raise."""
        self._offload: TensorOffload | None = None
        """While asleep: the weights' storages, moved out of tensor memory (engine/sleep.py)."""
        self.heartbeat: Callable[[dict], None] | None = None
        """Every rank: called after each step with {step, finished} (a spawned rank's sign of life)."""
        self.should_abort: Callable[[], bool] | None = None
        """Rank 0: polled at each step boundary; when true, every unfinished request of the call is
        aborted (finish_reason ``abort``, pages freed) and ``serve`` returns normally."""
        self.failed: str | None = None
        """Why a ``serve`` failed on this rank. The ranks are then out of step (some may have left a
        collective, a switch may be half-moved), so this engine refuses every later call."""
        if rank == 0:
            placement = KVPlacement([num_pages] * t, page_size, layout)
            self.scheduler: Scheduler | None = Scheduler(placement, max_num_batched_tokens, max_num_seqs)
            self.scheduler.ever_admits = self.can_ever_admit
        else:
            self.scheduler = None

    @property
    def layout(self) -> Layout:
        return self.state.view.layout

    # ---- every rank --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """This rank's part of one step; logits [R, vocab] on rank 0, None elsewhere."""
        items = [(s.new_token_ids, s.start, s.num_new, s.rank_pages[self.rank], s.samples, s.owner)
                 for s in plan.seqs]
        batch = ForwardBatch.build(items, self.page_size)
        self.num_steps += 1
        if plan.switch is None:
            return self.runner.forward(batch, logits=self.rank == 0)
        sent0, received0 = self.comm.counter.total("switch/")
        before = self.tracked_bytes()
        switch = self._begin_switch(plan.switch)
        logits = self.runner.forward(batch, logits=self.rank == 0, before_layer=switch.before_layer)
        sent, received = self.comm.counter.total("switch/")
        self.switch_measures.append({"sent": sent - sent0, "received": received - received0,
                                     "wait_ms": 1e3 * switch.wait_s,
                                     "layer_ms": 1e3 * switch.first_layer_s,
                                     "num_layers": switch.num_layers, "bytes_before": before,
                                     "bytes_after": self.tracked_bytes(), "peak_bytes": self._peak_bytes})
        return logits

    def _begin_switch(self, order: SwitchOrder):
        """Enter ``order.dst``: new rank view and executor now; each layer's state arrives in time."""
        s = self.state
        dst_view = RankView(order.dst, self.rank, self.world_size, self.config.num_heads)
        routes = token_routes(order.moves, self.rank, self.world_size, self.page_size)
        attns = [layer.self_attn for layer in self.model.model.layers]
        s.view = dst_view
        self.runner.executor = EXECUTORS[order.dst](s)
        self._peak_bytes = self.tracked_bytes()
        switch = LayerSwitch(order.src, order.dst, dst_view, s.pool, s.shards, attns, routes, self.transfer,
                             blocking=order.blocking, pool_pages=order.pool_pages)
        switch.on_install = lambda i: self._track(switch)
        return switch

    def _track(self, switch) -> None:
        self._peak_bytes = max(self._peak_bytes, self.tracked_bytes() + switch.inflight_bytes())

    def tracked_bytes(self) -> int:
        """Bytes of what a switch changes on this rank: projection shards and the KV pool (both 0
        while asleep: their storages are freed)."""
        shards = 0 if self.asleep else sum(x.nbytes for x in self.state.shards)
        return shards + self.state.pool.nbytes

    def serve(self, requests: list[Request] | None = None, max_steps: int | None = None) -> list[Request] | None:
        """Run a batch of requests to completion on every rank (rank 0 passes them in). With
        ``max_steps`` rank 0 stops early and leaves the rest running for the next call."""
        if self.asleep:  # every rank refuses before any collective; the engine stays usable
            raise RuntimeError("serve: the engine is asleep; call wake_up() first")
        if self.failed is not None:
            raise RuntimeError(f"GroupEngine (rank {self.rank}): unusable after an earlier failure ({self.failed}); "
                               f"build a new engine")
        try:
            return self._serve(requests, max_steps)
        except BaseException as e:
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            raise

    def _serve(self, requests: list[Request] | None, max_steps: int | None) -> list[Request] | None:
        if self.rank != 0:
            while True:
                plan = self.control.broadcast_object()
                if plan is None:
                    self._merge_switch_measures()
                    return None
                if plan == "abort":
                    raise RuntimeError(f"rank {self.rank}: the driver (rank 0) aborted the call")
                self.run(plan)
                if self.heartbeat is not None:
                    self.heartbeat({"step": self.num_steps})
        assert self.scheduler is not None
        for req in requests or []:
            self.scheduler.add(req)
        finished: list[Request] = []
        self.ended_lengths = ([], [])  # a new call is a new group of prompts: its own length distribution
        steps = 0
        mid_step = False  # the plan is out: the other ranks are inside the step's collectives
        try:
            while self.scheduler.has_unfinished and (max_steps is None or steps < max_steps):
                if self.should_abort is not None and self.should_abort():
                    finished.extend(self.scheduler.abort_all())  # at a step boundary: nothing half-done
                    break
                steps += 1
                order, placement_switch = self._switch_at_boundary()
                scheduled = self.scheduler.schedule()
                if not scheduled:
                    raise RuntimeError("step: nothing schedulable although requests are pending")
                start = time.perf_counter()
                self.steps_in_layout += 1
                plan = self._plan(scheduled, order)
                mid_step = True
                self.control.broadcast_object(plan)
                logits = self.run(plan)
                mid_step = False
                samplers = [s.request for s in scheduled if s.samples]
                tokens, logprobs = sample(logits, SamplingBatch.make(
                    [r.spec for r in samplers], [r.num_output_tokens for r in samplers], logits.device))
                ended = self.scheduler.postprocess(scheduled, tokens, logprobs)
                for r in ended:
                    if r.finish_reason in ("stop", "length"):
                        self.ended_lengths[r.finish_reason == "length"].append(r.num_output_tokens)
                finished.extend(ended)
                self.step_log.append({
                    "step": plan.step, "layout": self.layout.value, "requests": len(scheduled),
                    "rows": sum(s.num_new for s in scheduled),
                    "prefill_rows": sum(s.num_new for s in scheduled if s.request.num_output_tokens == 0
                                        or s.num_new > 1),
                    "running": len(self.scheduler.running), "seconds": time.perf_counter() - start})
                if self.on_step is not None:
                    self.on_step(StepEvent(plan.step, self.layout.value, len(finished),
                                           len(finished) + len(self.scheduler.running) + len(self.scheduler.waiting),
                                           len(samplers), self.step_log[-1]["seconds"]))
                if placement_switch is not None:
                    retire_source_pages(self.scheduler.placement, placement_switch)
                    self.switch_log[-1]["step_seconds"] = self.step_log[-1]["seconds"]
                if self.heartbeat is not None:
                    self.heartbeat({"step": self.num_steps, "finished": len(finished)})
        except BaseException:
            finished.extend(self.scheduler.abort_all())
            if not mid_step:  # they wait for a plan: tell them. Mid-step they sit in a collective that
                try:          # only their timeout ends, and so would this broadcast; raise the cause now
                    self.control.broadcast_object("abort")
                except Exception:  # noqa: BLE001
                    pass
            raise
        self.control.broadcast_object(None)
        self._merge_switch_measures()
        return finished

    def _merge_switch_measures(self) -> None:
        """Collective: rank 0 adds every rank's bytes and waits to the switches of this call."""
        everyone = self.control.gather_objects(self.switch_measures)
        self.switch_measures = []
        if self.rank != 0:
            return
        done = [r for r in self.switch_log if r["deferred_reason"] is None and "bytes_sent" not in r]
        for k, record in enumerate(done):
            per_rank = [m[k] for m in everyone]
            record["bytes_sent"] = [m["sent"] for m in per_rank]
            record["bytes_received"] = [m["received"] for m in per_rank]
            record["tracked_bytes"] = [(m["bytes_before"], m["peak_bytes"], m["bytes_after"]) for m in per_rank]
            record["overhead_ms"] = max(m["wait_ms"] for m in per_rank)
            record["blocking_estimate_ms"] = (record["overhead_ms"] if record["blocking"] else
                                              max(m["layer_ms"] for m in per_rank) * per_rank[0]["num_layers"])

    def update_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Every rank: slice the full tensors into this rank's shards (rejected as a whole if bad)."""
        if self.asleep:
            raise RuntimeError("update_weights: the engine is asleep; call wake_up() first")
        validate_update(named, self.full_shapes, check_finite=False)  # values: checked once, by the caller
        apply_update(self.model, self.state.shards, named, self.rank, self.world_size)

    def can_ever_admit(self, request: Request) -> bool:
        """Rank 0: whether ``request`` can ever run here: in the current layout's empty pools or, when
        the policy chooses layouts (auto) and memory follows the layout, in any layout it may enter
        (a request only DOP's larger pool holds waits at the queue head until the policy moves)."""
        placement = self.scheduler.placement
        if self.policy is None or not self.pages_by_layout:
            return placement.can_ever_admit(request)
        return any(placement.can_ever_admit(request, l, [self.pages_by_layout[l]] * self.world_size)
                   for l in self.policy.config.layouts)

    def request_switch(self, dst: Layout | str, blocking: bool = False) -> None:
        """Rank 0: switch to ``dst`` at the next step boundary."""
        self.pending_switch = (Layout.parse(dst, "dst"), blocking)

    def _consult_policy(self) -> None:
        """Rank 0, layout="auto": ask π for the next layout; a switch it chooses becomes pending."""
        from splash_rollout.scheduling.cost_model import StepBatch

        from splash_rollout.scheduling.horizon import residual_tokens
        from splash_rollout.scheduling.policy import Waiting

        running = list(self.scheduler.running)
        queued = list(self.scheduler.waiting)[: self.scheduler.max_num_seqs]
        if not (running or queued) or self.pending_switch is not None:
            return
        budget = self.scheduler.max_num_batched_tokens
        rows = [max(1, min(r.num_uncomputed_tokens, budget)) if r.in_prefill else 1 for r in running]
        batch = StepBatch.make([r.num_computed_tokens + q for r, q in zip(running, rows)], rows,
                               [r.owner for r in running])
        waiting = Waiting.make([r.num_uncomputed_tokens for r in queued], [r.max_total_tokens for r in queued],
                               budget, self.scheduler.max_num_seqs)
        remaining = residual_tokens([r.num_output_tokens for r in running + queued],
                                    [r.spec.max_new_tokens for r in running + queued], *self.ended_lengths)
        first = not self.decision_log
        decision = self.policy.decide(None if first else self.layout, batch, remaining, self.steps_in_layout,
                                      [r.max_total_tokens for r in running], waiting)
        # the timeline keeps the first call, every switch, and a checkpoint each time the batch the
        # policy priced has halved since the last kept one: a draining group shows, O(log B) times,
        # what each layout was predicted to cost when the policy stayed put
        priced = len(running) + decision.admitted.get(decision.chosen.value, 0)
        drained = bool(self.decision_log) and 2 * priced <= self.decision_log[-1]["priced_batch"]
        if first or decision.switch or drained:
            why = "initial" if first else "switch" if decision.switch else "drained"
            self.decision_log.append(dict(decision.to_dict(), step=self.num_steps, batch_size=len(running),
                                          waiting=len(self.scheduler.waiting), priced_batch=priced, logged=why))
        if decision.chosen is not self.layout and (first or decision.switch):
            self.pending_switch = (decision.chosen, False)

    def _switch_at_boundary(self):
        """Rank 0: commit a requested or scheduled switch before scheduling the step (or defer it)."""
        if self.policy is not None:
            self._consult_policy()
        want = self.pending_switch
        if want is None and self.num_steps in self.switch_schedule:
            want = (self.switch_schedule[self.num_steps], False)
        if want is None or want[0] is self.layout:
            self.pending_switch = None
            return None, None
        dst, blocking = want
        placement = self.scheduler.placement
        capacity = [self.pages_by_layout[dst]] * self.world_size if self.pages_by_layout else None
        result = switch_placement(placement, list(self.scheduler.running), dst, capacity,
                                  list(self.scheduler.waiting))
        record = {"src": self.layout.value, "dst": dst.value, "step": self.num_steps, "blocking": blocking,
                  "deferred_reason": None}
        if isinstance(result, str):
            record["deferred_reason"] = result
            last = self.switch_log[-1] if self.switch_log else {}
            if last.get("deferred_reason") != result or last.get("dst") != dst.value:
                self.switch_log.append(record)
            self.pending_switch = want  # retried at the next boundary; serving goes on in the source
            return None, None
        self.pending_switch = None
        self.steps_in_layout = 0
        record["moves"] = [(m.num_tokens, m.owner) for m in result.moves]
        self.switch_log.append(record)
        pool_pages = self.pages_by_layout[dst] if self.pages_by_layout else None
        return SwitchOrder(result.src, dst, result.moves, blocking, pool_pages), result

    def _plan(self, scheduled: list[ScheduledSeq], switch: SwitchOrder | None = None) -> StepPlan:
        seqs = []
        for s in scheduled:
            r = s.request
            seqs.append(PlannedSeq(r.request_id, r.token_ids[s.start: s.start + s.num_new], s.start, s.num_new,
                                   [list(t) for t in r.rank_pages], s.samples, r.owner))
        return StepPlan(self.num_steps, switch.dst if switch else self.layout, seqs, switch)

    # ---- sleep / wake (every rank; engine/sleep.py) ----------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._offload is not None

    def sleep(self) -> None:
        """Collective: free this rank's KV pool and move its weights out of tensor memory. Refused on
        every rank (nothing released) while rank 0 has requests queued or running."""
        if self.asleep:
            raise RuntimeError("sleep: the engine is already asleep")
        busy = self.scheduler.has_unfinished if self.rank == 0 else None
        if self.control.broadcast_object(busy):
            raise RuntimeError("sleep: requests are still queued or running; abort them or let them finish first")
        self._offload = release_memory(self.state.pool, self.model, self.state.shards)

    def wake_up(self) -> None:
        """This rank: the weights back bit for bit and a zeroed KV pool of the size it had."""
        if not self.asleep:
            raise RuntimeError("wake_up: the engine is not asleep")
        restore_memory(self._offload, self.state.pool)
        self._offload = None

    def memory_stats(self) -> dict[str, int | None]:
        """This rank's bytes, measured: ``tracked_bytes`` (projection shards + KV pool), ``kv_pool``,
        ``weights`` (allocated storages under every weight tensor) and the process ``rss``."""
        return memory_stats(self.state.pool, self.model, self.state.shards, self.tracked_bytes())

    # ---- accounting ----------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, read from the tensors: switchable projections, replicated attention
        weights, KV pool."""
        replicated = 0
        for layer in self.model.model.layers:
            for p in layer.self_attn.parameters():
                replicated += p.numel() * p.element_size()
        return {"switchable": sum(s.nbytes for s in self.state.shards), "replicated_attention": replicated,
                "kv_pool": self.state.pool.nbytes}
