"""Engine: the inference engine on one rank of a T-rank group (T = 1 included) -- one code path.

Every rank runs the same scheduler replica (admission, owners, page grants, chunked prefill,
switch re-placement: all deterministic) and keeps its own page tables (``BlockTable``, a device
tensor) and KV pool. Rank 0 is the driver: it decides what no replica can compute -- the layout
(``LayoutDriver``), the draft cap, when to stop -- and before each step sends every rank one small
``StepControl``. Every rank samples the rows its layout gives it (``executor.sampling_ranks``: a
DP-attention rank its own requests', the replicated layouts an even share) and one all-gather of
the sampled tokens brings every replica the whole step. A step then reads like the algorithm::

    control = exchange(decide())        # rank 0 decides, every rank hears it
    enter(control.switch)                # a live switch: every rank re-places the same way
    scheduled = scheduler.schedule()     # the same on every rank
    logits = forward(batch of scheduled) # this rank's part, through its layout's executor
    sample (this rank's rows), gather every rank's, postprocess   # every rank, the same tokens

Under DP-attention a control message may open a token window of K steps (engine/token_window.py):
the ranks run K such steps with no message and no gather between them, each appending its own
tokens for real and the others' provisionally, and one all-gather after the K-th settles them all.

Each rank holds only its share of the weights: the switchable projections of its layout's head
slice (``ProjectionShard``), its feed-forward shard, and the replicated rest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from splash_rollout.distributed.collectives import Comm
from splash_rollout.distributed.groups import ProcessGroups
from splash_rollout.engine.attention import get_backend
from splash_rollout.engine.block_table import BlockTable
from splash_rollout.engine.cpu_share import CpuShare
from splash_rollout.engine.cuda_graphs import DecodeGraphs, decode_buckets
from splash_rollout.engine.executors.base import element_bytes, step_shape
from splash_rollout.engine.executors.cp import CPExecutor
from splash_rollout.engine.executors.dop import DOPExecutor
from splash_rollout.engine.executors.dp import DPExecutor
from splash_rollout.engine.executors.tp import TPExecutor
from splash_rollout.engine.forward_batch import ForwardBatch, device_index
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec
from splash_rollout.engine.kv_switch import retire_source_pages, switch_placement
from splash_rollout.engine.drafter import SuffixDrafter
from splash_rollout.engine.mtp_drafter import (MTPDrafter, ShadowRows, empty_mtp_module, mtp_shapes, mtp_targets,
                                                take_mtp_module)
from splash_rollout.engine.speculation_gate import SpeculationGate
from splash_rollout.scheduling.cost_model import StepBatch
from splash_rollout.engine.layout_driver import LayoutDriver
from splash_rollout.engine.options import EngineSettings
from splash_rollout.engine.model_runner import ModelRunner
from splash_rollout.engine import rank_weights
from splash_rollout.engine.parallel_mlp import placement_problem
from splash_rollout.engine.placement import KVPlacement
from splash_rollout.engine.rank_weights import RankShare
from splash_rollout.engine.rank_state import RankState
from splash_rollout.engine.request import Request
from splash_rollout.engine.routing_capture import RoutingRecorder
from splash_rollout.engine.step_hooks import CopyOnWrite, RoutingCapture, StepHooks
from splash_rollout.engine.step_log import StepClock, StepRecord, step_record
from splash_rollout.engine.sampler import SamplingBatch, sample
from splash_rollout.engine.request_scheduler import ScheduledSeq, Scheduler
from splash_rollout.engine.sleep import TensorOffload, memory_stats, release_memory, restore_memory
from splash_rollout.engine.step_control import StepControl, exchange
from splash_rollout.engine.switch_step import RankSwitch, SwitchOrder, merge_measures
from splash_rollout.engine.token_window import TokenWindow, provisional, window_steps
from splash_rollout.layout.bytes import AttentionBytes
from splash_rollout.layout.footprint import pool_tokens
from splash_rollout.layout.layouts import Layout
from splash_rollout.layout.rank_view import RankView
from splash_rollout.layout.traffic import BY_LAYOUT, Collective
from splash_rollout.models.weights import Target
from splash_rollout.models.config import ModelConfig
from splash_rollout.models.weights import WeightSource

EXECUTORS = {Layout.TP: TPExecutor, Layout.DP: DPExecutor, Layout.DOP: DOPExecutor, Layout.CP: CPExecutor}
_BYTES_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "bf16"}


def sizes_for(config: ModelConfig, dtype: torch.dtype) -> AttentionBytes:
    """The ownership model's byte table for this engine's dtype (weights and KV stored alike)."""
    name = _BYTES_NAME[dtype]
    return AttentionBytes.from_model(config, name, name)


def pages_per_rank(config: ModelConfig, layout: Layout, world_size: int, budget_bytes: int, page_size: int,
                   dtype: torch.dtype) -> int:
    """KV pages one rank gets from ``budget_bytes`` after its layout's attention weights."""
    sizes = sizes_for(config, dtype)
    weights = (sizes.w_a // world_size if layout.shards_projections else sizes.w_a) + sizes.w_replicated
    return pool_tokens(budget_bytes, weights, sizes.kv_bytes_per_token_total, page_size) // page_size


@dataclass(frozen=True)
class StepEvent:
    """What rank 0 tells a serve call's ``on_step`` after each step."""

    step: int
    layout: str
    done: int
    """Requests of this call finished so far."""
    total: int
    """Requests of this call (finished + still queued or running)."""
    new_tokens: int
    """Tokens this step appended to its requests (a verification's kept drafts and the token after
    them; inside a token window, each step's sampled tokens)."""
    seconds: float


@dataclass
class _SamplePlan:
    """Who draws which of a step's samples (made before the forward)."""

    sample_rank: list[int]
    """[S] the rank drawing each of the step's samples, scheduled order."""
    picked: list[int]
    """[s] the rows of this rank's logits its samples draw from."""
    params: SamplingBatch | None
    """Their settings on the device (None: this rank draws nothing this step)."""


@dataclass
class _Step:
    """What a rank remembers of the step it just ran."""

    written: int
    """Tokens the step appended (``StepEvent.new_tokens``)."""
    finished: list[Request] = field(default_factory=list)
    """The requests that finished in this step."""


class Engine:
    def __init__(self, weights: torch.nn.Module | WeightSource, config: ModelConfig, groups: ProcessGroups,
                 settings: EngineSettings, *, policy=None, price_step=None,
                 heartbeat: Callable[[dict], None] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> None:
        """weights: where this rank's weights come from -- a ``WeightSource`` (a checkpoint's files, a
        preset's seeded init: the rank reads only the parts it holds, engine/rank_weights.py), or a
        whole in-memory model, which this rank takes over in place (moved to the device, other ranks'
        parts dropped).
        policy: a scheduling.LayoutPolicy on rank 0 (layout="auto"); price_step: on rank 0 with
        ``speculation="auto"``, (layout, StepBatch) -> predicted seconds; heartbeat: called on every
        rank after each step with {step, finished} (a spawned rank's sign of life); should_abort:
        polled by rank 0 at each step boundary -- when true every unfinished request of the call is
        aborted (finish_reason ``abort``, pages freed) and ``serve`` returns normally."""
        t, rank = groups.world_size, groups.rank
        self.config, self.groups, self.settings = config, groups, settings
        self.rank, self.world_size, self.page_size = rank, t, settings.memory.page_size
        self.device = torch.device(settings.device)
        self.comm = Comm(groups.compute, rank, t, channel=groups.compute_channel, device=self.device)
        """The step's collectives (device tensors: NCCL on GPUs)."""
        self.transfer = Comm(groups.transfer, rank, t, self.comm.counter, device=self.device, name="transfer")
        """A live switch's weight and KV transfers (device tensors), apart from the step's."""
        self.control = Comm(groups.control, rank, t, self.comm.counter, channel=groups.control_channel,
                            name="control")
        """Host data on gloo: the driver's control message, the sampled tokens, measures."""
        problem = placement_problem(settings.parallel.feed_forward, settings.outputs.return_routing, t)
        if problem:
            raise ValueError(problem)
        drafts_mtp = settings.draft == "mtp"
        if drafts_mtp and config.num_mtp_layers < 1:
            raise ValueError(f"draft='mtp': the model {config.name!r} declares no MTP module (num_mtp_layers=0); "
                             f"use draft='ngram'")
        mtp_module = None
        """Rank 0 drafting with the MTP module: the module, whole (the other ranks hold none of it);
        taken from a handed-in model before it is placed, or read from a source with the rank's own tensors."""
        if drafts_mtp and rank == 0:
            mtp_module = (take_mtp_module(weights, self.device) if isinstance(weights, torch.nn.Module)
                          else empty_mtp_module(weights, config, settings.dtype, self.device))
        view = RankView(settings.layout, rank, t, config.num_heads)
        share = RankShare(rank, t, view.head_slice, settings.parallel.feed_forward)
        self._mtp_targets = mtp_targets(mtp_module) if mtp_module is not None else {}
        """Rank 0 drafting with the MTP module: its tensors by full name (what a load and a push write)."""
        placed = (rank_weights.adopt(weights, share, self.device, self.comm) if isinstance(weights, torch.nn.Module)
                  else rank_weights.load(config, weights, share, settings.dtype, self.device, self.comm,
                                         also=self._mtp_targets))
        model, shards = placed.model, placed.shards
        self.full_shapes = {**placed.full_shapes, **(mtp_shapes(config, settings.dtype) if drafts_mtp else {})}
        """Unsharded parameter shapes and dtypes: what ``update_weights`` validates against (the MTP
        module's too when the engine drafts with it: a push carries it)."""
        num_pages = settings.initial_pages
        pool = KVPool(KVPoolSpec.from_model(config), num_pages, settings.memory.page_size, settings.dtype, self.device)
        self.state = RankState(view, pool, get_backend(settings.compute.attention_backend), shards, self.comm)
        self.model = model
        self.runner = ModelRunner(model, EXECUTORS[settings.layout](self.state))
        memory, batching, compute = settings.memory, settings.batching, settings.compute
        longest = {"max_draft": compute.max_draft_tokens} if compute.max_draft_tokens else {}  # else the drafter's
        self.mtp = (MTPDrafter(mtp_module, model.model.embed_tokens, model.model.norm, model.lm_head.weight, **longest)
                    if drafts_mtp else None)
        """Drafting with the MTP module: every rank's drafter (rank 0's computes, engine/mtp_drafter.py)."""
        drafter = self.mtp if drafts_mtp else SuffixDrafter(**longest) if settings.draft == "ngram" else None
        self.scheduler = Scheduler(KVPlacement([num_pages] * t, memory.page_size, settings.layout),
                                   batching.max_num_batched_tokens, batching.max_num_seqs,
                                   ever_admits=self.can_ever_admit, admission=memory.admission_settings,
                                   prefix_sharing=memory.prefix_sharing, drafter=drafter,
                                   prefix_cache=memory.prefix_cache and not settings.outputs.return_routing)
        """This rank's replica: the same decisions on every rank."""
        self.gate = (SpeculationGate(lambda step: price_step(self.layout, step), self.scheduler.drafter.stats,
                                     draft_cost=self.mtp.cost if self.mtp is not None else None,
                                     draft_layer_share=1.0 / config.num_layers, max_draft=drafter.max_draft)
                     if compute.speculation == "auto" and rank == 0 and price_step is not None else None)
        """Rank 0 under ``speculation="auto"``: the draft cap of each step."""
        self.block_table = BlockTable(batching.max_num_seqs, self.device)
        self.driver = LayoutDriver(policy if rank == 0 else None, settings.switch_schedule, settings.driver)
        self.heartbeat, self.should_abort = heartbeat, should_abort
        self.routing = (RoutingRecorder(sum(map(config.is_moe_layer, range(config.num_layers))),
                                        config.num_experts_per_tok) if settings.outputs.return_routing and rank == 0 else None)
        """Rank 0 with ``return_routing``: each request's routed experts, until its result takes them."""
        self.hooks = StepHooks(([RoutingCapture(self.routing, self.scheduler)] if self.routing is not None else [])
                               + ([CopyOnWrite(self.scheduler, lambda: self.state.pool, rank)]
                                  if memory.prefix_sharing else []))
        """Optional work around each step's forward (engine/step_hooks.py)."""
        self.buckets, self.graphs = compute.decode_buckets, None
        """Decode buckets in use, and the CUDA graphs of decode steps (None: eager)."""
        if compute.cuda_graphs == "on" and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs='on' needs a CUDA device; this engine runs on {self.device} (use 'auto')")
        if compute.cuda_graphs != "off" and self.device.type == "cuda" and not settings.outputs.return_routing:
            self.buckets = self.buckets or decode_buckets(batching.max_num_seqs)
            self.graphs = DecodeGraphs(self.runner.hidden, self.block_table, pool, self.comm, self.control,
                                       memory.page_size, self.buckets,
                                       -(-settings.max_model_len // memory.page_size),
                                       check=compute.cuda_graphs == "auto",
                                       reserve_bytes=settings.graph_reserve_bytes)
            self.graphs.capture_all(self.layout, self._graphable(self.layout))
        self.cpu_share = CpuShare(torch.get_num_threads(),
                                  enabled=compute.cpu_share and t == 1 and self.device.type == "cpu")
        """Threads per step (one CPU rank): fewer while other processes hold the cores."""
        self.window = TokenWindow.closed()
        """The token window the ranks are decoding (engine/token_window.py); one step outside one."""
        self.num_steps = 0
        self.step_log: list[StepRecord] = []
        """Rank 0: one record per step (engine/step_log.py documents its fields)."""
        self.switch_log: list[dict] = []
        """Rank 0: one record per switch or deferral."""
        self.switch_measures: list[dict] = []
        """Every rank: bytes and waits of each switch it took part in (merged into switch_log)."""
        self._offload: TensorOffload | None = None
        """While asleep: the weights' storages, moved out of tensor memory (engine/sleep.py)."""
        self.failed: str | None = None
        """Why a ``serve`` failed on this rank (T > 1). The ranks are then out of step (some may have
        left a collective, a switch may be half-moved), so this engine refuses every later call."""

    @classmethod
    def single(cls, weights: torch.nn.Module | WeightSource, config: ModelConfig,
               settings: EngineSettings, **kwargs) -> "Engine":
        """One rank in this process (T = 1): the same engine, with collectives that are no-ops."""
        return cls(weights, config, ProcessGroups.single(), settings, **kwargs)

    @property
    def layout(self) -> Layout:
        return self.state.view.layout

    def step_traffic(self, batch: ForwardBatch) -> list[Collective]:
        """What one layer of ``batch``'s step sends between the ranks in the current layout: the
        layout's account (``layout/traffic.BY_LAYOUT``), the one the cost model prices."""
        shape = step_shape(batch, self.config, self.world_size, self.settings.parallel.feed_forward,
                           element_bytes(self.settings.dtype))
        return BY_LAYOUT[self.layout](shape)

    @property
    def decision_log(self) -> list[dict]:
        return self.driver.decision_log

    # ---- serving (every rank) -----------------------------------------------------------------
    def serve(self, requests: list[Request] | None = None, max_steps: int | None = None,
              on_step: Callable[[StepEvent], None] | None = None, new_call: bool = True) -> list[Request] | None:
        """Run a batch of requests to completion. Every rank passes the same requests (a replica
        each); rank 0 returns the finished ones, the other ranks None. With ``max_steps`` the call
        stops early and leaves the rest running for the next call. ``on_step`` (rank 0) sees every step.
        ``new_call=False``: this call continues the previous one (a serving loop's next poll), whose
        length statistics and events the layout driver and the speculation gate keep."""
        if self.asleep:  # every rank refuses before any collective; the engine stays usable
            raise RuntimeError("serve: the engine is asleep; call wake_up() first")
        if self.failed is not None:
            raise RuntimeError(f"Engine (rank {self.rank}): unusable after an earlier failure ({self.failed}); "
                               f"build a new engine")
        try:
            return self._serve(requests or [], max_steps, on_step, new_call)
        except BaseException as e:
            if self.world_size > 1:  # one rank cannot be out of step with itself: it stays usable
                self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            raise

    def _serve(self, requests: list[Request], max_steps: int | None, on_step, new_call: bool) -> list[Request] | None:
        if requests and not self.scheduler.has_unfinished:
            self.scheduler.estimate.reset()
            if self.scheduler.drafter is not None:
                self.scheduler.drafter.new_call()
        for req in requests:
            self.scheduler.add(req)
        if new_call:
            self.driver.new_call()
            if self.gate is not None:
                self.gate.new_call()
        finished: list[Request] = []
        prev: _Step | None = None
        steps = 0
        mid_step = False  # between the control message and the end of the step (or of its window)
        try:
            while True:
                t0 = time.perf_counter()
                switch, nbytes = None, 0
                if self.window.is_over:  # the ranks meet: a control message for the next step or window
                    control, nbytes = exchange(self.control, self._decide(steps, max_steps) if self.rank == 0 else None)
                    if control.failed is not None:
                        raise RuntimeError(f"rank {self.rank}: the driver (rank 0) failed: {control.failed}")
                    if control.stop:
                        if control.abort:
                            finished.extend(self.abort_all())
                        break
                    self.scheduler.draft_cap, switch = control.draft_cap, control.switch
                    if self.mtp is not None:
                        self.mtp.receive(control.drafts)
                    self.window = TokenWindow(control.window)
                mid_step = True
                with self.cpu_share.step():
                    prev = self._step(switch, nbytes, time.perf_counter() - t0)
                mid_step = not self.window.is_over
                steps += 1
                if self.rank == 0:
                    ended = prev.finished
                    finished.extend(ended)
                    self.driver.observe_finished(ended)
                    if on_step is not None:
                        waiting = len(self.scheduler.running) + len(self.scheduler.waiting)
                        on_step(StepEvent(self.num_steps - 1, self.layout.value, len(finished), len(finished) + waiting,
                                          prev.written, self.step_log[-1].seconds))
                if self.heartbeat is not None:
                    self.heartbeat({"step": self.num_steps, "finished": len(finished)})
        except BaseException as e:
            if self.rank == 0 and not mid_step and self.world_size > 1:
                try:  # they wait for a control message: tell them. Mid-step they sit in a collective
                    exchange(self.control, StepControl(stop=True, failed=f"{type(e).__name__}: {e}"))
                except Exception:  # noqa: BLE001 - the cause is raised below
                    pass
            self.abort_all()
            raise
        finally:
            self.window = TokenWindow.closed()
        merge_measures(self.control, self.switch_measures, self.switch_log if self.rank == 0 else None)
        self.switch_measures = []
        return finished if self.rank == 0 else None

    def _decide(self, steps: int, max_steps: int | None) -> StepControl:
        """Rank 0 at a step boundary: stop, abort, or go on (with a switch the driver chose, or for a
        token window of several steps)."""
        if self.should_abort is not None and self.should_abort():
            return StepControl(stop=True, abort=True)
        if not self.scheduler.has_unfinished or (max_steps is not None and steps >= max_steps):
            return StepControl(stop=True)
        switch = self.driver.at_boundary(self.layout, self.num_steps, self.scheduler)
        cap = self._draft_cap()
        window = 1
        if switch is None and cap == 0 and self._windows_possible:
            window = window_steps(self.settings.parallel.decode_window, self.scheduler,
                                  None if max_steps is None else max_steps - steps,
                                  self.driver.quiet_steps(self.num_steps))
        drafts = ()
        if self.mtp is not None and cap > 0:
            drafts = self.mtp.draft([r for r in self.scheduler.running if not r.in_prefill], cap)
        return StepControl(switch, draft_cap=cap, window=window, drafts=drafts)

    @property
    def _windows_possible(self) -> bool:
        """Whether the current layout lets ranks decode a token window between exchanges: ranks that
        feed back only their own tokens, and no per-token record that follows every step on rank 0."""
        return (self.world_size > 1 and self.settings.parallel.decode_window > 1 and self.runner.executor.inputs_stay_local
                and self.routing is None)

    def _draft_cap(self) -> int:
        """Rank 0: how many tokens each decoding request may draft next step."""
        drafter = self.scheduler.drafter
        if drafter is None:
            return 0
        if self.gate is None:
            return drafter.max_draft
        return self.gate.choose_for(self.num_steps, self.scheduler).cap

    def _step(self, switch: tuple[Layout, bool] | None, control_bytes: int, control_s: float) -> "_Step":
        """One step on this rank after its control message: switch, schedule, batch, forward, sample."""
        clock = StepClock(control_s)
        order = self._enter(*switch) if switch is not None else None
        scheduled = self._schedule()
        clock.lap("schedule")
        batch = self._batch(scheduled, self.layout if order is None else order[0].dst, order is not None)
        plan = self._sampling_plan(scheduled, batch, self.runner.executor if order is None
                                   else EXECUTORS[order[0].dst](self.state))  # its inputs sent before the forward
        clock.lap("batch")
        with self.hooks.forward(scheduled, batch):
            hidden, logits = self._forward(batch, order)
        clock.lap("forward")
        step = self._finish(scheduled, batch, logits, order, plan)
        if self.mtp is not None and self.rank == 0 and self.window.steps == 1:  # (a window's tokens are provisional)
            self.mtp.shadow(self._shadow_rows(scheduled, batch, hidden))
        clock.lap("sample")
        self._record(scheduled, batch, clock, control_bytes, switched=order is not None)
        return step

    def _schedule(self) -> list[ScheduledSeq]:
        """The step's requests (the same on every rank); retracted requests give their rows back."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            raise RuntimeError("step: nothing schedulable although requests are pending")
        for r in self.scheduler.retracted:
            self.block_table.release(r.request_id)
        return scheduled

    def _finish(self, scheduled: list[ScheduledSeq], batch: ForwardBatch, logits: torch.Tensor, order,
                plan: "_SamplePlan") -> "_Step":
        """Every rank samples its rows, hears the others' and post-processes the same tokens -- at the
        end of the step, or inside a token window provisionally until its last step; a switch
        retires the pages it moved away from."""
        window = self.window
        window.check_step(scheduled, bool(self.scheduler.retracted))
        sample_rank = plan.sample_rank
        tokens, logprobs = self._sample(plan, logits)
        window.hold(tokens, logprobs)
        if window.steps > 1:  # every step of a window appends provisionally; its last one settles them all
            self.scheduler.postprocess_provisional(scheduled, *provisional(sample_rank, self.rank, tokens, logprobs))
        ended: list[Request] = []
        if window.is_over:
            all_tokens, all_logprobs = self._gather_samples(sample_rank, *window.held(), batch.num_tokens)  # [K, S]
            ended = self._apply_samples(scheduled, all_tokens, all_logprobs)
        step = _Step(self.scheduler.written if window.steps == 1 else len(sample_rank), ended)
        if order is not None:
            retire_source_pages(self.scheduler.placement, order[1])
        self.num_steps += 1
        return step

    def _record(self, scheduled: list[ScheduledSeq], batch: ForwardBatch, clock: StepClock, control_bytes: int,
                switched: bool) -> None:
        """Rank 0: the step's log row, handed to the layout driver (dwell, online θ correction)."""
        if self.rank != 0:
            return
        if self.mtp is not None:  # the module's passes: its chain (in control) and its rows after sampling
            clock.split["mtp"] = self.mtp.take_spent()
        note = self.gate.take_change() if self.gate is not None else None  # a draft cap changed before this step
        record = step_record(self.num_steps - 1, self.layout.value, scheduled, batch, self.scheduler, clock,
                             control_bytes, self.cpu_share.current, self.driver.take_policy_s(), note)
        self.step_log.append(record)
        self.driver.observe_step(record, scheduled)
        if switched:
            self.switch_log[-1]["step_seconds"] = record.seconds
        if self.gate is not None:
            self._feed_gate(scheduled, record, switched)

    def _feed_gate(self, scheduled: list[ScheduledSeq], record: StepRecord, switched: bool) -> None:
        """Rank 0 under ``speculation="auto"``: what the step's cap bought, what it wrote in its seconds,
        and, for a decode step that did not switch, what it cost against θ."""
        self.gate.record(record.draft_cap, record.verified, record.draft_tokens, record.accepted_tokens,
                         record.accepted_sq)
        if not switched:
            self.gate.measure(record.tokens_written, record.seconds, drafted=record.draft_tokens > 0)
        if switched or record.prefill_rows:
            return
        rows = np.fromiter((s.num_new for s in scheduled), dtype=np.int64, count=len(scheduled))
        context = np.fromiter((s.end for s in scheduled), dtype=np.int64, count=len(scheduled))
        self.gate.observe(StepBatch.make(context, rows, np.zeros_like(rows)),  # θ prices the rows, not the module
                          record.seconds - record.split_s.get("mtp", 0.0), drafted=record.draft_tokens > 0)

    def _sampling_plan(self, scheduled: list[ScheduledSeq], batch: ForwardBatch, executor) -> "_SamplePlan":
        """Who draws which of the step's samples, in scheduled order: one per sampling chunk, one per
        follower forked off it (it samples from its leader's last prompt row with its own seed), one
        per verified row; ``executor`` (the step's layout's) deals the rows over the ranks. This rank's
        draws' settings go to the device now, before the forward is launched."""
        specs, draws, rows = [], [], []
        row = 0
        for seq in scheduled:
            if seq.draft:  # each verified row draws as the token it would produce: draws n, n + 1, ...
                n = seq.request.num_output_tokens
                specs += [seq.request.spec] * seq.num_sampled
                draws += range(n, n + seq.num_sampled)
                rows += range(row, row + seq.num_sampled)
            elif seq.samples:
                for r in (seq.request, *seq.forks):
                    specs.append(r.spec)
                    draws.append(r.num_output_tokens)
                    rows.append(row)
            row += seq.num_sampled
        row_rank = executor.sampling_ranks(batch)  # [R], host
        local_row, mine = [], 0  # a sampled row's place among this rank's logits
        for r in row_rank:
            local_row.append(mine)
            mine += r == self.rank
        sample_rank = [row_rank[j] for j in rows]  # [S]
        here = [j for j, r in enumerate(sample_rank) if r == self.rank]
        params = (SamplingBatch.make([specs[j] for j in here], [draws[j] for j in here], self.device)
                  if here else None)
        return _SamplePlan(sample_rank, [local_row[rows[j]] for j in here], params)

    def _sample(self, plan: "_SamplePlan", logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """This rank's draws from ``logits`` [r, vocab], read back in one transfer (the step's one host
        sync): (tokens [s], logprobs [s]) on the host, in sample order."""
        if plan.params is None:
            return [], []
        if plan.picked != list(range(logits.shape[0])):
            logits = logits.index_select(0, device_index(plan.picked, logits.device))
        tokens, logprobs = sample(logits, plan.params)
        pairs = torch.stack([tokens.double(), logprobs.double()], dim=1).tolist()  # one read back: [s, 2]
        return [int(t) for t, _ in pairs], [lp for _, lp in pairs]

    def _gather_samples(self, sample_rank: list[int], tokens: list[list[int]], logprobs: list[list[float]],
                        rows: int) -> tuple[list[list[int]], list[list[float]]]:
        """Every rank's sampled tokens and logprobs [K][S] in scheduled order, from this rank's
        (tokens / logprobs [K][s]: the K steps of its window) and one all-gather on the control group
        (host data). Each rank's piece starts with what its replica scheduled (samples, query rows):
        replicas that disagree raise here, naming both counts, before any token is applied."""
        if self.world_size == 1:
            return tokens, logprobs
        steps = len(tokens)
        counts = [steps * sum(1 for r in sample_rank if r == q) for q in range(self.world_size)]
        mine = np.empty((1 + sum(len(t) for t in tokens), 2), dtype=np.float64)  # [1 + Ks, 2]
        mine[0] = (len(sample_rank), rows)
        mine[1:, 0] = [t for step in tokens for t in step]
        mine[1:, 1] = [lp for step in logprobs for lp in step]
        got = self.control.all_gather_uneven(torch.from_numpy(mine), [c + 1 for c in counts],
                                             tag="step/tokens").numpy()  # [T + KS, 2], host
        starts = np.cumsum([0] + [c + 1 for c in counts])[:-1]
        for q, at in enumerate(starts.tolist()):
            if q != self.rank and not np.array_equal(got[at], mine[0]):
                raise RuntimeError(f"rank {self.rank}: scheduler replica diverged from rank {q}'s in step "
                                   f"{self.num_steps}: it sampled {int(mine[0, 0])} tokens over {rows} rows, "
                                   f"rank {q} {int(got[at, 0])} over {int(got[at, 1])}")
        body = np.concatenate([got[at + 1: at + 1 + c].reshape(steps, -1, 2)
                               for at, c in zip(starts.tolist(), counts)], axis=1)  # [K, S, 2] rank order
        pairs = np.empty_like(body)
        pairs[:, np.argsort(np.asarray(sample_rank), kind="stable")] = body  # scheduled order
        return pairs[..., 0].astype(np.int64).tolist(), pairs[..., 1].tolist()

    def _batch(self, scheduled: list[ScheduledSeq], layout: Layout, switching: bool) -> ForwardBatch:
        """This rank's ForwardBatch in ``layout`` (the step's: a switch's destination): O(B) Python plus
        tensor ops on the device; a plain decode step padded to its bucket where buckets are on."""
        reqs = [s.request for s in scheduled]
        widest = max(-(-(s.start + s.num_new) // self.page_size) for s in scheduled)
        view = RankView(layout, self.rank, self.world_size, self.config.num_heads)
        whole = [view.holds_whole(-(-(s.start + s.num_new) // self.page_size), r.owner) for s, r in zip(scheduled, reqs)]
        ids: list[int] = []
        for s in scheduled:
            ids += s.tokens()
        starts, owners = [s.start for s in scheduled], [r.owner for r in reqs]
        bucket = None if switching else self._decode_bucket(scheduled, widest)
        if bucket is None:
            table = self.block_table.slice(self.block_table.rows(reqs, self.rank), widest)
            return ForwardBatch.from_rows(ids, starts, [s.num_new for s in scheduled], [s.num_sampled for s in scheduled],
                                          owners, table, self.page_size, whole)
        size, pages = bucket
        rows = self.block_table.rows(reqs, self.rank, pages) + [self.block_table.empty_row] * (size - len(reqs))
        return ForwardBatch.padded_decode(ids, starts, owners, self.block_table.slice(rows, pages), self.page_size,
                                          size, whole)

    def _decode_bucket(self, scheduled: list[ScheduledSeq], widest_pages: int) -> tuple[int, int] | None:
        """(requests, pages) a plain decode step pads to -- the smallest bucket that holds it and a power
        of two of pages --, or None: no buckets, not a plain decode (a prefill chunk, drafts, forks), a
        layout whose shapes follow the owners, or more requests than the largest bucket."""
        buckets = self.buckets
        if not buckets or not self.runner.executor.fixed_shapes:
            return None
        if any(s.num_new != 1 or s.num_sampled != 1 or s.draft or s.forks for s in scheduled):
            return None
        size = next((b for b in buckets if b >= len(scheduled)), None)
        return None if size is None else (size, 1 << (max(widest_pages, 1) - 1).bit_length())

    def _graphable(self, layout: Layout) -> bool:
        """Whether ``layout``'s padded decode steps replay graphs: one rank, or TP (every rank carries
        every row and stores every history; its collectives do not follow the owners)."""
        return self.world_size == 1 or layout is Layout.TP

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch, order) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one step: (the last layer's output [n, hidden] on the rows this rank
        carries, the logits [r, vocab] of the rows it samples)."""
        if order is None:
            hidden = None
            if self.graphs is not None and batch.num_real is not None and self._graphable(self.layout):
                hidden = self.graphs.hidden(batch, self.layout)
            if hidden is None:
                hidden = self.runner.hidden(batch)
            return hidden, self.runner.logits(hidden, batch)
        if self.graphs is not None:  # a switch replaces the projection shards (and may resize the pool)
            self.graphs.invalidate()
        switch = RankSwitch(order[0], self.state, [layer.self_attn for layer in self.model.model.layers],
                            self.transfer, self.tracked_bytes, self.page_size)
        self.runner.executor = EXECUTORS[order[0].dst](self.state)
        hidden = self.runner.hidden(batch, before_layer=switch.before_layer)
        self.switch_measures.append(switch.measure())
        return hidden, self.runner.logits(hidden, batch)

    def _shadow_rows(self, scheduled: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor) -> list[ShadowRows]:
        """Rank 0 after a step's tokens are applied: each request's verified rows this rank carries --
        position i with token i + 1 now known -- with the decoder's last-layer output there; a follower
        forked off its leader's last prompt row takes that row with its own first token. hidden:
        [n, hidden], the rows ``local_rows_host`` names (every row: None)."""
        carried = self.runner.executor.local_rows_host(batch)
        place = None if carried is None else {row: i for i, row in enumerate(carried)}
        rows: list[ShadowRows] = []
        row = 0
        for seq in scheduled:
            req, first, start = seq.request, row, seq.end - seq.num_new  # (``seq.start`` has moved on)
            row += seq.num_new
            if req.is_finished or (place is not None and first not in place):
                continue
            valid = min(seq.num_new, req.num_tokens - 1 - start)
            if valid <= 0:
                continue
            at = first if place is None else place[first]
            states = hidden[at: at + valid]  # [valid, hidden], before the final norm
            rows.append(ShadowRows(req.request_id, start, req.tokens_at(start + 1, valid), states))
            for fork in seq.forks:
                if not fork.is_finished and fork.num_tokens == seq.end + 1:
                    rows.append(ShadowRows(fork.request_id, seq.end - 1, [fork.output_ids[0]], states[-1:],
                                           copy_from=req.request_id))
        return rows

    def _enter(self, dst: Layout, blocking: bool):
        """Every rank at a step boundary: re-place the running histories under ``dst`` (the same on
        every rank), or defer. Returns (SwitchOrder, PlacementSwitch), or None when deferred."""
        by_layout = self.settings.pages_by_layout
        capacity = [by_layout[dst]] * self.world_size if by_layout else None
        self.scheduler.clear_cache()  # the cached histories are placed for the source layout
        running = list(self.scheduler.running)
        result = switch_placement(self.scheduler.placement, running, dst, capacity, list(self.scheduler.waiting),
                                  self.scheduler.pages_promised(dst))
        record = {"src": self.layout.value, "dst": dst.value, "step": self.num_steps, "blocking": blocking,
                  "deferred_reason": None, "cause": self.driver.pending_cause}
        if isinstance(result, str):  # serving goes on in the source; the driver retries next boundary
            record["deferred_reason"] = result
            last = self.switch_log[-1] if self.switch_log else {}
            if self.rank == 0 and (last.get("deferred_reason") != result or last.get("dst") != dst.value):
                self.switch_log.append(record)
            return None
        self.driver.switched()
        self.block_table.rewrite(running)
        if self.rank == 0:
            record["moves"] = [(m.num_tokens, m.owner) for m in result.moves]
            self.switch_log.append(record)
        pool_pages = by_layout[dst] if by_layout else None
        return SwitchOrder(result.src, dst, result.moves, blocking, pool_pages), result

    def _apply_samples(self, scheduled: list[ScheduledSeq], tokens: list[list[int]],
                       logprobs: list[list[float]]) -> list[Request]:
        """Every rank's tokens / logprobs [K][S] into the replica -- one step's, or a token window's K
        settled at its close -- and the ended requests' block-table rows released."""
        ended = (self.scheduler.postprocess(scheduled, tokens[0], logprobs[0]) if len(tokens) == 1
                 else self.scheduler.settle(scheduled, tokens, logprobs))
        for r in ended:
            self.block_table.release(r.request_id)
        return ended

    def abort_requests(self, request_ids) -> list[Request]:
        """Every rank, between steps: the named queued or running requests end with finish_reason
        ``abort`` (their computed pages go to the prefix cache, the rest are freed); ids not in the
        engine (finished already, never seen) are skipped. Returns the aborted requests."""
        wanted = set(request_ids)
        if not wanted:
            return []
        sched = self.scheduler
        aborted: list[Request] = []
        for req in [r for r in list(sched.running) + list(sched.waiting) if r.request_id in wanted]:
            if req.is_finished:  # a follower its aborted leader took along
                continue
            if req.fork_of is not None:  # a follower waiting for its leader's prompt: the leader forgets it
                req.fork_of.forks.remove(req)
            followers = list(req.forks)  # they wait for this prompt: they end with it
            sched.finish(req, "abort")
            for r in [req, *followers]:
                self.block_table.release(r.request_id)
                aborted.append(r)
        return aborted

    def abort_all(self) -> list[Request]:
        """Every queued and running request ends with finish_reason ``abort``; their pages are freed."""
        aborted = self.scheduler.abort_all()
        for r in aborted:
            self.block_table.release(r.request_id)
        return aborted

    # ---- requests and layouts ----------------------------------------------------------------------
    def can_ever_admit(self, request: Request) -> bool:
        """Whether ``request`` can ever run here: in the current layout's empty pools or, when the
        policy chooses layouts (auto) and memory follows the layout, in any layout it may enter
        (a request only DOP's larger pool holds waits at the queue head until the policy moves)."""
        placement = self.scheduler.placement
        by_layout = self.settings.pages_by_layout
        if not self.settings.reachable_layouts or not by_layout:
            return placement.can_ever_admit(request)
        return any(placement.can_ever_admit(request, l, [by_layout[l]] * self.world_size)
                   for l in self.settings.reachable_layouts)

    def request_switch(self, dst: Layout | str, blocking: bool = False) -> None:
        """Rank 0: switch to ``dst`` at the next step boundary."""
        self.driver.request(Layout.parse(dst, "dst"), blocking)

    def update_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Every rank: slice the full tensors into this rank's shards (rejected as a whole if bad)."""
        from splash_rollout.engine.weight_update import apply_update, validate_update

        if self.asleep:
            raise RuntimeError("update_weights: the engine is asleep; call wake_up() first")
        validate_update(named, self.full_shapes, check_finite=False)  # values: checked once, by the caller
        apply_update(self._weight_targets(), named)
        self.scheduler.clear_cache()  # cached KV was computed by the old weights

    def held_parts(self) -> dict[str, list[tuple]]:
        """Full tensor name -> the parts of it this rank holds now (its current layout's heads, its
        experts and MLP slices): what a driver cuts a push for this rank by."""
        return rank_weights.held_parts(self._weight_targets())

    def _weight_targets(self) -> dict[str, list[Target]]:
        """Full tensor name -> this rank's tensors holding a part of it (the drafting MTP module's on rank 0)."""
        return {**rank_weights.rank_targets(self.model, self.state.shards), **self._mtp_targets}

    def update_parts(self, parts: list[tuple[str, tuple, torch.Tensor]]) -> None:
        """Every rank: parts of a validated push that a driver cut for this rank (``held_parts``)."""
        from splash_rollout.engine.weight_update import apply_parts

        if self.asleep:
            raise RuntimeError("update_weights: the engine is asleep; call wake_up() first")
        apply_parts(self._weight_targets(), parts)
        self.scheduler.clear_cache()  # cached KV was computed by the old weights

    # ---- sleep / wake (every rank; engine/sleep.py) ----------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._offload is not None

    def sleep(self) -> None:
        """Free this rank's KV pool and move its weights out of tensor memory. Refused (nothing
        released) while requests are queued or running -- the same answer on every replica."""
        if self.asleep:
            raise RuntimeError("sleep: the engine is already asleep")
        if self.scheduler.has_unfinished:
            raise RuntimeError("sleep: requests are still queued or running; abort them or let them finish first")
        self.scheduler.clear_cache()  # the pool's contents go
        self._offload = release_memory(self.state.pool, self.model, self.state.shards)

    def wake_up(self) -> None:
        """This rank: the weights back bit for bit and a zeroed KV pool of the size it had."""
        if not self.asleep:
            raise RuntimeError("wake_up: the engine is not asleep")
        restore_memory(self._offload, self.state.pool)
        self._offload = None
        if self.graphs is not None:  # the weights and the pool are back at other addresses
            self.graphs.invalidate()

    # ---- accounting ----------------------------------------------------------------------------
    def tracked_bytes(self) -> int:
        """Bytes of what a switch changes on this rank: projection shards and the KV pool (both 0
        while asleep: their storages are freed)."""
        shards = 0 if self.asleep else sum(x.nbytes for x in self.state.shards)
        return shards + self.state.pool.nbytes

    def memory_stats(self) -> dict[str, int | None]:
        """This rank's bytes, measured: ``tracked_bytes`` (projection shards + KV pool), ``kv_pool``,
        ``weights`` (allocated storages under every weight tensor), the process ``rss`` and ``rss_anon``,
        and ``cuda_graphs`` (device memory the decode graphs keep)."""
        return {**memory_stats(self.state.pool, self.model, self.state.shards, self.tracked_bytes()),
                "cuda_graphs": self.graphs.bytes if self.graphs is not None else 0}

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, read from the tensors: switchable projections, replicated attention
        weights, KV pool."""
        replicated = sum(p.numel() * p.element_size() for layer in self.model.model.layers
                         for p in layer.self_attn.parameters())
        return {"switchable": sum(s.nbytes for s in self.state.shards), "replicated_attention": replicated,
                "kv_pool": self.state.pool.nbytes}
