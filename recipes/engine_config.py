"""The composed Hydra config's ``engine`` group (plus the model, seed and hardware groups) as an EngineConfig.

One mapping for every entry that builds an engine (or a fleet of them) from ``conf/``: the GRPO
recipe (``recipes/grpo/build.py``) and the server (``python -m splash_rollout.serve``). Each
``engine.<group>`` mapping is one EngineConfig group; the model's source, dtype and tokenizer, the
seed and the device come from the model, seed and hardware groups.

The ``engine`` group's fields are not written in YAML: ``register_engine_fields`` makes them, with
their defaults, from the group dataclasses (the one place each is declared and documented), as the
Hydra node ``engine/fields`` that ``conf/engine/default.yaml`` starts from. The YAML then holds only
what the recipe chooses differently, and every field can still be set on the command line
(``engine.compute.cpu_share=false``) and is listed by ``--cfg job``.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from omegaconf import DictConfig, OmegaConf

from splash_rollout.rollout.config import GROUPS, EngineConfig

FROM_OTHER_GROUPS = {"model": ("source", "dtype", "seed", "tokenizer"), "parallel": ("device",)}
"""Engine fields the recipe takes from its model, seed and hardware groups: not in ``engine/fields``."""


def _plain(value: Any) -> Any:
    """A default as YAML holds it: an enum by its value, a tuple as a list."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def engine_fields() -> dict[str, dict[str, Any]]:
    """Every EngineConfig group's fields with their defaults (``FROM_OTHER_GROUPS`` left out)."""
    out = {}
    for name, cls in GROUPS.items():
        skip = FROM_OTHER_GROUPS.get(name, ())
        out[name] = {f.name: _plain(f.default if f.default is not dataclasses.MISSING else f.default_factory())
                     for f in dataclasses.fields(cls) if f.name not in skip}
    return out


def register_engine_fields() -> None:
    """Store ``engine_fields()`` as the Hydra node ``engine/fields`` (before any compose)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="engine", name="fields", node=engine_fields())


def model_source(cfg: DictConfig) -> str:
    """``model.path`` (a checkpoint folder) when set, else the preset ``model.name``."""
    return cfg.model.path or cfg.model.name


def fleet_replicas(cfg: DictConfig) -> int:
    """``engine.fleet.replicas``: engines the recipe runs (1: one engine; more: a Ray fleet)."""
    fleet = cfg.engine.get("fleet")
    replicas = int(fleet.replicas) if fleet is not None and fleet.get("replicas") is not None else 1
    if replicas < 1:
        raise ValueError(f"engine.fleet.replicas: expected an integer >= 1, got {replicas}")
    return replicas


def engine_config(cfg: DictConfig, **given: dict) -> EngineConfig:
    """The EngineConfig ``cfg`` describes; ``given``: fields a caller sets per group
    (``outputs={"return_routing": True}``), over the ``engine`` group's."""
    e = cfg.engine

    def group(name: str, **fields) -> dict:
        return {**(OmegaConf.to_container(e[name]) if e.get(name) is not None else {}), **fields,
                **given.get(name, {})}

    return EngineConfig(**{
        name: group(name, **({"source": model_source(cfg), "dtype": cfg.model.dtype, "seed": cfg.seed,
                              "tokenizer": cfg.model.tokenizer} if name == "model" else
                             {"device": cfg.hardware.device} if name == "parallel" else {}))
        for name in GROUPS})


def build_engine_or_fleet(cfg: DictConfig, config: EngineConfig):
    """A ``RolloutEngine`` of ``config``; with ``engine.fleet.replicas`` > 1, a ``fleet.Fleet`` of that
    many, placed by Ray on ``engine.fleet.ray_address`` (the ``ray`` extra)."""
    replicas = fleet_replicas(cfg)
    if replicas == 1:
        from splash_rollout.rollout.engine import RolloutEngine

        return RolloutEngine(config)
    from splash_rollout.fleet import Fleet, FleetOptions

    return Fleet(config, FleetOptions(replicas=replicas, ray_address=cfg.engine.fleet.get("ray_address")))
