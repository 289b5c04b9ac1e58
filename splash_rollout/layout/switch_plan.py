"""SwitchPlan: the manifest of one directed layout switch (paper §2 "Switches", §4.1 step 1).

A switch is a difference between what each rank holds and what the destination needs. For each
layer and each state (switchable projection weights, KV) it is one primitive:

* weights: sharded→sharded or replicated→replicated ``keep``; replicated→sharded ``discard``;
  sharded→replicated ``all_gather`` (each rank receives the (1 - 1/T) of the layer it lacks).
* KV: same ownership ``keep``; leaving ``every`` ``discard`` (each rank already holds what an owner or
  a position split needs); into ``every`` ``all_gather``; between ``owner`` and ``positions``
  ``all_to_all``.

Byte counts per rank follow from the batch: each request's stored tokens, its owner, and the page
size (under CP page p of a history lives on rank p mod T). Indexer keys move with the layer's KV.
Twelve directed switches exist among the four layouts; ``all_switches`` builds them all.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from itertools import permutations

import numpy as np

from splash_rollout.layout.arith import ceil_div
from splash_rollout.layout.bytes import AttentionBytes
from splash_rollout.layout.fit import round_robin_owners
from splash_rollout.layout.layouts import ALL_LAYOUTS, Layout, Ownership, Placement


class Primitive(str, enum.Enum):
    KEEP = "keep"
    DISCARD = "discard"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"

    @property
    def moves_bytes(self) -> bool:
        return self in (Primitive.ALL_GATHER, Primitive.ALL_TO_ALL)


def weight_primitive(src: Layout, dst: Layout) -> Primitive:
    if src.placement is dst.placement:
        return Primitive.KEEP
    return Primitive.DISCARD if dst.placement is Placement.SHARDED else Primitive.ALL_GATHER


def kv_primitive(src: Layout, dst: Layout) -> Primitive:
    a, b = src.ownership, dst.ownership
    if a is b:
        return Primitive.KEEP
    if a is Ownership.EVERY:
        return Primitive.DISCARD
    if b is Ownership.EVERY:
        return Primitive.ALL_GATHER
    return Primitive.ALL_TO_ALL


@dataclass(frozen=True)
class BatchKV:
    """The KV a switch must preserve: stored tokens and owner of each running request."""

    lengths: tuple[int, ...]
    """Tokens stored per request (its history so far)."""
    owners: tuple[int, ...]
    """Owner rank per request (used by DP-attention and DOP; never changed by a switch)."""
    page_size: int = 64

    @classmethod
    def uniform(cls, batch: int, context: int, world_size: int, page_size: int = 64) -> "BatchKV":
        owners = round_robin_owners(batch, world_size)
        return cls(tuple([context] * batch), tuple(int(o) for o in owners), page_size)

    def tokens_on_rank(self, ownership: Ownership, world_size: int) -> np.ndarray:
        """Tokens of each request stored on each rank under an ownership. [T, B] int64."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        t, b = world_size, lengths.size
        if ownership is Ownership.EVERY:
            return np.broadcast_to(lengths, (t, b)).copy()
        if ownership is Ownership.OWNER:
            out = np.zeros((t, b), dtype=np.int64)
            out[np.asarray(self.owners, dtype=np.int64), np.arange(b)] = lengths
            return out
        return cp_tokens_on_rank(lengths, world_size, self.page_size)


def cp_tokens_on_rank(lengths: np.ndarray, world_size: int, page_size: int) -> np.ndarray:
    """Tokens of each history on each rank when page p lives on rank p mod T. [T, B] int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    full, rem = lengths // page_size, lengths % page_size
    ranks = np.arange(world_size, dtype=np.int64)[:, None]
    full_pages_here = full // world_size + (ranks < full % world_size)
    partial_here = np.where((full % world_size) == ranks, rem, 0)
    return full_pages_here * page_size + partial_here


def _kv_moves(src: Ownership, dst: Ownership, batch: BatchKV, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens each rank sends and receives for one layer's KV. ([T], [T]) int64."""
    t = world_size
    prim = kv_primitive(_any_layout(src), _any_layout(dst))
    if not prim.moves_bytes:
        return np.zeros(t, np.int64), np.zeros(t, np.int64)
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    if prim is Primitive.ALL_GATHER:
        # The source pieces are disjoint: each stored token goes to the T - 1 ranks that lack it,
        # and each rank receives every token it does not hold.
        have = batch.tokens_on_rank(src, t).sum(axis=1)
        return have * (t - 1), lengths.sum() - have
    # all-to-all between the owner split and the position split: the CP piece of request i on
    # rank r crosses the network iff r is not i's owner.
    owners = np.asarray(batch.owners, dtype=np.int64)
    cp_piece = cp_tokens_on_rank(lengths, t, batch.page_size)  # [T, B]
    cp_piece[owners, np.arange(lengths.size)] = 0
    cp_side = cp_piece.sum(axis=1)  # [T] tokens a rank holds (or will hold) for other owners
    owner_side = np.zeros(t, np.int64)
    np.add.at(owner_side, owners, cp_piece.sum(axis=0))  # [T] tokens an owner exchanges
    if src is Ownership.OWNER:  # owners send, position holders receive
        return owner_side, cp_side
    return cp_side, owner_side


