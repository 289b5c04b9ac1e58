"""A tqdm bar for long rollout calls: requests done / total, the current layout and tokens/s.

``RolloutEngine`` (or a recipe) creates one per call and calls ``update`` after each engine step;
``enabled=False`` (non-zero ranks, tests) makes every method a no-op.
"""
from __future__ import annotations

import time


class RolloutProgress:
    def __init__(self, total: int, enabled: bool = True, desc: str = "rollout", leave: bool = False) -> None:
        self.total, self.enabled = total, enabled
        self._t0, self._done, self._tokens = time.perf_counter(), 0, 0
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", leave=leave, dynamic_ncols=True)

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / max(time.perf_counter() - self._t0, 1e-9)

    def update(self, done: int, layout: str | None = None, tokens: int | None = None) -> None:
        """``done``: requests finished so far (absolute); ``tokens``: tokens generated so far (absolute)."""
        if tokens is not None:
            self._tokens = tokens
        if self._bar is not None:
            self._bar.update(max(0, done - self._done))
            post = {"tok/s": f"{self.tokens_per_s:.0f}"}
            if layout is not None:
                post = {"layout": layout, **post}
            self._bar.set_postfix(post, refresh=False)
        self._done = max(self._done, done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "RolloutProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
