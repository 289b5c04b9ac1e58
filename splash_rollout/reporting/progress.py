"""The progress bar lives in the rollout layer (the engine's driver rank draws it); re-exported here so
``splash_rollout.reporting`` keeps offering it."""
from splash_rollout.rollout.progress import RolloutProgress

__all__ = ["RolloutProgress"]
