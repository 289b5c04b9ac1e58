"""Putting full (trainer-side) weights into one rank's shards, whatever the current layout.

Each rank slices what it holds out of the full tensors it is given — its head slice of Q-B / KV-B /
O (all heads in a replicated layout), its slice of the dense MLP and shared experts, its own routed
experts — and copies the replicated rest. Everything is validated first (name, shape, dtype), so a
bad push is rejected as a whole and the old weights stay.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from splash_rollout.engine.parallel_mlp import DenseShard, ParallelFeedForward

_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.weight$")
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(.+)$")


def validate_update(named: dict[str, torch.Tensor], full_shapes: dict[str, tuple]) -> None:
    """full_shapes: name -> (shape, dtype) of the unsharded model. Raises naming the first problem."""
    if not isinstance(named, Mapping):
        raise TypeError(f"update_weights: expected a dict of name -> tensor, got {type(named).__name__}")
    not_tensors = sorted(n for n, t in named.items() if not isinstance(t, torch.Tensor))
    if not_tensors:
        raise TypeError(f"update_weights: {not_tensors[0]}: expected a torch.Tensor, "
                        f"got {type(named[not_tensors[0]]).__name__}")
    unknown = sorted(set(named) - set(full_shapes))
    if unknown:
        raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}")
    for name, t in named.items():
        shape, dtype = full_shapes[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"update_weights: {name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"update_weights: {name}: expected dtype {dtype}, got {t.dtype}")


def _heads(shard, attn, which: str, full: torch.Tensor) -> torch.Tensor:
    a, b = shard.heads.start, shard.heads.stop
    qk, kvd, v = attn.nope_dim + attn.rope_dim, attn.nope_dim + attn.v_dim, attn.v_dim
    if which in ("q_b_proj", "q_proj"):
        return full[a * qk: b * qk]
    if which == "kv_b_proj":
        return full[a * kvd: b * kvd]
    return full[:, a * v: b * v]


def _dense(shard: DenseShard, part: str, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    width = full.shape[1] // world_size if part == "down_proj" else full.shape[0] // world_size
    a, b = rank * width, (rank + 1) * width
    return full[:, a:b] if part == "down_proj" else full[a:b]


@torch.inference_mode()
def apply_update(model, shards, named: dict[str, torch.Tensor], rank: int, world_size: int) -> None:
    """Copy validated full tensors into this rank's shards and replicated parameters. Inference mode:
    a live switch builds the destination's shards inside a serving step, as inference tensors, and
    those only take in-place writes under it (normal tensors take them there too)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    layers = model.model.layers
    for name, full in named.items():
        m = _ATTN.match(name)
        if m:
            i, which = int(m.group(1)), m.group(2)
            key = {"q_b_proj": "q_b", "q_proj": "q_b", "kv_b_proj": "kv_b", "o_proj": "o"}[which]
            getattr(shards[i], key).copy_(_heads(shards[i], layers[i].self_attn, which, full))
            continue
        m = _MLP.match(name)
        if m and isinstance(layers[int(m.group(1))].mlp, ParallelFeedForward):
            shard, rest = layers[int(m.group(1))].mlp.shard, m.group(2)
            part = rest.split(".")[-2]
            target = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}.get(part)
            if isinstance(shard, DenseShard):
                getattr(shard, target).copy_(_dense(shard, part, full, rank, world_size))
            elif rest.startswith("shared_experts."):
                getattr(shard.shared, target).copy_(_dense(shard.shared, part, full, rank, world_size))
            elif rest.startswith("experts."):
                e = int(rest.split(".")[1]) - shard.first_expert
                if 0 <= e < len(shard.experts):
                    shard.experts[e].get_parameter(rest.split(".", 2)[2]).copy_(full)
            else:  # router: mlp.gate.weight / mlp.gate.e_score_correction_bias, replicated
                getattr(shard.gate, rest.split(".", 1)[1]).copy_(full)
            continue
        (params.get(name) if name in params else buffers[name]).copy_(full)
