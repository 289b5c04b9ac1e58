"""What one rank holds of the model's weights, and where it gets them: the one owner of that rule.

A rank of a T-rank engine holds (``RankShare``):

* its layout's head slice of every layer's switchable projections Q-B / KV-B / O (all heads in a
  replicated layout, H/T in a sharded one) as ``ProjectionShard`` tensors outside the modules; at
  T = 1 the shards are views of the model's own projection weights, which stay a whole model;
* its feed-forward share: with ``feed_forward="sharded"`` on T > 1 ranks its experts
  [r E/T, (r+1) E/T) and its slice of the dense and shared MLPs (``engine/parallel_mlp.py``),
  otherwise every block whole;
* everything else whole: embeddings, LM head, norms, q_a / kv_a, the DSA indexer, the routers.

``place`` builds that structure from a whole model: in place from real weights (an in-memory model
a test or a trainer hands the engine), or on the meta device from ``MLAForCausalLM.skeleton``, where
nothing is allocated until ``materialize_rank`` gives this rank's tensors -- and only them -- their
storage and ``weights.load_into`` fills them from a ``WeightSource`` (a checkpoint's memory-mapped
files, a preset's seeded init) part by part. No process ever holds the whole checkpoint beside its
share. ``rank_targets`` names, for every full (HF-named) tensor, the rank's tensors that hold a part
of it and which part; loading, weight pushes (``weight_update.apply_update``) and the driver's
per-rank slicing of a push all ask it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from splash_rollout.engine.parallel_mlp import ExpertShard, ParallelFeedForward, shard_feed_forward
from splash_rollout.engine.projections import ProjectionShard, drop_full_projections, slice_projections
from splash_rollout.models.config import ModelConfig
from splash_rollout.models.moe import MoE, stack_experts
from splash_rollout.models.weights import Target, WeightSource, full_shapes_of, load_into


@dataclass(frozen=True)
class RankShare:
    """Which part of the model a rank holds."""

    rank: int
    world_size: int
    heads: slice
    """Heads of the switchable projections (the layout's head slice)."""
    feed_forward: str = "sharded"
    """``sharded``: this rank's experts and MLP slices (T > 1); ``replicated``: every block whole."""

    @property
    def shards_feed_forward(self) -> bool:
        return self.world_size > 1 and self.feed_forward == "sharded"


def place(model: nn.Module, share: RankShare, comm) -> list[ProjectionShard]:
    """Turn a whole model (meta or real) into this rank's: feed-forward blocks replaced by this
    rank's shards (their collectives on ``comm``), and per layer the projection shard of
    ``share.heads``; on T > 1 ranks the modules' whole projections are dropped. Returns the shards."""
    if share.shards_feed_forward:
        shard_feed_forward(model, share.rank, share.world_size, comm)
    layers = model.model.layers
    shards = [slice_projections(layer.self_attn, share.heads) for layer in layers]
    if share.world_size > 1:  # one rank's shards are views of the whole weights, which stay a trainable model
        for layer in layers:
            drop_full_projections(layer.self_attn)
    return shards


def stack_rank_experts(model: nn.Module, device: torch.device) -> None:
    """Every MoE block's routed experts of this rank laid out as stacks their parameters view
    (``models.moe.stack_experts``: on a meta model, allocated on ``device`` and filled later by the
    loader), so a fused kernel reads them without a copy."""
    for layer in model.model.layers:
        holder = layer.mlp.shard if isinstance(layer.mlp, ParallelFeedForward) else layer.mlp
        if isinstance(holder, (MoE, ExpertShard)) and len(holder.experts):
            holder.expert_stacks = stack_experts(holder.experts, device)


def materialize_rank(model: nn.Module, shards: list[ProjectionShard], device: torch.device) -> list[ProjectionShard]:
    """Storage on ``device`` for a placed meta model and its shards: exactly the rank's tensors
    (uninitialised; a loader fills them). Shards of modules that keep their whole projections (T = 1)
    become views of them again."""
    from splash_rollout.models.model import materialize

    materialize(model, device)
    out = []
    for layer, shard in zip(model.model.layers, shards):
        attn = layer.self_attn
        if getattr(attn, "kv_b_proj", None) is not None:  # the module keeps its projections: views of them
            out.append(slice_projections(attn, shard.heads))
        else:
            out.append(ProjectionShard(shard.heads, *(torch.empty(t.shape, dtype=t.dtype, device=device)
                                                      for t in (shard.q_b, shard.kv_b, shard.o))))
    return out


def rank_targets(model: nn.Module, shards: list[ProjectionShard]) -> dict[str, list[Target]]:
    """Full tensor name -> the tensors of this rank that hold a part of it, with the part. Names this
    rank holds nothing of (another rank's experts) are absent. A tied LM head is the embedding."""
    targets: dict[str, list[Target]] = defaultdict(list)
    sharded_blocks = set()
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, ParallelFeedForward):
            sharded_blocks.add(f"model.layers.{i}.mlp.")
            for name, tensor, index in layer.mlp.shard.full_parts(f"model.layers.{i}.mlp"):
                targets[name].append(Target(tensor, index))
        attn = layer.self_attn
        if getattr(attn, "kv_b_proj", None) is None:  # the projections live in the shard alone
            for name, tensor, index in shards[i].full_parts(attn, f"model.layers.{i}.self_attn"):
                targets[name].append(Target(tensor, index))
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if any(name.startswith(block) for block in sharded_blocks) or (tied and name == "lm_head.weight"):
            continue
        targets[name].append(Target(tensor))
    return dict(targets)


