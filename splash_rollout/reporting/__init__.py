"""reporting layer of splash_rollout: metrics sinks (W&B on rank 0, a no-op sink of
the same shape elsewhere), the layout timeline as JSON / PNG / per-step ``layout/*`` records, and
(offered here, owned by the rollout layer whose driver draws it: rollout/progress.py) the progress
bar for long rollout calls. wandb is imported here and nowhere else."""
from splash_rollout.reporting.sinks import JsonlSink, MetricsSink, MultiSink, NoOpSink, make_sink
from splash_rollout.rollout.progress import RolloutProgress

__all__ = ["MetricsSink", "NoOpSink", "JsonlSink", "MultiSink", "make_sink", "RolloutProgress"]
