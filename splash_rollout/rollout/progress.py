"""A tqdm bar for long rollout calls: requests done / total, the current layout and tokens/s.

The driver draws it: the single-rank loop of ``RolloutEngine``, or rank 0 of a group (spawned or
torchrun) through ``GroupEngine.on_step``, once per engine step. ``EngineConfig.outputs.progress`` decides
whether there is one (None: only when stderr is a terminal, so logs and tests stay clean);
``enabled=False`` makes every method a no-op. Lives in rollout/ (not reporting/) because the engine
side draws it and rollout/ may not import reporting/.
"""
from __future__ import annotations

import sys
import time
from typing import IO


def progress_enabled(setting: bool | None) -> bool:
    """``EngineConfig.outputs.progress`` resolved in the calling process (None: stderr is a terminal)."""
    if setting is not None:
        return bool(setting)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class RolloutProgress:
    def __init__(self, total: int, enabled: bool = True, desc: str = "rollout", leave: bool = False,
                 file: IO[str] | None = None) -> None:
        """``file``: where the bar is drawn (default: stderr)."""
        self.total, self.enabled = total, enabled
        self._t0, self._done, self._tokens = time.perf_counter(), 0, 0
        self.layout: str | None = None
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", leave=leave, dynamic_ncols=True, file=file)

    @property
    def done(self) -> int:
        return self._done

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / max(time.perf_counter() - self._t0, 1e-9)

    def update(self, done: int, layout: str | None = None, tokens: int | None = None) -> None:
        """``done``: requests finished so far (absolute); ``tokens``: tokens generated so far (absolute)."""
        if tokens is not None:
            self._tokens = tokens
        if layout is not None:
            self.layout = layout
        if self._bar is not None:
            self._bar.update(max(0, done - self._done))
            post = {"tok/s": f"{self.tokens_per_s:.0f}"}
            if self.layout is not None:
                post = {"layout": self.layout, **post}
            self._bar.set_postfix(post, refresh=True)
        self._done = max(self._done, done)

    def on_step(self, event) -> None:
        """A ``GroupEngine.on_step`` callback: one engine step's ``StepEvent``."""
        self.total = max(self.total, event.total)
        self.update(event.done, event.layout, self._tokens + event.new_tokens)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "RolloutProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
