"""Rollout data types: SamplingParams in, RolloutBatch (groups of samples + layout timeline) out."""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


MIN_TEMPERATURE = 1e-4
"""Smallest non-zero temperature: logits / temperature must stay finite in float32."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt (one group); a call's prompts x n is bounded by
    ``EngineConfig.batching.max_queued_requests``."""
    temperature: float = 1.0
    """0 means greedy; otherwise finite and at least ``MIN_TEMPERATURE`` (below it the tempered logits
    overflow float32)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    max_new_tokens: int = 16
    """Response tokens at most; the context (``EngineConfig.model.max_model_len``) caps it: a response that
    reaches the context limit stops there with finish_reason ``length``."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    """Sample j of the prompt gets a seed derived from (seed, j); None derives it from the engine's
    seed, a per-call counter and the prompt index. Same seed, same tokens, whatever the batch. Any
    integer (negative and huge ones too) is a seed: it enters through its low 64 bits."""

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "max_new_tokens") + (("seed",) if self.seed is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, (str, bytes, dict)) or not isinstance(self.stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids: expected a sequence of integer token ids, "
                            f"got {type(self.stop_token_ids).__name__} {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bad = [t for t in self.stop_token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise TypeError(f"stop_token_ids: expected integer token ids, got {bad[:5]}")
        if self.n < 1:
            raise ValueError(f"n: expected >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature: expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: expected -1 (off) or >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Sample:
    prompt_ids: list[int]
    """[num_prompt_tokens]"""
    response_ids: list[int]
    """[num_response_tokens]"""
    response_logprobs: list[float]
    """[num_response_tokens] log p(token) under log_softmax(logits / temperature), before truncation."""
    finish_reason: str
    """``stop`` (eos / stop token), ``length`` (max_new_tokens or the context limit), ``abort``
    (``RolloutEngine.abort``), or ``error``: the model's logits for its next token held a NaN or +inf,
    so nothing was drawn; the response holds the tokens before it (all with finite logprobs) and the
    other samples of the call are unaffected. Drop such samples from a training batch."""
    seed: int
    weight_version: int = 0
    """The ``update_weights`` version the sample was generated with."""
    token_versions: list[int] | None = None
    """[num_response_tokens] the weight version each response token was sampled under: all
    ``weight_version`` for a sample generated in one call; a sample continued by
    ``RolloutEngine.resume`` after ``update_weights`` keeps its earlier tokens' versions."""
    spec: Any = None
    """The engine's sampling settings of this sample (temperature, top-k/p, min-p, caps, stop ids,
    seed): what ``RolloutEngine.resume`` continues it with."""
    routing: np.ndarray | None = None
    """``EngineConfig(outputs={"return_routing": True})``: [num_prompt_tokens + num_response_tokens - 1 (the
    positions the engine ran; + 1 after ``error``), num_moe_layers, top_k] int16, row p the experts
    the token at position p was routed to in each MoE layer -- the routing behind the logits of token
    p + 1. None when not requested."""

    response_mask: list[int] | None = None
    """[num_response_tokens] 1 for sampled tokens, 0 for tokens a tool or environment appended between
    turns (``RolloutEngine.continue_samples``); None: every token was sampled."""

    @property
    def versions(self) -> list[int]:
        """[num_response_tokens] ``token_versions``, or ``weight_version`` for every token when unset."""
        return list(self.token_versions) if self.token_versions is not None else [self.weight_version] * len(
            self.response_ids)

    def lag(self, version: int) -> int:
        """How many weight versions its oldest token is behind ``version`` (0 for an empty response)."""
        return version - min(self.versions) if self.response_ids else 0

    @property
    def loss_mask(self) -> list[int]:
        """[num_response_tokens] 1 for every token the policy sampled, 0 for appended (tool / env) tokens."""
        return list(self.response_mask) if self.response_mask is not None else [1] * len(self.response_ids)


@dataclass
class SampleGroup:
    prompt_index: int
    samples: list[Sample]


@dataclass
class Timeline:
    """Layout timeline of one generate call (phases of one layout, and the switches between them)."""

    phases: list[dict[str, Any]] = field(default_factory=list)
    """Each: layout, t_start, t_end, steps, batch_size_start, batch_size_end, tokens (rollout/call_timeline.py)."""
    switches: list[dict[str, Any]] = field(default_factory=list)
    """Each: src, dst, step, bytes_sent [T], bytes_received [T], overhead_ms, blocking_estimate_ms,
    deferred_reason (None when the switch happened)."""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """layout="auto": the policy's choices (step, chosen, reason, predicted per-layout step costs and
    seconds per token, admissions, batch_size, priced_batch). Kept: the first call (``logged="initial"``),
    every switch (``"switch"``) and a checkpoint whenever the priced batch has halved since the last
    kept one (``"drained"``), so a draining group shows why the policy stayed where it was."""
    speculation: list[dict[str, Any]] = field(default_factory=list)
    """``speculation="auto"``: each change of the draft cap (step, cap, reason, predicted tokens/s per cap)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutBatch:
    groups: list[SampleGroup]
    timeline: Timeline = field(default_factory=Timeline)
    metrics: dict[str, float] = field(default_factory=dict)
    """Slash-named records of the call (``rollout/*``, ``perf/*``, ``timing_s/*``)."""
    filtered: list[SampleGroup] = field(default_factory=list)
    """Streaming calls (``generate(on_group=...)``): finished groups that ``on_group`` rejected."""
    aborted: list[SampleGroup] = field(default_factory=list)
    """Streaming calls: groups not used -- cut off when ``target_groups`` were kept (their unfinished
    samples have finish_reason ``abort``) or by ``abort()``, or done after the target was met.
    ``groups`` + ``filtered`` + ``aborted`` are every prompt of the call, once."""
    dropped: list[Sample] = field(default_factory=list)
    """``resume(..., max_off_policy_steps=k)``: samples not continued because their oldest token is
    more than k weight versions old (returned as they were)."""

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]
