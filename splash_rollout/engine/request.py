"""Request: one sample's life inside the engine (one prompt, one seed, one response).

The rollout layer turns each (prompt, sample j) into a ``Request``; the scheduler moves it
waiting → running → finished and the model runner reads its page table. Token positions
``[0, num_computed_tokens)`` have KV in the pool; the rest of ``token_ids`` is what still has to
run (a prompt chunk, or the one token sampled last step).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from splash_rollout.engine.page_manager import num_pages_for


@dataclass(frozen=True)
class SamplingSpec:
    """Per-sample sampling settings as the engine sees them (the seed is already concrete; the
    sampler uses its low 64 bits)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    """[num_prompt_tokens] token ids."""
    spec: SamplingSpec
    max_len: int
    """Context limit: prompt + response never exceeds this many tokens."""
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    """[num_output_tokens] sampled token ids."""
    output_logprobs: list[float] = field(default_factory=list)
    """[num_output_tokens] log-probability of each sampled token (see sampler.py)."""
    num_computed_tokens: int = 0
    owner: int = 0
    """Owner rank (DP-attention / DOP store the history there); chosen at admission, never changed."""
    rank_pages: list[list[int]] = field(default_factory=list)
    """[T][num_logical_pages]: physical page of logical page i on each rank, -1 where not stored."""
    num_shared_pages: int = 0
    """Leading logical pages whose physical pages other samples of the same prompt hold too."""
    fork_of: "Request | None" = None
    """While admitted but waiting for a sample of the same prompt (the leader) to finish prefilling
    it: that leader. The follower then samples its first token from the leader's last prompt row and
    takes the prompt's KV (shared pages) without computing it."""
    forks: list["Request"] = field(default_factory=list)
    """On a leader: the followers waiting for its prompt."""
    admitted_at: int = -1
    """Admission counter of the scheduler replica (retraction takes the youngest first)."""
    num_retractions: int = 0
    """Times its pages were taken back and it was queued again (its tokens kept)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    """None while it runs; then ``stop``, ``length``, ``abort`` or ``error`` (its logits were not finite)."""

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def pages(self) -> list[int]:
        """Rank 0's page table (the whole table on a single rank)."""
        return self.rank_pages[0] if self.rank_pages else []

    @property
    def num_logical_pages(self) -> int:
        return len(self.rank_pages[0]) if self.rank_pages else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_at(self, start: int, count: int) -> list[int]:
        """Token ids of positions [start, start + count) without building the whole sequence."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p: start - p + count]
        head = self.prompt_ids[start: start + count]
        return head + self.output_ids[: max(0, start + count - p)]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens the request can ever hold: prompt + max_new_tokens, capped by the context."""
        return min(self.num_prompt_tokens + self.spec.max_new_tokens, self.max_len)

    def pages_needed(self, page_size: int) -> int:
        """Worst-case page count (the most it can ever hold)."""
        return num_pages_for(self.max_total_tokens, page_size)

    @functools.cached_property
    def prefix_key(self) -> tuple[int, ...]:
        """What samples of the same prompt have in common (their KV for it is the same)."""
        return tuple(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # ---- transitions -------------------------------------------------------------------------
    def append_token(self, token: int, logprob: float) -> None:
        """Record a sampled token and decide whether the request stops here. A negative token is the
        sampler's refusal (non-finite logits, ``sampler.NO_TOKEN``): nothing is recorded and the
        request ends with ``error``."""
        if token < 0:
            self.finish_reason = "error"
            return
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if not self.spec.ignore_eos and token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token in self.spec.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.spec.max_new_tokens or self.num_tokens >= self.max_len:
            self.finish_reason = "length"

    def append_provisional(self, token: int, logprob: float) -> None:
        """Inside a token window (engine/token_window.py): record a token without deciding anything;
        ``settle`` replaces it when the window closes. A refusal (negative) is held as token 0."""
        self.output_ids.append(max(token, 0))
        self.output_logprobs.append(logprob)

    def settle(self, tokens: list[int], logprobs: list[float]) -> int:
        """A window closes: take back the last ``len(tokens)`` provisional tokens and append the real
        ones in order, as ``append_token`` would have one step at a time, up to the first that ends the
        request. Returns how many were dropped after that one."""
        del self.output_ids[len(self.output_ids) - len(tokens):]
        del self.output_logprobs[len(self.output_logprobs) - len(tokens):]
        for j, (token, logprob) in enumerate(zip(tokens, logprobs)):
            self.append_token(token, logprob)
            if self.finish_reason is not None:
                return len(tokens) - j - 1
        return 0
