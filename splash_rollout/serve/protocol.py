"""The OpenAI-compatible wire format: request bodies checked field by field, response bodies built.

Why by hand instead of a schema library's models: every bad request must come back with a message
that names the field and the limit (``max_tokens: expected an integer >= 1, got -3``), in OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``), and fields OpenAI has but this
engine does not serve (``best_of`` other than ``n``, ``echo``, ``suffix``, top alternatives in
``logprobs``) are refused by name rather than silently ignored. vLLM's extensions that a trainer needs
are taken too: ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids`` and ``return_token_ids``
(``choices[i].token_ids`` and ``prompt_token_ids`` in the response, as vLLM names them).
"""
from __future__ import annotations

import numbers
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from splash_rollout.rollout.types import MIN_TEMPERATURE, SamplingParams


class BadRequest(ValueError):
    """A request the server refuses: ``status`` (4xx), the field it names (``param``), OpenAI's ``code``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def _int(body: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise BadRequest(f"{name}: expected an integer, got {value!r}", name)
    if low is not None and value < low:
        raise BadRequest(f"{name}: expected an integer >= {low}, got {value}", name)
    return int(value)


def _number(body: dict, name: str, default: float, low: float, high: float | None = None) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or value != value:
        raise BadRequest(f"{name}: expected a number, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"{name}: expected a number {bound}, got {value}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name}: expected true or false, got {value!r}", name)
    return value


@dataclass
class Sampling:
    """What one request asks of every prompt it carries."""

    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    """Stop strings: a sample ends before the first one its text contains (finish_reason ``stop``)."""
    logprobs: bool = False
    return_token_ids: bool = False
    stream: bool = False


def parse_sampling(body: dict, max_tokens_default: int, chat: bool) -> Sampling:
    """The sampling fields shared by completions and chat completions."""
    n = _int(body, "n", 1, 1)
    best_of = _int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise BadRequest(f"best_of: only best_of == n is served (every sample is returned), got best_of={best_of}, "
                         f"n={n}", "best_of")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, max_tokens_default, 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(f"temperature: expected 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p: expected a number in (0, 1], got 0", "top_p")
    top_k = _int(body, "top_k", -1)
    if top_k is not None and top_k < -1:
        raise BadRequest(f"top_k: expected -1 (off) or an integer >= 0, got {top_k}", "top_k")
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
        raise BadRequest(f"seed: expected an integer, got {seed!r}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise BadRequest(f"stop: expected a non-empty string or a list of at most 16 of them, got {body.get('stop')!r}",
                         "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest(f"stop_token_ids: expected a list of token ids, got {stop_ids!r}", "stop_token_ids")
    if chat:
        logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, 0)
    else:
        top = body.get("logprobs")
        if top is not None and (not isinstance(top, numbers.Integral) or isinstance(top, bool) or top < 0):
            raise BadRequest(f"logprobs: expected an integer >= 0 (or null), got {top!r}", "logprobs")
        logprobs, top = top is not None, int(top or 0)
    if top > 1:
        raise BadRequest(f"{'top_logprobs' if chat else 'logprobs'}: this server returns the sampled token's "
                         f"logprob only (at most 1), got {top}", "top_logprobs" if chat else "logprobs")
    for unsupported in ("echo", "suffix") if not chat else ("tools", "functions"):
        if body.get(unsupported):
            raise BadRequest(f"{unsupported}: not supported by this server", unsupported)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids),
                            ignore_eos=_bool(body, "ignore_eos", False), seed=None if seed is None else int(seed))
    return Sampling(params, stop, logprobs, _bool(body, "return_token_ids", False), _bool(body, "stream", False))


def parse_prompts(body: dict) -> list[str | list[int]]:
    """``prompt``: a string, a list of token ids, or a list of either (one group of ``n`` per prompt)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt: required (a string, a list of token ids, or a list of those)", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p)) for p in prompt):
        return list(prompt)
    raise BadRequest(f"prompt: expected a non-empty string, token-id list, or list of those, got {prompt!r:.100}",
                     "prompt")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]: expected an object with a string role, got {m!r:.100}", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: expected a string, got {content!r:.100}", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


# ---- responses ----------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int = 0) -> dict:
    """OpenAI's legacy completions ``logprobs`` object (the sampled token as the one top alternative)."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)], "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    """Chat completions' ``logprobs`` object."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}]}
                        for t, lp in zip(tokens, logprobs)]}


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        raise BadRequest("model: required (GET /v1/models lists the one served)", "model")
    if model != served:
        raise BadRequest(f"model: {model!r} is not served here; this server serves {served!r}", "model", status=404,
                         code="model_not_found")


def to_json_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; an empty body is ``{}`` (``curl -X POST .../admin/sleep``)."""
    import json

    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body
