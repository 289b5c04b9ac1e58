"""Building one rank's Engine from an EngineConfig: the one build path.

Every host (one rank in the caller's process, the caller's torchrun ranks, ranks the engine spawns)
calls ``build_engine`` on every rank, and everything an engine needs comes from the config here:

* ``engine_settings``: how it serves (layout, KV pages per layout from the memory budget, batching,
  kernels, speculation, feed-forward placement);
* ``rank_device``: the device this rank computes on, bound as the process's current CUDA device
  (``LOCAL_RANK`` under torchrun, the rank's index when spawned);
* ``weight_source``: where its weights come from -- a checkpoint folder's memory-mapped files or a
  preset's seeded init -- read part by part, so a rank reads only what it holds
  (``engine/rank_weights.py``) and no process holds the whole checkpoint;
* ``make_policy``: on rank 0, the layout policy (``layout="auto"``) and the pricing the speculation
  gate uses.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from splash_rollout.distributed.groups import ProcessGroups
from splash_rollout.engine.cuda_graphs import graph_reserve_bytes
from splash_rollout.engine.options import EngineSettings
from splash_rollout.engine.rank_engine import Engine, pages_per_rank
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import PRESETS, ModelConfig, resolve_model
from splash_rollout.models.numerics import set_numerics
from splash_rollout.models.weights import CheckpointSource, WeightSource, preset_source
from splash_rollout.rollout.process_settings import apply_cpu_process_settings

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_backend(device: str, world_size: int) -> str:
    """The compute and transfer groups' backend: NCCL when every rank gets its own GPU, else gloo
    (the control group is gloo either way)."""
    if str(device).startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def is_checkpoint(config) -> bool:
    """Whether the config's model is a checkpoint folder (else a preset or a ModelConfig: seeded init)."""
    source = config.model.source
    return isinstance(source, (str, os.PathLike)) and os.fspath(source) not in PRESETS


def weight_source(config, model_config: ModelConfig) -> WeightSource:
    """Where a rank reads its weights: the checkpoint's files, or the preset's seeded random init."""
    if is_checkpoint(config):
        return CheckpointSource(os.fspath(config.model.source), model_config)
    from splash_rollout.models.model import MLAForCausalLM

    return preset_source(MLAForCausalLM.skeleton(model_config), config.model.seed)


def whole_model(config, model_config: ModelConfig | None = None):
    """The whole model an EngineConfig names, in this process (for tools and trainers; an engine's
    rank never builds it)."""
    from splash_rollout.models.model import MLAForCausalLM

    model_config = model_config or resolve_model(config.model.source)
    dtype = TORCH_DTYPES[config.model.dtype]
    if is_checkpoint(config):
        return MLAForCausalLM.from_pretrained(os.fspath(config.model.source), dtype=dtype).eval()
    return MLAForCausalLM.from_config(model_config, seed=config.model.seed, dtype=dtype).eval()


def engine_settings(config, model_config: ModelConfig | None = None, world_size: int | None = None,
                    device: str | None = None) -> EngineSettings:
    """The one place an EngineSettings is made: ``config``'s engine groups as given, and what they
    mean for ``model_config`` (default: ``config.served_model()``) on ``world_size`` ranks (default:
    ``parallel.world_size``) -- the starting layout, the KV pages each layout gets from the budget,
    where drafts come from -- with this rank's ``device`` (default: ``parallel.device``)."""
    model_config = model_config or config.served_model()
    world_size = world_size or config.parallel.world_size
    dtype = TORCH_DTYPES[config.model.dtype]
    auto = config.parallel.auto
    layout = Layout.DP if auto else Layout.parse(config.parallel.layout)  # auto starts where wide batches run well
    max_len = config.model.context_limit(model_config)
    reserve = 0
    if cuda_graphs_expected(config):  # the graphs' memory comes out of the budget, before the pool is sized
        reserve = graph_reserve_bytes(model_config, config.batching.max_num_seqs,
                                      -(-max_len // config.memory.page_size), config.memory.page_size, dtype)
    budget = int(config.memory.memory_budget_gib * 2**30) - reserve
    by_layout = None if config.memory.num_pages else {
        l: pages_per_rank(model_config, l, world_size, budget, config.memory.page_size, dtype) for l in Layout}
    num_pages = config.memory.num_pages or by_layout[layout]
    if num_pages < 1:
        raise ValueError(f"memory_budget_gib: {config.memory.memory_budget_gib} GiB per rank holds no KV page after "
                         f"the {layout} attention weights")
    schedule = {int(step): Layout.parse(l, "switch_schedule")
                for step, l in (config.parallel.switch_schedule or {}).items()}
    return EngineSettings(parallel=config.parallel, memory=config.memory, batching=config.batching,
                          compute=config.compute, outputs=config.outputs, driver=config.driver,
                          layout=layout, num_pages=num_pages, dtype=dtype, max_model_len=max_len,
                          device=str(device or config.parallel.device), draft=config.draft_source(model_config),
                          pages_by_layout=by_layout if world_size > 1 else None, switch_schedule=schedule,
                          reachable_layouts=tuple(Layout) if auto and world_size > 1 else (),
                          graph_reserve_bytes=reserve)


def cuda_graphs_expected(config) -> bool:
    """Whether this config's engine will capture CUDA graphs (``compute.cuda_graphs`` on a CUDA device)."""
    return (config.compute.cuda_graphs != "off" and str(config.parallel.device).startswith("cuda")
            and torch.cuda.is_available() and not config.outputs.return_routing)


def local_device_index(rank: int) -> int:
    """This process's GPU among the host's: ``LOCAL_RANK`` under torchrun (ranks of several hosts),
    else the rank's index (ranks spawned on one host), modulo the GPUs it sees."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    return local % max(torch.cuda.device_count(), 1)


def rank_device(config, rank: int) -> str:
    """The device a rank computes on: ``EngineConfig.parallel.device``; a bare ``cuda`` gives each
    rank its own GPU (``local_device_index``)."""
    device = str(config.parallel.device)
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{local_device_index(rank)}"
    return device


def bind_device(device: str) -> None:
    """Make ``device`` this process's current CUDA device (NCCL and every kernel launch without an
    explicit device use it); a no-op on the CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(device))


def build_engine(config, groups: ProcessGroups, heartbeat=None, should_abort=None) -> Engine:
    """This rank's Engine for an EngineConfig (collective: every rank calls it)."""
    apply_cpu_process_settings(config.compute, config.parallel.device)
    set_numerics(config.compute.numerics)
    model_config = config.served_model()
    device = rank_device(config, groups.rank)
    bind_device(device)
    settings = engine_settings(config, model_config, groups.world_size, device)
    policy, price_step = None, None
    budget = int(config.memory.memory_budget_gib * 2**30)
    if config.parallel.auto and groups.rank == 0 and groups.world_size > 1:
        policy = make_policy(config, model_config, groups.world_size, budget, settings.dtype)
    if config.compute.speculation == "auto" and groups.rank == 0:  # the speculation gate prices with the same θ
        pricing = policy or make_policy(config, model_config, groups.world_size, budget, settings.dtype)
        price_step = lambda layout, step: pricing.pricer.price(layout, step).seconds  # noqa: E731
    with weight_source(config, model_config) as source:
        return Engine(source, model_config, groups, settings, policy=policy, price_step=price_step,
                      heartbeat=heartbeat, should_abort=should_abort)


def make_policy(config, model_config: ModelConfig, world_size: int, budget_bytes: int, dtype: torch.dtype):
    """π over this engine's real pools (the ownership model at this budget) and the profile's rates."""
    from splash_rollout.engine.rank_engine import sizes_for
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
