"""GRPO learning-rate schedules: a linear warmup, then constant or cosine decay.

``lr_at(step)`` is a pure function of the step, so a resumed run recomputes the schedule exactly;
the checkpoint stores the schedule's settings and refuses to resume under different ones.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    kind: str = "constant"
    """constant | cosine (from lr down to lr * min_lr_ratio at total_steps)."""
    warmup_steps: int = 0
    """Linear warmup: step s (0-based) runs at lr * (s + 1) / warmup_steps until it reaches lr."""
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"grpo.lr_schedule: expected one of {SCHEDULES}, got {self.kind!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"grpo.min_lr_ratio: expected in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, self.warmup_steps))
        if self.kind == "constant":
            return self.lr * warm
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        cos = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * warm * cos

    def to_dict(self) -> dict:
        return asdict(self)
