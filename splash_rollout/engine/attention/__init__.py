"""Attention-backend registry: name → backend class, imported lazily (GPU backends only load on use)."""
from __future__ import annotations

import importlib

from splash_rollout.engine.attention.base import AttentionBackend, causal_allowed

_REGISTRY: dict[str, str] = {
    "torch": "splash_rollout.engine.attention.torch_batched:TorchBackend",
    "torch_ref": "splash_rollout.engine.attention.torch_ref:TorchRefBackend",
    "cpu": "splash_rollout.engine.attention.cpu_paged:CpuPagedBackend",  # native kernel, built at first use
    "triton": "splash_rollout.engine.attention.triton_backend:TritonBackend",  # needs triton (extra: gpu)
    "flashmla": "splash_rollout.engine.attention.flashmla_backend:FlashMLABackend",  # needs sgl-flash-mla (CUDA)
}


def register_backend(name: str, target: str) -> None:
    """target: ``"module.path:ClassName"``."""
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str = "torch") -> AttentionBackend:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"attention_backend: unknown {name!r}; registered: {available_backends()}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["AttentionBackend", "causal_allowed", "get_backend", "register_backend", "available_backends"]
