"""W&B sink: offline by default (the run lands in ``<dir>/wandb/``; ``wandb sync`` uploads it later),
online when ``mode="online"``. The only file in the package that imports wandb."""
from __future__ import annotations

import os
from typing import Any, Sequence

from splash_rollout.reporting.sinks import MetricsSink


class WandbSink(MetricsSink):
    def __init__(self, dir: str, project: str = "splash_rollout", name: str | None = None,
                 mode: str = "offline", entity: str | None = None, config: dict[str, Any] | None = None,
                 tags: Sequence[str] = ()) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb mode: expected offline, online or disabled, got {mode!r}")
        import wandb

        os.makedirs(dir, exist_ok=True)
        self._wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=dir, mode=mode, entity=entity, config=config,
                              tags=list(tags), reinit="finish_previous",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))

    @property
    def run_dir(self) -> str:
        """The run's own folder (``.../wandb/offline-run-*``)."""
        return os.path.dirname(self.run.dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.run.log({key: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def log_image(self, key: str, path: str, step: int) -> None:
        self.run.log({key: self._wandb.Image(path)}, step=step)

    def finish(self) -> None:
        """Close the run and wait until its record log is on disk (wandb-core writes it from a
        separate process; ``run.finish`` can return before the last records land)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
            self._wandb.teardown()
