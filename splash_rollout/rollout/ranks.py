"""The engine's side of a multi-rank RolloutEngine: building a GroupEngine on a rank and serving.

Two ways to host the T ranks (DESIGN.md §4): the RolloutEngine spawns them (``WorkerGroup``; the
functions here run inside each worker), or the caller's own ranks host the engine in-process
(torchrun; every rank calls ``generate``). Both build the same ``GroupEngine`` and exchange only
plain request records, never torch.Generator objects.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splash_rollout.distributed.groups import ProcessGroups
from splash_rollout.engine.group_engine import GroupEngine, pages_per_rank
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import PRESETS, ModelConfig, resolve_model
from splash_rollout.models.numerics import set_numerics

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RequestRecord:
    """What rank 0 needs to rebuild a Request."""

    request_id: int
    prompt_ids: list[int]
    spec: SamplingSpec
    max_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, r: Request) -> "RequestRecord":
        return cls(r.request_id, list(r.prompt_ids), r.spec, r.max_len, tuple(r.eos_token_ids))

    def request(self) -> Request:
        return Request(self.request_id, list(self.prompt_ids), self.spec, self.max_len, self.eos_token_ids)


@dataclass(frozen=True)
class RequestResult:
    request_id: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str


def load_model(config, model_config: ModelConfig):
    """The full model on this rank (a checkpoint folder, or the preset's seeded random init)."""
    from splash_rollout.models.model import MLAForCausalLM

    dtype = TORCH_DTYPES[config.dtype]
    source = config.model
    if isinstance(source, (str, os.PathLike)) and os.fspath(source) not in PRESETS:
        return MLAForCausalLM.from_pretrained(os.fspath(source), dtype=dtype).eval()
    return MLAForCausalLM.from_config(model_config, seed=config.seed, dtype=dtype).eval()


def build_group_engine(config, groups: ProcessGroups) -> GroupEngine:
    """This rank's GroupEngine for an EngineConfig (collective: every rank calls it)."""
    if config.flush_denormal:
        torch.set_flush_denormal(True)
    set_numerics(config.numerics)
    model_config = resolve_model(config.model)
    dtype = TORCH_DTYPES[config.dtype]
    auto = str(config.layout).lower() == "auto"
    layout = Layout.DP if auto else Layout.parse(config.layout)  # auto starts where wide batches run well
    budget = int(config.memory_budget_gib * 2**30)
    pages_by_layout = None if config.num_pages else {
        l: pages_per_rank(model_config, l, groups.world_size, budget, config.page_size, dtype) for l in Layout}
    num_pages = config.num_pages or pages_by_layout[layout]
    if num_pages < 1:
        raise ValueError(f"memory_budget_gib: {config.memory_budget_gib} GiB per rank holds no KV page after "
                         f"the {layout} attention weights")
    engine = GroupEngine(load_model(config, model_config), model_config, groups, layout=layout, num_pages=num_pages,
                         page_size=config.page_size, max_num_batched_tokens=config.max_num_batched_tokens,
                         max_num_seqs=config.max_num_seqs, attention_backend=config.attention_backend, dtype=dtype,
                         pages_by_layout=pages_by_layout)
    engine.switch_schedule = {int(step): Layout.parse(l, "switch_schedule") for step, l in
                              (config.switch_schedule or {}).items()}
    if auto and groups.rank == 0:
        engine.policy = make_policy(config, model_config, groups.world_size, budget, dtype)
    return engine


def make_policy(config, model_config: ModelConfig, world_size: int, budget_bytes: int, dtype: torch.dtype):
    """π over this engine's real pools (the ownership model at this budget) and the profile's rates."""
    import dataclasses

    from splash_rollout.engine.group_engine import sizes_for
    from splash_rollout.layout.footprint import RankBudget, footprints
    from splash_rollout.scheduling.deployment import Deployment
    from splash_rollout.scheduling.policy import LayoutPolicy
    from splash_rollout.scheduling.profile import load_profile

    profile = dataclasses.replace(load_profile(config.profile), world_size=world_size, memory_bytes=budget_bytes,
                                  mem_fraction=1.0)
    sizes = sizes_for(model_config, dtype)
    fps = footprints(sizes, world_size, RankBudget(budget_bytes), config.page_size)
    return LayoutPolicy(Deployment(model_config, profile, sizes, fps, config.page_size, sizes.weight_dtype,
                                   sizes.kv_format))


def serve_records(engine: GroupEngine, records: list[RequestRecord] | None,
                  progress: bool = False) -> list[RequestResult] | None:
    """Every rank: run the batch; rank 0 returns the results (others None). ``progress``: rank 0
    draws a progress bar on stderr, updated after every step."""
    from splash_rollout.rollout.progress import RolloutProgress

    bar = RolloutProgress(len(records or []), enabled=progress and engine.rank == 0)
    hook = engine.on_step  # a caller's own hook keeps running
    if bar.enabled:
        engine.on_step = bar.on_step if hook is None else (lambda event: (hook(event), bar.on_step(event)))
    try:
        finished = engine.serve([r.request() for r in records] if engine.rank == 0 else None)
    finally:
        engine.on_step = hook
        bar.close()
    if finished is None:
        return None
    return [RequestResult(r.request_id, list(r.output_ids), list(r.output_logprobs), r.finish_reason or "abort")
            for r in finished]


# ---- functions a spawned WorkerGroup runs (module level so they pickle by name) ---------------
def worker_build(ctx, config) -> dict:
    ctx.state["engine"] = build_group_engine(config, ctx.groups)
    engine = ctx.state["engine"]
    return {"num_pages": engine.state.pool.num_pages, "full_shapes": engine.full_shapes, **engine.resident_bytes()}


def worker_serve(ctx, records: list[RequestRecord], progress: bool = False):
    """Every rank serves; rank 0 returns (results, step log, switch log) and clears its logs."""
    engine = ctx.state["engine"]
    engine.heartbeat = ctx.heartbeat  # keeps a long call alive in the caller's eyes (launch.py)
    engine.should_abort = ctx.interrupted  # RolloutEngine.abort() in the caller sets it
    results = serve_records(engine, records if ctx.rank == 0 else None, progress)
    return None if ctx.rank else take_logs(engine, results)


def take_logs(engine: GroupEngine, results):
    steps, switches, decisions = engine.step_log, engine.switch_log, engine.decision_log
    engine.step_log, engine.switch_log, engine.decision_log = [], [], []
    return results, steps, switches, decisions


def worker_request_switch(ctx, dst: str, blocking: bool) -> None:
    if ctx.rank == 0:
        ctx.state["engine"].request_switch(dst, blocking)


def can_ever_admit(engine: GroupEngine, records: list[RequestRecord]) -> list[bool] | None:
    """Rank 0: whether each request can ever run (``GroupEngine.can_ever_admit``); None elsewhere."""
    if engine.rank != 0:
        return None
    return [engine.can_ever_admit(r.request()) for r in records]


def worker_can_ever_admit(ctx, records: list[RequestRecord]) -> list[bool] | None:
    return can_ever_admit(ctx.state["engine"], records)


def worker_update_weights(ctx, named) -> None:
    ctx.state["engine"].update_weights(named)


def worker_sleep(ctx) -> None:
    ctx.state["engine"].sleep()


def worker_wake_up(ctx) -> None:
    ctx.state["engine"].wake_up()


def worker_memory_stats(ctx) -> dict:
    return ctx.state["engine"].memory_stats()
