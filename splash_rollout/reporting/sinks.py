"""Metrics sinks: where per-step records go.

Every sink has the same four methods (``log``, ``log_table``, ``log_image``, ``finish``) so the loop
never asks which one it holds: rank 0 gets the real ones, every other rank a ``NoOpSink``. Records are
flat dicts under slash-named keys (``rollout/response_len/mean``), reduced once per step by the caller.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence


class MetricsSink:
    """Base class and the interface: override what you store; the defaults drop everything."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's records (flat, slash-named keys -> numbers)."""

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        """A table (e.g. the layout timeline: one row per phase)."""

    def log_image(self, key: str, path: str, step: int) -> None:
        """An image file already written to ``path`` (e.g. timeline.png)."""

    def finish(self) -> None:
        """Flush and close."""

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


class NoOpSink(MetricsSink):
    """What non-zero ranks (and tests) hold: same methods, nothing stored."""


class JsonlSink(MetricsSink):
    """One JSON object per ``log`` call (``{"step": ..., **metrics}``) appended to ``path``."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


class MultiSink(MetricsSink):
    """Fans every call out to several sinks (e.g. metrics.jsonl and W&B)."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def log(self, metrics, step):
        for s in self.sinks:
            s.log(metrics, step)

    def log_table(self, key, columns, rows, step):
        for s in self.sinks:
            s.log_table(key, columns, rows, step)

    def log_image(self, key, path, step):
        for s in self.sinks:
            s.log_image(key, path, step)

    def finish(self):
        for s in self.sinks:
            s.finish()


def make_sink(kind: str, rank: int, run_dir: str, **wandb_kwargs: Any) -> MetricsSink:
    """``kind``: ``none`` (metrics.jsonl only) or ``wandb`` (metrics.jsonl + W&B). Non-zero ranks
    always get a ``NoOpSink``: only rank 0 logs."""
    if rank != 0:
        return NoOpSink()
    jsonl = JsonlSink(os.path.join(run_dir, "metrics.jsonl"))
    if kind == "none":
        return jsonl
    if kind == "wandb":
        from splash_rollout.reporting.wandb_sink import WandbSink

        return MultiSink([jsonl, WandbSink(dir=run_dir, **wandb_kwargs)])
    raise ValueError(f"logger kind: expected 'none' or 'wandb', got {kind!r}")
