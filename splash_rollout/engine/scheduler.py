"""Scheduler: admission, chunked prefill under a per-step token budget, continuous batching.

Each step spends at most ``max_num_batched_tokens`` query rows: running requests in decode go first
(one row each), then running requests still in prefill continue their prompt, then waiting requests
are admitted in arrival order while their pages fit. A long prompt spans several steps (chunked
prefill); only the chunk that reaches the end of a request's known tokens samples a token.
Admission reserves the request's worst-case pages (prompt + max_new_tokens, capped by the context)
so a running request never stalls for memory; its page table grows against that reservation.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from splash_rollout.engine.placement import KVPlacement
from splash_rollout.engine.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_new: int
    """Query rows this step."""

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens (so its last row is sampled)."""
        return self.start + self.num_new == self.request.num_tokens


class Scheduler:
    def __init__(self, placement: KVPlacement, max_num_batched_tokens: int, max_num_seqs: int = 256,
                 ever_admits: Callable[[Request], bool] | None = None) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: expected >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {max_num_seqs}")
        self.placement = placement
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.ever_admits = ever_admits
        """Whether a request can ever run; default: in the current layout's empty pools. An engine
        that may switch layouts (``auto``) accepts what any reachable layout holds."""

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_admit(self, request: Request) -> bool:
        if self.ever_admits is not None:
            return self.ever_admits(request)
        return self.placement.can_ever_admit(request)

    def add(self, request: Request) -> None:
        if not self.can_ever_admit(request):
            raise ValueError(f"num_pages: request {request.request_id} needs "
                             f"{request.pages_needed(self.placement.page_size)} pages, more than the "
                             f"{self.placement.layout} pools hold ({[m.num_pages for m in self.placement.managers]})")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        decoding = [r for r in self.running if not r.in_prefill]
        prefilling = [r for r in self.running if r.in_prefill]
        for req in decoding + prefilling:
            if budget == 0:
                break
            n = min(req.num_uncomputed_tokens, budget)
            out.append(self._take(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.placement.can_admit(req):
                break  # FIFO: later requests wait behind the head so long prompts are not starved
            self.waiting.popleft()
            self.placement.admit(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = min(req.num_uncomputed_tokens, budget)
            out.append(self._take(req, n))
            budget -= n
        return out

    def _take(self, req: Request, n: int) -> ScheduledSeq:
        """Grow the page tables so positions [0, computed + n) have pages."""
        self.placement.grow(req, req.num_computed_tokens + n)
        return ScheduledSeq(req, n)

    # ---- postprocess -------------------------------------------------------------------------
    def postprocess(self, scheduled: list[ScheduledSeq], tokens: torch.Tensor,
                    logprobs: torch.Tensor) -> list[Request]:
        """tokens / logprobs: [R] for the scheduled seqs that sample, in order. Returns the finished."""
        finished = []
        k = 0
        for s in scheduled:
            samples = s.samples
            s.request.num_computed_tokens += s.num_new
            if samples:
                s.request.append_token(int(tokens[k]), float(logprobs[k]))
                k += 1
                if s.request.finish_reason is not None:
                    self.finish(s.request, s.request.finish_reason)
                    finished.append(s.request)
        return finished

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request: give back its pages and what is left of its reservations."""
        self.placement.release(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED

    def abort_all(self) -> list[Request]:
        aborted = list(self.running) + list(self.waiting)
        for req in aborted:
            self.finish(req, "abort")
        return aborted
