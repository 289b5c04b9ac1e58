"""EngineConfig's ``model`` group: which model, in which dtype, from which seed.

It lives with the builder that reads it (rollout/build.py resolves the source, loads or seeds the
weights); the engine's own groups live beside the engine (engine/options.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from splash_rollout.config_fields import is_int
from splash_rollout.models.config import ModelConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelOptions:
    """Which model, in which dtype, from which seed."""

    source: str | os.PathLike | ModelConfig = "glm5-nano"
    """Preset name (random init), HF checkpoint folder, or a ModelConfig (random init)."""
    dtype: str = "float32"
    """Model and KV-cache dtype: float32, bfloat16 or float16."""
    seed: int = 0
    """Seeds the random init of presets (same seed, same weights) and the default sampling seeds."""
    tokenizer: str | None = None
    """Tokenizer name or path for string prompts; None: the model's (checkpoint folder or preset)."""
    max_model_len: int | None = None
    """Context limit (prompt + response); None: the model's max_position_embeddings. A prompt must be
    shorter; a response stops at the limit with finish_reason ``length`` (``max_new_tokens`` is capped
    by what the context leaves, never refused)."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, (str, os.PathLike, ModelConfig)):
            raise ValueError(f"source: expected a preset name, a checkpoint folder or a ModelConfig, "
                             f"got {type(self.source).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed: expected an integer, got {self.seed!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: expected >= 2, got {self.max_model_len}")

    def context_limit(self, model_config: ModelConfig) -> int:
        """Prompt + response tokens a request may hold: ``max_model_len``, never above the model's
        ``max_position_embeddings``."""
        return min(self.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)

    def tokenizer_source(self) -> str:
        """Where string prompts' tokenizer comes from: ``tokenizer``, else the checkpoint folder or preset."""
        if self.tokenizer is not None:
            return os.fspath(self.tokenizer)
        return self.source.name if isinstance(self.source, ModelConfig) else os.fspath(self.source)
