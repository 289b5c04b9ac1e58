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

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from splash_rollout.distributed.collectives import Comm
from splash_rollout.distributed.groups import ProcessGroups
from splash_rollout.scheduling.admission import AdmissionSettings
from splash_rollout.engine.engine import Engine, EngineSettings, pages_per_rank
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import PRESETS, ModelConfig, resolve_model
from splash_rollout.models.numerics import set_numerics
from splash_rollout.rollout.process_settings import apply_cpu_process_settings
from splash_rollout.rollout.validation import agree_across_ranks

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        self.control = Comm(groups.control, groups.rank, groups.world_size, channel=groups.control_channel)

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

    def run(self, fn, *args) -> Any:
        """``fn(ctx, *args)`` here; every rank returns rank 0's result."""
        result = fn(self.ctx, *args)
        return self.control.broadcast_object(result) if self.ctx.world_size > 1 else result

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


def compute_backend(device: str, world_size: int) -> str:
    """The compute and transfer groups' backend: NCCL when every rank gets its own GPU, else gloo
    (the control group is gloo either way)."""
    if str(device).startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


# ---- building the engine on a rank ------------------------------------------------------------------
def load_model(config, model_config: ModelConfig):
    """The full model on this rank (a checkpoint folder, or the preset's seeded random init)."""
    from splash_rollout.models.model import MLAForCausalLM

    dtype = TORCH_DTYPES[config.model.dtype]
    source = config.model.source
    if isinstance(source, (str, os.PathLike)) and os.fspath(source) not in PRESETS:
        return MLAForCausalLM.from_pretrained(os.fspath(source), dtype=dtype).eval()
    return MLAForCausalLM.from_config(model_config, seed=config.model.seed, dtype=dtype).eval()


def engine_settings(config, model_config: ModelConfig, world_size: int) -> EngineSettings:
    """An EngineConfig's serving settings on T ranks: the pools each layout gets from the budget."""
    dtype = TORCH_DTYPES[config.model.dtype]
    auto = config.parallel.auto
    layout = Layout.DP if auto else Layout.parse(config.parallel.layout)  # auto starts where wide batches run well
    budget = int(config.memory.memory_budget_gib * 2**30)
    by_layout = None if config.memory.num_pages else {
        l: pages_per_rank(model_config, l, world_size, budget, config.memory.page_size, dtype) for l in Layout}
    num_pages = config.memory.num_pages or by_layout[layout]
    if num_pages < 1:
        raise ValueError(f"memory_budget_gib: {config.memory.memory_budget_gib} GiB per rank holds no KV page after "
                         f"the {layout} attention weights")
    schedule = {int(step): Layout.parse(l, "switch_schedule")
                for step, l in (config.parallel.switch_schedule or {}).items()}
    batching, memory = config.batching, config.memory
    return EngineSettings(layout=layout, num_pages=num_pages, page_size=memory.page_size,
                          max_num_batched_tokens=batching.max_num_batched_tokens, max_num_seqs=batching.max_num_seqs,
                          attention_backend=config.compute.attention_backend, dtype=dtype,
                          device=rank_device(config, 0),
                          pages_by_layout=by_layout if world_size > 1 else None, switch_schedule=schedule,
                          reachable_layouts=tuple(Layout) if auto and world_size > 1 else (),
                          admission=AdmissionSettings(mode=memory.admission), prefix_sharing=memory.prefix_sharing,
                          return_routing=config.outputs.return_routing,
                          cpu_share=config.compute.cpu_share, driver=config.driver,
                          speculation=config.compute.speculation, feed_forward=config.parallel.feed_forward,
                          decode_window=config.parallel.decode_window)


def rank_device(config, rank: int) -> str:
    """The device a rank computes on: ``EngineConfig.parallel.device``; a bare ``cuda`` spreads ranks over GPUs."""
    device = str(config.parallel.device)
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def build_engine(config, groups: ProcessGroups, heartbeat=None, should_abort=None) -> Engine:
    """This rank's Engine for an EngineConfig (collective: every rank calls it)."""
    import dataclasses

    apply_cpu_process_settings(config.compute, config.parallel.device)
    set_numerics(config.compute.numerics)
    model_config = resolve_model(config.model.source)
    settings = engine_settings(config, model_config, groups.world_size)
    settings = dataclasses.replace(settings, device=rank_device(config, groups.rank))
    policy, price_step = None, None
    budget = int(config.memory.memory_budget_gib * 2**30)
    if config.parallel.auto and groups.rank == 0 and groups.world_size > 1:
        policy = make_policy(config, model_config, groups.world_size, budget, settings.dtype)
    if config.compute.speculation == "auto" and groups.rank == 0:  # the speculation gate prices with the same θ
        pricing = policy or make_policy(config, model_config, groups.world_size, budget, settings.dtype)
        price_step = lambda layout, step: pricing.pricer.price(layout, step).seconds  # noqa: E731
    return Engine(load_model(config, model_config), model_config, groups, settings, policy=policy,
                  price_step=price_step, heartbeat=heartbeat, should_abort=should_abort)


def make_policy(config, model_config: ModelConfig, world_size: int, budget_bytes: int, dtype: torch.dtype):
    """π over this engine's real pools (the ownership model at this budget) and the profile's rates."""
    import dataclasses

    from splash_rollout.engine.engine import sizes_for
    from splash_rollout.layout.footprint import RankBudget, footprints
    from splash_rollout.scheduling.deployment import Deployment
    from splash_rollout.scheduling.online import StepTimeCorrection
    from splash_rollout.scheduling.policy import LayoutPolicy
    from splash_rollout.scheduling.profile import load_profile

    profile = dataclasses.replace(load_profile(config.pricing.profile), world_size=world_size,
                                  memory_bytes=budget_bytes, mem_fraction=1.0,
                                  feed_forward=config.parallel.feed_forward)
    sizes = sizes_for(model_config, dtype)
    fps = footprints(sizes, world_size, RankBudget(budget_bytes), config.memory.page_size)
    return LayoutPolicy(Deployment(model_config, profile, sizes, fps, config.memory.page_size, sizes.weight_dtype,
                                   sizes.kv_format), config=config.policy,
                        correction=StepTimeCorrection() if config.pricing.online_correction else None)


# ---- what every rank runs (module level so they pickle by name) ----------------------------------------
def worker_build(ctx, config) -> dict:
    engine = build_engine(config, ctx.groups, heartbeat=ctx.heartbeat, should_abort=ctx.interrupted)
    ctx.state["engine"] = engine
    return {"num_pages": engine.state.pool.num_pages, "full_shapes": engine.full_shapes, **engine.resident_bytes()}


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


def worker_request_switch(ctx, dst: str, blocking: bool) -> None:
    ctx.state["engine"].request_switch(dst, blocking)


def worker_can_ever_admit(ctx, records: list[RequestRecord]) -> list[bool]:
    """Whether each request can ever run (every replica gives the same answer)."""
    return [ctx.state["engine"].can_ever_admit(r.request()) for r in records]


def worker_update_weights(ctx, named) -> None:
    ctx.state["engine"].update_weights(named)


def worker_sleep(ctx) -> None:
    ctx.state["engine"].sleep()


def worker_wake_up(ctx) -> None:
    ctx.state["engine"].wake_up()


def worker_memory_stats(ctx) -> list[dict]:
    engine: Engine = ctx.state["engine"]
    return engine.control.gather_objects(engine.memory_stats())
