"""The caller's side of one submitted prompt: its group of ``n`` samples as they are delivered.

Why a class of its own: a prompt submitted to one engine (its serving loop, rollout/serving_loop.py)
and a prompt submitted to a fleet (one replica, or the next one after a replica is lost:
fleet/fleet.py) must look the same to whoever awaits, streams or aborts it -- the OpenAI server,
an agent loop, a trainer. Where the tokens come from is the producer's business; this class owns
what every producer shares: the tokens (and their logprobs and weight versions) handed out so far per
sample, the listeners of ``stream()`` in any thread's event loop, admission (the producer took the
prompt, or the ValueError refusing it), the finished group, and the failure that ended it.

Producers call the underscored methods from their own thread; callers use the rest from any thread
or event loop. ``_advance`` takes tokens by their position in the sample, so a producer that starts a
sample over (a fleet resubmitting a lost replica's request with the same seed) hands out only what
is new.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from splash_rollout.rollout.types import SampleGroup


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one sample of a handle since the last delta (``stream``)."""

    sample: int
    """Index of the sample in its group."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """Set on a sample's last delta."""


class GroupHandle:
    """One submitted prompt's group of ``n`` samples: await it, block on it, stream it, abort it."""

    def __init__(self, prompt_ids: list[int], n: int, abort_samples: Callable[[list[int]], None]) -> None:
        """``abort_samples(indices)`` asks the producer to end those samples (at its next step)."""
        self.prompt_ids = prompt_ids
        self.n = n
        self._abort_samples = abort_samples
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[float]] = [[] for _ in range(n)]
        """Per sample: the tokens (and logprobs) handed out so far -- what a stream opened late replays."""
        self._reasons: list[str | None] = [None] * n
        self._versions: list[list[int]] = [[] for _ in range(n)]
        """Per sample: the weight version each of its tokens so far was sampled under."""
        self._done = threading.Event()
        self._group: SampleGroup | None = None
        self._error: BaseException | None = None
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._lock = threading.Lock()
        """Guards the tokens so far and the listeners: a delta is recorded and sent under it."""
        self._admission: concurrent.futures.Future = concurrent.futures.Future()
        """Set once the producer has taken the prompt: True, or the ValueError refusing it."""

    # ---- what the producer calls (its thread) -----------------------------------------------------
    def _advance(self, i: int, start: int, token_ids: list[int], logprobs: list[float], version: int,
                 reason: str | None = None) -> None:
        """Sample ``i``'s tokens from output position ``start`` on (what was handed out already is
        skipped), sampled under ``version``; ``reason`` when the sample ended with them."""
        if self._reasons[i] is not None:
            return  # that sample has ended (a producer starting over repeats it)
        skip = len(self._tokens[i]) - start
        if len(token_ids) > skip or reason is not None:
            self._add(i, token_ids[max(skip, 0):], logprobs[max(skip, 0):], version, reason)

    def _add(self, i: int, token_ids: list[int], logprobs: list[float], version: int, reason: str | None) -> None:
        """Sample ``i``'s new tokens (and its end): recorded, then sent to every listener."""
        if token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        with self._lock:
            self._tokens[i] += token_ids
            self._logprobs[i] += logprobs
            self._versions[i] += [version] * len(token_ids)
            self._reasons[i] = reason
            delta = TokenDelta(i, list(token_ids), list(logprobs), reason)
            for aloop, queue in self._listeners:
                aloop.call_soon_threadsafe(queue.put_nowait, delta)

    def _admit(self) -> None:
        if not self._admission.done():
            self._admission.set_result(True)

    def _complete(self, group: SampleGroup) -> None:
        """Every sample has ended: ``group`` is the result."""
        self._group = group
        self._admit()
        self._close(None)

    def _fail(self, error: BaseException) -> None:
        if not self._admission.done():
            self._admission.set_exception(error)
        self._close(error)

    def _close(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        with self._lock:
            for aloop, queue in self._listeners:
                aloop.call_soon_threadsafe(queue.put_nowait, None)

    # ---- the caller's side -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def admitted(self, timeout: float | None = None) -> bool:
        """Blocks until the engine has taken the prompt into its queue (its next step boundary): True,
        or raises the ValueError that refused it (no pool the engine may use holds prompt +
        ``max_new_tokens``; a token id outside the vocabulary)."""
        try:
            return self._admission.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self._name()}: not taken by the engine within {timeout} s") from None

    async def wait_admitted(self) -> bool:
        """``admitted``, awaited."""
        return await asyncio.wrap_future(self._admission)

    def result(self, timeout: float | None = None) -> SampleGroup:
        """The group once every sample has finished (blocks; ``timeout`` seconds at most)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self._name()}: not finished within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._group

    async def wait(self) -> SampleGroup:
        """The group, awaited (the event loop keeps running meanwhile)."""
        async for _ in self.stream_batches():
            pass
        return self.result(0)

    def __await__(self):
        return self.wait().__await__()

    async def stream(self) -> AsyncIterator[TokenDelta]:
        """The samples' tokens as steps produce them (every delta from the first token on, whenever
        the stream is opened), each sample's last delta with its finish reason."""
        async for batch in self.stream_batches():
            for delta in batch:
                yield delta

    async def stream_batches(self) -> AsyncIterator[list[TokenDelta]]:
        """``stream``, with every delta already waiting taken at once (fewer wake-ups for a listener
        that forwards them: one batch per engine step at most)."""
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        with self._lock:
            for i in range(self.n):  # what came before the listener, one delta per sample
                if self._tokens[i] or self._reasons[i] is not None:
                    queue.put_nowait(TokenDelta(i, list(self._tokens[i]), list(self._logprobs[i]), self._reasons[i]))
            if self._done.is_set():
                queue.put_nowait(None)
            else:
                self._listeners.append((aloop, queue))
        try:
            ended = False
            while not ended:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                ended = batch[-1] is None
                batch = [d for d in batch if d is not None]
                if batch:
                    yield batch
        finally:
            with self._lock:
                if (aloop, queue) in self._listeners:
                    self._listeners.remove((aloop, queue))
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """End the group's unfinished samples at the next step boundary (finish_reason ``abort``)."""
        self._abort_samples(list(range(self.n)))

    def abort_sample(self, i: int) -> None:
        """End sample ``i`` at the next step boundary (finish_reason ``abort``, its tokens so far kept);
        the others run on."""
        if not 0 <= i < self.n:
            raise IndexError(f"abort_sample: sample {i} of a group of {self.n}")
        self._abort_samples([i])

    def _name(self) -> str:
        return f"request ({len(self.prompt_ids)} prompt tokens, n={self.n})"