def _any_layout(ownership: Ownership) -> Layout:
    return next(l for l in ALL_LAYOUTS if l.ownership is ownership)


@dataclass(frozen=True)
class StateMove:
    """One state of one layer: the primitive and the bytes each rank sends and receives."""

    primitive: Primitive
    bytes_sent: tuple[int, ...]
    """[T] bytes sent by each rank."""
    bytes_received: tuple[int, ...]
    """[T] bytes received by each rank."""


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    weights: StateMove
    kv: StateMove

    @property
    def bytes_received(self) -> tuple[int, ...]:
        return tuple(a + b for a, b in zip(self.weights.bytes_received, self.kv.bytes_received))


@dataclass(frozen=True)
class SwitchPlan:
    """Per-layer manifest of a directed switch for one batch."""

    src: Layout
    dst: Layout
    world_size: int
    layers: tuple[LayerPlan, ...]

    @property
    def weights_primitive(self) -> Primitive:
        return weight_primitive(self.src, self.dst)

    @property
    def kv_primitive(self) -> Primitive:
        return kv_primitive(self.src, self.dst)

    @property
    def network(self) -> bool:
        """Whether any state crosses the network (a discard or keep does not)."""
        return self.weights_primitive.moves_bytes or self.kv_primitive.moves_bytes

    def _total(self, pick) -> tuple[int, ...]:
        return tuple(int(sum(pick(l)[r] for l in self.layers)) for r in range(self.world_size))

    @property
    def bytes_sent_per_rank(self) -> tuple[int, ...]:
        return self._total(lambda l: tuple(a + b for a, b in zip(l.weights.bytes_sent, l.kv.bytes_sent)))

    @property
    def bytes_received_per_rank(self) -> tuple[int, ...]:
        return self._total(lambda l: l.bytes_received)

    @property
    def weight_bytes_received_per_rank(self) -> tuple[int, ...]:
        return self._total(lambda l: l.weights.bytes_received)

    @property
    def kv_bytes_received_per_rank(self) -> tuple[int, ...]:
        return self._total(lambda l: l.kv.bytes_received)

    @property
    def max_bytes_received(self) -> int:
        """The most any rank receives over the whole switch."""
        return max(self.bytes_received_per_rank, default=0)

    @property
    def layer_buffer_bytes(self) -> int:
        """Eq. 5 headroom: one layer's incoming buffers on the busiest rank."""
        return max((max(l.bytes_received) for l in self.layers), default=0)

    @classmethod
    def build(cls, src: Layout | str, dst: Layout | str, sizes: AttentionBytes, batch: BatchKV,
              world_size: int) -> "SwitchPlan":
        src, dst = Layout.parse(src, "src"), Layout.parse(dst, "dst")
        if src is dst:
            raise ValueError(f"dst: a switch needs two different layouts, got {src} -> {dst}")
        if len(batch.lengths) != len(batch.owners):
            raise ValueError(f"owners: expected {len(batch.lengths)} entries, got {len(batch.owners)}")
        t = world_size
        wprim = weight_primitive(src, dst)
        kv_sent_tok, kv_recv_tok = _kv_moves(src.ownership, dst.ownership, batch, t)
        zeros = (0,) * t
        layers = []
        for i in range(sizes.num_layers):
            w = sizes.switchable_weight_bytes[i]
            if wprim is Primitive.ALL_GATHER:
                shard = ceil_div(w, t)
                weights = StateMove(wprim, (shard * (t - 1),) * t, (w - shard,) * t)
            else:
                weights = StateMove(wprim, zeros, zeros)
            per_tok = sizes.kv_bytes_per_token[i]
            kv = StateMove(kv_primitive(src, dst), tuple(int(x) * per_tok for x in kv_sent_tok),
                           tuple(int(x) * per_tok for x in kv_recv_tok))
            layers.append(LayerPlan(i, weights, kv))
        return cls(src, dst, t, tuple(layers))

    def to_dict(self) -> dict:
        return {
            "src": self.src.value,
            "dst": self.dst.value,
            "weights": self.weights_primitive.value,
            "kv": self.kv_primitive.value,
            "bytes_per_rank": self.max_bytes_received,
            "network": self.network,
            "bytes_per_rank_per_layer": max((max(l.bytes_received) for l in self.layers), default=0),
            "weight_bytes_per_rank": max(self.weight_bytes_received_per_rank, default=0),
            "kv_bytes_per_rank": max(self.kv_bytes_received_per_rank, default=0),
            "bytes_sent_per_rank": list(self.bytes_sent_per_rank),
            "bytes_received_per_rank": list(self.bytes_received_per_rank),
            "layer_buffer_bytes": self.layer_buffer_bytes,
        }


def all_switches(sizes: AttentionBytes, batch: BatchKV, world_size: int) -> list[SwitchPlan]:
    """The 12 directed switches among TP, CP, DP-attention and DOP."""
    return [SwitchPlan.build(a, b, sizes, batch, world_size) for a, b in permutations(ALL_LAYOUTS, 2)]
