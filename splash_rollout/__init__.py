"""splash_rollout: RL rollouts for MLA models on an engine that switches attention layouts live.

The public names are imported lazily so that the pure layers (``splash_rollout.layout``,
``splash_rollout.scheduling``) stay importable without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "ModelConfig": "splash_rollout.models.config",
    "Layout": "splash_rollout.layout",
    "RolloutEngine": "splash_rollout.rollout.engine",
    "EngineConfig": "splash_rollout.rollout.config",
    "SamplingParams": "splash_rollout.rollout.types",
    "RolloutBatch": "splash_rollout.rollout.types",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'splash_rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
