"""Putting full (trainer-side) weights into one rank's shards, whatever the current layout.

Each rank holds parts of the full tensors (``rank_weights.rank_targets``: its head slice of Q-B /
KV-B / O -- all heads in a replicated layout --, its slice of the dense MLP and shared experts, its
own routed experts, the replicated rest). A push is validated first (name, shape, exact dtype cast,
no shard where a full parameter belongs, finite values), so a bad push is rejected as a whole and
the old weights stay. Then either every rank cuts its parts out of full tensors it has
(``apply_update``: one rank in the caller's process, or the caller's torchrun ranks), or a driver
that spawned the ranks cuts each rank's parts and sends them in bounded buckets (``cut_push``,
``apply_parts``), so no rank ever receives the whole model.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from splash_rollout.models.packed_linear import PACKED


def served_part(named, full_shapes: dict[str, tuple]):
    """The push without the tensors of MTP modules the engine does not hold (a trainer's whole state
    dict carries them; an engine that does not draft with them serves without them). Anything that
    is not a dict is handed on as it is, for ``validate_update`` to refuse."""
    from splash_rollout.models.mtp import is_mtp_name

    if not isinstance(named, Mapping):
        return named
    return {n: t for n, t in named.items() if n in full_shapes or not is_mtp_name(str(n))}


def validate_update(named: dict[str, torch.Tensor], full_shapes: dict[str, tuple], check_finite: bool = True) -> None:
    """full_shapes: name -> (shape, dtype) of the unsharded model. Raises naming the first problem;
    touches nothing, so a rejected push leaves the serving weights as they were.

    Checks, in order: a dict of tensors; known names; no shard or placeholder where a full parameter
    belongs (``_partial_reason``); the full shape; a dtype that casts to the model's exactly (a
    bfloat16 push into a float32 model is fine, a float32 push that bfloat16 would round is not);
    and with ``check_finite``, no NaN or infinity in any floating tensor. ``check_finite`` costs one
    sum per tensor (one read of the push; a tensor is counted value by value only when its sum is not
    finite), less than the copy the update makes anyway: 30-300 ms per 100 MB on a loaded 2-core CPU,
    against ~400 ms for one copy. The exact-cast check reads a tensor only when its dtype differs."""
    if not isinstance(named, Mapping):
        raise TypeError(f"update_weights: expected a dict of name -> tensor, got {type(named).__name__}")
    not_tensors = sorted(str(n) for n, t in named.items() if not isinstance(t, torch.Tensor))
    if not_tensors:
        first = next(n for n in named if str(n) == not_tensors[0])
        raise TypeError(f"update_weights: {first}: expected a torch.Tensor, got {type(named[first]).__name__}")
    unknown = sorted(str(n) for n in set(named) - set(full_shapes))
    if unknown:
        raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}")
    for name, t in named.items():
        shape, dtype = full_shapes[name]
        partial = _partial_reason(t, tuple(shape))
        if partial:
            raise ValueError(f"update_weights: {name}: {partial}; push full (unsharded) parameters, e.g. gathered "
                             f"from FSDP / ZeRO-3 before the push")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"update_weights: {name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            inexact = _inexact_cast(t, dtype)
            if inexact:
                raise ValueError(f"update_weights: {name}: expected dtype {dtype}, got {t.dtype}, and {inexact} of its "
                                 f"{t.numel()} values do not cast to {dtype} exactly; cast it yourself to accept the "
                                 f"rounding")
    if check_finite:
        for name, t in named.items():
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t.sum())):
                # a NaN or an infinity makes the sum non-finite; a finite sum proves the tensor is clean
                # in one cheap reduction, and only a suspicious tensor is counted value by value
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    raise ValueError(f"update_weights: {name}: {bad} of its {t.numel()} values are NaN or infinite "
                                     f"(the first non-finite tensor of the push); nothing was updated")


def _partial_reason(t: torch.Tensor, shape: tuple) -> str | None:
    """Why ``t`` looks like part of a parameter rather than all of it, or None."""
    if type(t).__name__ == "DTensor":
        return "is a DTensor (a sharded parameter); call .full_tensor() first"
    if t.is_meta:
        return "is on the meta device (shape only, no values)"
    if t.numel() == 0 and math.prod(shape) > 0:
        return f"is empty (shape {tuple(t.shape)}; a ZeRO-3 partitioned parameter?) instead of shape {shape}"
    if t.dim() == len(shape) and tuple(t.shape) != shape:
        dims = [d for d in range(t.dim()) if t.shape[d] != shape[d]]
        if len(dims) == 1 and t.shape[dims[0]] and shape[dims[0]] % t.shape[dims[0]] == 0:
            d = dims[0]
            return (f"has shape {tuple(t.shape)}, 1/{shape[d] // t.shape[d]} of the full {shape} along dim {d}: "
                    f"a shard, not the whole parameter")
    return None


def _inexact_cast(t: torch.Tensor, dtype: torch.dtype) -> int:
    """How many values of ``t`` change when cast to ``dtype`` and back (NaN counts as unchanged)."""
    back = t.to(dtype).to(t.dtype)
    same = (back == t) | (torch.isnan(back) & torch.isnan(t)) if t.is_floating_point() else back == t
    return int((~same).sum())


@torch.inference_mode()
def apply_update(targets: Mapping[str, list], named: Mapping[str, torch.Tensor]) -> None:
    """Copy validated full tensors into the parts of them this rank holds (``targets``: full name ->
    its ``Target``s here -- ``rank_targets``' heads, experts and MLP slices and the replicated rest,
    and the drafting MTP module where this rank holds it). Inference mode: a live switch builds the
    destination's shards inside a serving step, as inference tensors, and those only take in-place
    writes under it (normal tensors take them there too)."""
    for name, full in named.items():
        for target in targets.get(name, ()):
            target.tensor.copy_(full[target.index] if target.index else full)
    PACKED.clear()  # packed copies are of the old values; switch-built shards keep no version to tell


@torch.inference_mode()
def apply_parts(targets: Mapping[str, list], parts: list[tuple[str, tuple, torch.Tensor]]) -> None:
    """Copy parts a driver already cut for this rank ((full name, part, values), as ``held_parts``
    named them) into the tensors that hold them (``targets``, as ``apply_update``'s). A part this
    rank does not hold is an error."""
    for name, index, part in parts:
        held = [t for t in targets.get(name, ()) if t.index == index]
        if not held:
            raise ValueError(f"update_weights: {name}{list(index)} is not a part this rank holds (the layout "
                             f"changed since the push was cut?)")
        for target in held:
            target.tensor.copy_(part)
    PACKED.clear()


DEFAULT_BUCKET_BYTES = 256 << 20
"""Bytes of one rank's parts a driver sends in one message of a push (one part larger goes alone)."""


def cut_push(named: Mapping[str, torch.Tensor], held_by_rank: list[dict[str, list[tuple]]],
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[list[tuple[str, tuple, torch.Tensor]]]]:
    """A validated push cut for each rank: every rank's parts (``held_parts``) of the pushed tensors, in
    buckets of at most ``bucket_bytes`` each. Yields one bucket per rank per round (empty where a rank
    has nothing left), so each rank receives its own parts only and at most one bucket at a time is
    cut per rank. Parts are compact CPU copies (a view would carry its whole tensor along)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected a positive number of bytes, got {bucket_bytes}")
    plans: list[list[list[tuple[str, tuple]]]] = []
    for held in held_by_rank:
        buckets: list[list[tuple[str, tuple]]] = [[]]
        size = 0
        for name, full in named.items():
            for index in held.get(name, ()):
                part = full[index] if index else full
                nbytes = part.numel() * part.element_size()
                if buckets[-1] and size + nbytes > bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append((name, index))
                size += nbytes
        plans.append([b for b in buckets if b])
    for round_ in range(max((len(p) for p in plans), default=0)):
        yield [[(name, index, (named[name][index] if index else named[name]).detach().to("cpu", copy=True).contiguous())
                for name, index in (plan[round_] if round_ < len(plan) else [])] for plan in plans]
