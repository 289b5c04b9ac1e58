"""What happens to the engine's memory while the trainer steps, when both share the ranks.

``engine.sleep_during_train=true``: the engine releases its KV pool and weight storage after the
rollout (``RolloutEngine.sleep``) and takes them back before the new weights are pushed
(``wake_up``), and the step logs what that freed (``memory/*``). Otherwise (the default) nothing
happens and nothing is logged.
"""
from __future__ import annotations

from splash_rollout.recipes.grpo.metrics import memory_metrics


class EngineMemory:
    def __init__(self, release: bool) -> None:
        self.release = release

    def before_train(self, engine) -> dict[str, float]:
        """Called after the rollout and its rewards; returns the memory metrics of the step."""
        if not self.release:
            return {}
        awake = engine.memory_stats()
        engine.sleep()
        return memory_metrics(awake, engine.memory_stats())

    def before_push(self, engine) -> None:
        """Called before the trained weights go to the engine."""
        if self.release:
            engine.wake_up()
