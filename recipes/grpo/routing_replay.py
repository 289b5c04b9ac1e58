"""Routing replay (R3) on the trainer side: the rollout's expert choices, laid out for a training forward.

A MoE router picks its top-k experts by comparing scores; a trainer whose weights differ from the
engine's by rounding (``numerics=fast``) or by a few steps (stale rollouts) can flip a near tie, and
the flipped token then trains through experts the rollout never used. With ``grpo.routing_replay``
the engine returns every sample's routing (``EngineConfig.outputs.return_routing``) and the trainer's
forward replays it (``models.moe.routing_context``): the same experts, gating weights from the
current router.
"""
from __future__ import annotations

from typing import Sequence

import torch

from splash_rollout.rollout.types import Sample


def replay_table(samples: Sequence[Sample], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of one micro-batch (collated right-padded to ``seq_len``) -> (expert ids [B, S, L, k]
    int64, replayed [B, S] bool). Position p of sample i is replayed where the engine ran it; the
    rest (its last token, padding) routes freely, which no trained logprob depends on."""
    if not samples:
        raise ValueError("routing replay: no samples")
    missing = [i for i, s in enumerate(samples) if s.routing is None]
    if missing:
        raise ValueError(f"routing replay: samples {missing[:5]} carry no routing; build the engine with "
                         f"EngineConfig(outputs={{\"return_routing\": True}})")
    layers, k = samples[0].routing.shape[1:]
    ids = torch.zeros((len(samples), seq_len, layers, k), dtype=torch.int64)
    replayed = torch.zeros((len(samples), seq_len), dtype=torch.bool)
    for i, s in enumerate(samples):
        r = torch.from_numpy(s.routing.astype("int64"))
        if r.shape[1:] != (layers, k):
            raise ValueError(f"routing replay: sample {i} has routing {tuple(r.shape)}, sample 0 "
                             f"[*, {layers}, {k}]")
        n = min(len(r), seq_len)
        ids[i, :n] = r[:n]
        replayed[i, :n] = True
    return ids, replayed


def replay_layers(ids: torch.Tensor, replayed: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [B, S, L, k], replayed [B, S]) -> per MoE layer (ids [B*S, k], replayed [B*S]): the rows
    a training forward hands the routers ([B, S] flattened batch-major)."""
    b, s, layers, k = ids.shape
    flat = ids.reshape(b * s, layers, k)
    mask = replayed.reshape(b * s)
    return [(flat[:, j], mask) for j in range(layers)]
