"""Input checks of a RolloutEngine call, run before any work starts.

A rollout engine lives for days inside an RL job. A bad input must fail the one call that carries it
with an error that names the field and what was expected ("field: expected X, got Y"), before any
request is queued or any rank is asked to do anything, so that the engine keeps serving the next
good call. These checks sit here, apart from ``RolloutEngine``, so the rules are in one place:

* ``check_world_size``: every sharded dimension splits evenly over the T ranks (checked before the
  ranks are spawned, not when a worker's ``div_even`` fails halfway through building).
* ``prompt_ids`` / ``check_sampling``: one prompt's token ids, and the per-prompt SamplingParams.
* ``check_queue_bound``: a call asks for at most ``EngineConfig.batching.max_queued_requests`` samples.
* ``agree_across_ranks``: under torchrun every rank calls ``generate``; rank 0's requests are the
  ones served, so ranks that were handed different prompts would silently get rank 0's answers (or
  hang in a collective if one rank rejected its input). A digest of each rank's requests (or its
  input error) is gathered before serving, and every rank raises the same error on a mismatch.
"""
from __future__ import annotations

import hashlib
import numbers
from typing import Any, Callable, Sequence

from splash_rollout.models.config import ModelConfig


def check_world_size(config: ModelConfig, world_size: int) -> None:
    """The dimensions T ranks split: attention heads, routed experts, dense and shared-expert MLP widths."""
    dims = [("num_heads", config.num_heads), ("n_routed_experts", config.n_routed_experts)]
    if any(not config.is_moe_layer(i) for i in range(config.num_layers)):
        dims.append(("intermediate_size", config.intermediate_size))
    if config.n_routed_experts and config.n_shared_experts:
        dims.append(("moe_intermediate_size * n_shared_experts", config.moe_intermediate_size * config.n_shared_experts))
    for what, n in dims:
        if n and n % world_size:
            raise ValueError(f"world_size: {world_size} does not divide {what}={n} of {config.name} "
                             f"(expected a divisor of {n})")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def prompt_ids(i: int, prompt: Any, vocab_size: int, max_len: int, encode: Callable[[str], list[int]]) -> list[int]:
    """prompts[i] as a list of token ids in [0, vocab_size), shorter than the context ``max_len``."""
    if isinstance(prompt, str):
        ids = list(encode(prompt))
    elif isinstance(prompt, (bytes, bytearray, dict)):
        raise TypeError(f"prompts[{i}]: expected a string or a sequence of token ids, got {type(prompt).__name__}")
    else:
        try:
            ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)  # list, tuple, array, tensor
        except TypeError:
            raise TypeError(f"prompts[{i}]: expected a string or a sequence of token ids, "
                            f"got {type(prompt).__name__}") from None
        bad = [(k, t) for k, t in enumerate(ids) if not _is_int(t)]
        if bad:
            k, t = bad[0]
            raise TypeError(f"prompts[{i}][{k}]: expected an integer token id, got {type(t).__name__} {t!r}")
        ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompts[{i}]: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_len:
        raise ValueError(f"prompts[{i}]: expected fewer than {max_len} tokens (the context, max_model_len, "
                         f"must leave room for a response), got {len(ids)}")
    return ids


def check_queue_bound(params: Sequence[Any], max_queued_requests: int) -> None:
    """The call's samples (sum of n over its prompts) fit the engine's queue bound."""
    total = sum(p.n for p in params)
    if total > max_queued_requests:
        raise ValueError(f"sampling: {len(params)} prompts x n ask for {total} samples, more than "
                         f"EngineConfig.batching.max_queued_requests={max_queued_requests}; split the call or raise the bound")


def check_sampling(params: Sequence[Any], vocab_size: int, sampling_type: type) -> None:
    for i, p in enumerate(params):
        if not isinstance(p, sampling_type):
            raise TypeError(f"sampling[{i}]: expected SamplingParams, got {type(p).__name__}")
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sampling[{i}].stop_token_ids: {bad} outside the vocabulary [0, {vocab_size})")


def request_digest(records: Sequence[Any]) -> str:
    """A digest of request records (their reprs: ids, prompts, sampling specs, seeds), equal on two
    ranks exactly when they would serve the same requests."""
    h = hashlib.sha256()
    for r in records:
        h.update(repr(r).encode())
        h.update(b"\0")
    return h.hexdigest()


def agree_across_ranks(gather: Callable[[Any], list[Any]], digest: str | None, error: BaseException | None) -> None:
    """Collective. ``gather(obj)`` returns every rank's obj in rank order (``Comm.gather_objects``).
    Raises the same ValueError on every rank when some rank rejected its input (``error``) or the
    ranks' request digests differ; returns on every rank otherwise."""
    mine = (digest, None if error is None else f"{type(error).__name__}: {error}")
    everyone = gather(mine)
    failed = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if error is not None:
        raise error  # this rank's own input error, as it would be raised at world size 1
    if failed:
        r, e = failed[0]
        raise ValueError(f"generate: rank {r} rejected its input ({e}); every rank must call generate with the "
                         f"same prompts and sampling") from None
    digests = [d for d, _ in everyone]
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise ValueError(f"prompts: expected the same prompts and sampling on every rank, got {len(groups)} "
                         f"different request sets (ranks grouped by request digest: {sorted(groups.values())})")
