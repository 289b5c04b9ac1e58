"""What the OpenAI server serves: one engine or a fleet of them, through one surface.

Why: the server (app.py) must front a ``RolloutEngine`` on one host and a ``fleet.Fleet`` of
replicas placed by Ray alike -- the same endpoints, streaming, per-sample aborts, metrics, timeline
and admin calls. Both classes have the members below and the server uses nothing else, so neither
knows the server and the server never branches on which one it has (``isinstance(x,
ServingBackend)`` checks an instance has every member).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from splash_rollout.models.config import ModelConfig
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.rollout.group_handle import GroupHandle


@runtime_checkable
class ServingBackend(Protocol):
    config: EngineConfig
    model_config: ModelConfig
    max_len: int
    """Prompt + response tokens a request may hold."""
    weight_version: int

    @property
    def tokenizer(self) -> Any: ...

    def submit(self, prompt, sampling=None) -> GroupHandle:
        """One prompt's group of ``n`` samples, served beside whatever runs."""

    @property
    def requests_in_flight(self) -> int: ...

    @property
    def serving_error(self) -> str | None:
        """Why it can serve no more, or None (``/health``)."""

    def abort_submitted(self) -> int: ...

    def serving_timeline(self) -> dict:
        """The layout timeline of what it served (``/timeline``)."""

    def replica_states(self) -> list[dict]:
        """Per replica, ``RolloutEngine.serving_state()`` with its ``replica`` index (``/metrics``)."""

    def update_weights(self, named_tensors: dict, version: int | None = None) -> Any: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def serve_here(self, ready: Callable[[], None] | None = None) -> None: ...

    def stop_serving(self, timeout_s: float = 60.0) -> None: ...

    def shutdown(self) -> None: ...
