"""EngineConfig: how to build a RolloutEngine, one frozen config grouped by concern.

    EngineConfig(model="glm5-nano",
                 parallel=ParallelOptions(world_size=2, layout="auto"),
                 memory={"memory_budget_gib": 0.5},          # a mapping of a group's fields works too
                 policy={"min_dwell_steps": 8})

Each group lives beside what reads it: ``model`` (rollout/model_options.py ModelOptions: source,
dtype, seed, tokenizer, context limit; read by the builder), ``parallel`` (ranks, layout, device,
timeouts, scheduled switches), ``memory`` (KV pool, page size, admission, prefix sharing),
``batching`` (per-step and per-call bounds), ``compute`` (attention backend, numerics, speculation,
threads, graphs) and ``outputs`` (progress, routing) -- the engine's, engine/options.py --,
``policy`` (the layout rules' knobs, scheduling/policy.py PolicyConfig), ``driver`` (when the policy
is consulted, engine/layout_driver.py DriverConfig), ``pricing`` (cost profile, online correction,
scheduling/pricing_options.py). Each group is validated when it is built; a group given as a mapping is refused naming the
unknown or bad field (``memory.page_size: expected >= 1``). ``model`` also takes a preset name, a
checkpoint folder or a ModelConfig directly.

The flat keyword names of earlier releases (``EngineConfig(world_size=2, layout="dp")``) are still
taken for this release: each lands in its group (``FLAT_NAMES`` says where) and replaces that one
field; reading is grouped only (``config.parallel.world_size``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from splash_rollout.config_fields import from_mapping
from splash_rollout.engine.layout_driver import DriverConfig
from splash_rollout.models.config import ModelConfig
from splash_rollout.engine.options import (BatchingOptions, ComputeOptions, MemoryOptions, OutputOptions,
                                           ParallelOptions)
from splash_rollout.rollout.model_options import ModelOptions
from splash_rollout.scheduling.pricing_options import PricingOptions
from splash_rollout.scheduling.policy import PolicyConfig

GROUPS: dict[str, type] = {"model": ModelOptions, "parallel": ParallelOptions, "memory": MemoryOptions,
                           "batching": BatchingOptions, "policy": PolicyConfig, "driver": DriverConfig,
                           "pricing": PricingOptions, "compute": ComputeOptions, "outputs": OutputOptions}
"""Group name -> its config class, in declaration order."""

FLAT_NAMES: dict[str, tuple[str, str]] = {
    f.name: (group, f.name)
    for group in ("parallel", "model", "memory", "batching", "pricing", "compute", "outputs")
    for f in dataclasses.fields(GROUPS[group]) if f.name != "source"  # ``model=`` was the source itself
}
"""Earlier releases' flat EngineConfig keywords -> (group, field); taken for this release."""


AUTO_MTP_MAX_SHARE = 0.125
"""``compute.draft="auto"`` drafts with the MTP module where one pass of it -- one decoder layer -- is at
most this share of a step's layers (DeepSeek-V3's 61: 1.6 %), else with n-grams. Measured on
glm5-nano, where it is a quarter: the main job's 24 rollouts took 65.9 s with MTP drafts against
44.3 s with n-gram ones (the same SFT policy, one after the other; the module's drafts kept more
tokens, 37,242 against 24,278, but its passes cost more than they saved)."""


def _group(name: str, value: Any):
    """A group from its instance, a mapping of its fields, or None (its defaults)."""
    cls = GROUPS[name]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if name == "model" and isinstance(value, (str, os.PathLike, ModelConfig)):
        return ModelOptions(source=value)
    if isinstance(value, Mapping):
        own = getattr(cls, "from_mapping", None)  # PolicyConfig / DriverConfig parse their own fields
        return own(value, name) if own is not None else from_mapping(cls, value, name)
    raise TypeError(f"{name}: expected a {cls.__name__} or a mapping of its fields (None: its defaults), "
                    f"got {type(value).__name__}")