def held_parts(targets: dict[str, list[Target]]) -> dict[str, list[tuple]]:
    """Full tensor name -> the parts this rank holds (what a driver slices a push by)."""
    return {name: [t.index for t in ts] for name, ts in targets.items()}


@dataclass
class RankWeights:
    """This rank's model (its modules placed), its projection shards, and the whole model's shapes."""

    model: nn.Module
    shards: list[ProjectionShard]
    full_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Unsharded tensor name -> (shape, dtype): what weight pushes are validated against."""


def drop_mtp_modules(model: nn.Module) -> None:
    """A rank serves without the model's MTP modules (models/mtp.py): the engine does not draft with
    them, so a handed-in model's are dropped (in place, their memory freed), a source's never read,
    and a weight push's left out (``weight_update.served_part``)."""
    decoder = getattr(model, "model", None)
    if decoder is not None and len(getattr(decoder, "mtp_layers", ())):
        decoder.mtp_layers = nn.ModuleList()


def adopt(model: nn.Module, share: RankShare, device: torch.device, comm) -> RankWeights:
    """A whole in-memory model becomes this rank's, in place: moved to ``device``, then placed (its
    other ranks' parts are dropped; T = 1 keeps it whole)."""
    drop_mtp_modules(model)
    full_shapes = full_shapes_of(model)
    model.to(device)
    shards = place(model, share, comm)
    stack_rank_experts(model, device)
    return RankWeights(model, shards, full_shapes)


def load(config: ModelConfig, source: WeightSource, share: RankShare, dtype: torch.dtype, device: torch.device,
         comm, also: dict[str, list[Target]] | None = None) -> RankWeights:
    """This rank's weights from a source: a storage-less model placed for the rank, storage for its
    own tensors only, then each filled with its part of the full tensor (parts no tensor holds are
    never read). ``also``: more tensors to fill in the same pass (full name -> whole targets: the
    drafting MTP module on rank 0)."""
    from splash_rollout.models.model import MLAForCausalLM
    from splash_rollout.models.mtp import is_mtp_name

    config = config.replace(num_mtp_layers=0)  # see drop_mtp_modules
    model = MLAForCausalLM.skeleton(config, dtype)
    full_shapes = full_shapes_of(model)
    placed = place(model, share, comm)
    stack_rank_experts(model, device)
    shards = materialize_rank(model, placed, device)
    also = also or {}
    shapes = {**{n: s for n, (s, _) in full_shapes.items()}, **{n: tuple(t[0].tensor.shape) for n, t in also.items()}}
    load_into(source, {**rank_targets(model, shards), **also}, shapes, config.tie_word_embeddings,
              unread=is_mtp_name)
    return RankWeights(model, shards, full_shapes)