@dataclass(frozen=True, init=False)
class EngineConfig:
    model: ModelOptions
    """Which model, in which dtype, from which seed (also: a preset name, folder or ModelConfig)."""
    parallel: ParallelOptions
    """Ranks, attention layout, device, rank timeout, scheduled switches."""
    memory: MemoryOptions
    """KV pool per rank, page size, admission, prefix sharing."""
    batching: BatchingOptions
    """Rows per step, requests running at once, samples per call."""
    policy: PolicyConfig
    """With ``layout="auto"``: the margins a switch must clear, the dwell after a switch and what may
    end it early, exploration, the horizon quantile, the layouts it may choose."""
    driver: DriverConfig
    """With ``layout="auto"``: when the policy is consulted and which steps feed its online correction."""
    pricing: PricingOptions
    """The cost profile auto decisions price with, and whether it is corrected online."""
    compute: ComputeOptions
    """Attention backend, numerics, speculation, CPU threads and denormals."""
    outputs: OutputOptions
    """Progress bar and per-sample routing."""

    def __init__(self, model: Any = None, parallel: Any = None, memory: Any = None, batching: Any = None,
                 policy: Any = None, driver: Any = None, pricing: Any = None, compute: Any = None,
                 outputs: Any = None, **flat: Any) -> None:
        given = {"model": model, "parallel": parallel, "memory": memory, "batching": batching, "policy": policy,
                 "driver": driver, "pricing": pricing, "compute": compute, "outputs": outputs}
        groups = {name: _group(name, value) for name, value in given.items()}
        unknown = sorted(set(flat) - set(FLAT_NAMES))
        if unknown:
            raise TypeError(f"EngineConfig: unknown option(s) {unknown}; the groups are {list(GROUPS)} "
                            f"(and, for this release, the flat names {sorted(FLAT_NAMES)})")
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            group, field = FLAT_NAMES[name]
            by_group.setdefault(group, {})[field] = value
        for group, values in by_group.items():
            try:
                groups[group] = dataclasses.replace(groups[group], **values)
            except ValueError as e:
                raise ValueError(f"{group}.{e}") from None
        for name, value in groups.items():
            object.__setattr__(self, name, value)
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        from splash_rollout.engine.parallel_mlp import placement_problem

        compute = self.compute
        problem = placement_problem(self.parallel.feed_forward, self.outputs.return_routing, self.parallel.world_size)
        if problem:
            raise ValueError(f"parallel.feed_forward / outputs.return_routing: {problem}")
        if compute.cuda_graphs == "on" and not str(self.parallel.device).startswith("cuda"):
            raise ValueError(f"compute.cuda_graphs='on' needs parallel.device='cuda', got {self.parallel.device!r} "
                             f"(use 'auto': graphs where the device is CUDA)")
        if compute.draft == "mtp" and compute.speculation != "off":
            model = self.source_model()
            if model.num_mtp_layers < 1:
                raise ValueError(f"compute.draft='mtp': the model {model.name!r} has no MTP module "
                                 f"(num_nextn_predict_layers / num_mtp_layers is 0, or its checkpoint holds none); "
                                 f"use compute.draft='ngram' or 'auto'")
        if compute.attention_backend == "flashmla" and (self.memory.page_size != 64 or self.model.dtype != "bfloat16"):
            raise ValueError("compute.attention_backend='flashmla': FlashMLA reads bfloat16 pages of 64 tokens; got "
                             f"memory.page_size={self.memory.page_size}, model.dtype={self.model.dtype!r}")

    def served_model(self):
        """The ``ModelConfig`` the engine builds: ``model.source`` resolved, with its first MTP module
        (models/mtp.py) when the engine drafts with it (``draft_source``), else without any -- an engine
        neither loads nor holds modules it does not run (a checkpoint's are skipped with a note, a
        weight push's are left out)."""
        model = self.source_model()
        return model.replace(num_mtp_layers=1 if self.draft_source(model) == "mtp" else 0)

    def source_model(self):
        """``model.source`` resolved, with the MTP modules a checkpoint's files actually hold
        (``weights.checkpoint_config``: a config.json may declare modules a ``save_pretrained`` dropped)."""
        from splash_rollout.models.config import resolve_model
        from splash_rollout.models.weights import checkpoint_config

        source = self.model.source
        if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            return checkpoint_config(source)
        return resolve_model(source)

    def draft_source(self, model=None) -> str | None:
        """Where the engine's drafts come from: ``mtp``, ``ngram``, or None (``speculation="off"``).
        ``compute.draft="auto"`` takes the MTP module where ``model`` (default: ``model.source``
        resolved) has one that costs at most ``AUTO_MTP_MAX_SHARE`` of a step (one layer of its decoder's)."""
        if self.compute.speculation == "off":
            return None
        if self.compute.draft != "auto":
            return self.compute.draft
        model = model or self.source_model()
        cheap = model.num_mtp_layers >= 1 and 1.0 / model.num_layers <= AUTO_MTP_MAX_SHARE
        return "mtp" if cheap else "ngram"

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with some groups (or, for this release, flat names) changed."""
        current = {name: getattr(self, name) for name in GROUPS}
        flat = {k: v for k, v in changes.items() if k not in GROUPS}
        current.update({k: v for k, v in changes.items() if k in GROUPS})
        return EngineConfig(**current, **flat)
