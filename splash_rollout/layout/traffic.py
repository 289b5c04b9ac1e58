"""What one layer of one step sends between ranks in each layout: the engine's collectives, as data.

Each collective an executor runs (engine/executors/) is stated here once: what it is for (``tag``:
``step/attn``, the attention block; ``step/mlp``, the feed-forward block), its kind, and the bytes
each rank sends and receives, as a function of the step's shape. Bytes follow
``distributed.collectives.Comm``'s convention (payload only): a rank sends each byte it contributes
once per peer that needs it and receives each byte a peer contributes to it; an all-reduce counts as
a ring, ``2 (T - 1) / T`` of the buffer each way. The executors run exactly these collectives (a test
runs every layout's steps and compares the bytes each one moved with this account), and the cost
model prices them for this package's engine (``scheduling/cost_model.py``), so an executor that
changes its traffic changes its price in the same place.

Per layer, on T ranks, N query rows (``owned_rows[r]`` of them belonging to requests rank r owns):

* TP: all-reduce of the partial attention output [N, hidden];
* DP-attention: nothing in the attention block; its rows stay with their owners;
* DOP: all-to-all of each row's head slice of the absorbed query to the row's owner
  [N, H/T, kv_lora + rope], all-to-all of the attention output back [N, H/T, kv_lora], all-reduce
  of the partial o_proj output [N, hidden];
* CP: all-gather of every rank's partial attention output [N, H, kv_lora] and its log-sum-exp
  [N, H]; on layers with an indexer, all-gather of the local indexer scores (every rank's pages,
  ``score_columns`` wide);
* the feed-forward block, sharded weights: an all-reduce of [N, hidden] where every rank carries
  every row (TP, DOP, CP); under DP-attention an all-gather of the owners' rows and a reduce-scatter
  of the partial sums back to them. Replicated weights: nothing under DP-attention, elsewhere one
  all-gather of the rows each rank computed (N split evenly, the larger blocks first).

Pure: no torch. Element widths are parameters (``ElementBytes``): the engine's float32 rows, its
float64 partial sums under reproducible numerics, the cost model's bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.layout.arith import even_split
from splash_rollout.layout.layouts import Layout

TAGS = ("step/attn", "step/mlp")
"""The compute group's per-step tags (``step/control``, the control message, is host data apart)."""


@dataclass(frozen=True)
class ElementBytes:
    """Bytes of one element of each kind of tensor a step's collectives carry."""

    activation: int
    """Hidden rows between blocks (the model dtype)."""
    partial: int
    """Partial sums that an all-reduce or reduce-scatter completes (float64 under reproducible numerics)."""
    attention: int
    """Query heads and attention outputs (DOP's exchanges)."""
    cp_partial: int
    """CP's partial attention outputs, merged after the gather (kept at the partial-sum width)."""
    lse: int = 4
    """CP's log-sum-exp of each partial output (float32; float64 under reproducible numerics)."""
    score: int = 4
    """CP's indexer scores (float32)."""


@dataclass(frozen=True)
class StepShape:
    """What a step's traffic depends on."""

    owned_rows: tuple[int, ...]
    """[T] query rows of the requests each rank owns (every row belongs to one owner)."""
    hidden: int
    heads: int
    """All attention heads H (a head-sharded rank holds H / T)."""
    kv_lora: int
    qk_rope: int
    widths: ElementBytes
    feed_forward: str = "sharded"
    """``sharded`` or ``replicated`` (engine/parallel_mlp.py)."""
    score_columns: int = 0
    """CP, layers with an indexer: columns of the scores each rank contributes (its pages' positions
    up to the step's widest history: ``ceil(S / (T * page_size)) * page_size``)."""

    @property
    def world_size(self) -> int:
        return len(self.owned_rows)

    @property
    def rows(self) -> int:
        return sum(self.owned_rows)


@dataclass(frozen=True)
class Collective:
    """One collective of one layer: what it is for, its kind, and each rank's bytes."""

    tag: str
    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``."""
    sent: tuple[int, ...]
    """[T] bytes each rank sends."""
    received: tuple[int, ...]
    """[T] bytes each rank receives."""
    indexer_layers_only: bool = False
    """Run only on layers that have a DSA indexer."""

    @property
    def busiest_bytes(self) -> int:
        """The most bytes one rank sends or receives: what the collective's time is priced on."""
        return max(max(self.sent), max(self.received))


def all_reduce(tag: str, t: int, buffer_bytes: int) -> Collective:
    """A ring all-reduce of a ``buffer_bytes`` tensor on every rank."""
    ring = buffer_bytes * 2 * (t - 1) // t
    return Collective(tag, "all_reduce", (ring,) * t, (ring,) * t)


def all_gather(tag: str, rows: tuple[int, ...], row_bytes: int, indexer_layers_only: bool = False) -> Collective:
    """Every rank's ``rows[r]`` rows to every rank."""
    t, total = len(rows), sum(rows)
    return Collective(tag, "all_gather", tuple(n * row_bytes * (t - 1) for n in rows),
                      tuple((total - n) * row_bytes for n in rows), indexer_layers_only)


def reduce_scatter(tag: str, rows: tuple[int, ...], row_bytes: int) -> Collective:
    """Partial sums of every row on every rank; rank r keeps the sum of its ``rows[r]``."""
    t, total = len(rows), sum(rows)
    return Collective(tag, "reduce_scatter", tuple((total - n) * row_bytes for n in rows),
                      tuple(n * row_bytes * (t - 1) for n in rows))


def to_owners(tag: str, rows: tuple[int, ...], row_bytes: int) -> Collective:
    """All-to-all: every rank sends each owner its rows (a slice of each); rank r receives its
    ``rows[r]`` from every peer."""
    t, total = len(rows), sum(rows)
    return Collective(tag, "all_to_all", tuple((total - n) * row_bytes for n in rows),
                      tuple((t - 1) * n * row_bytes for n in rows))


def from_owners(tag: str, rows: tuple[int, ...], row_bytes: int) -> Collective:
    """All-to-all, the way back: each owner sends every peer its ``rows[r]`` rows."""
    back = to_owners(tag, rows, row_bytes)
    return Collective(tag, "all_to_all", back.received, back.sent)


def feed_forward(shape: StepShape, rows_stay_with_owners: bool) -> list[Collective]:
    """The feed-forward block's collectives (per layer)."""
    t, w, row = shape.world_size, shape.widths, shape.hidden
    if shape.feed_forward == "replicated":  # each row computed whole on one rank: its owner, or an even share
        if rows_stay_with_owners:
            return []
        return [all_gather("step/mlp", tuple(even_split(shape.rows, t)), row * w.activation)]
    if rows_stay_with_owners:
        return [all_gather("step/mlp", shape.owned_rows, row * w.activation),
                reduce_scatter("step/mlp", shape.owned_rows, row * w.partial)]
    return [all_reduce("step/mlp", t, shape.rows * row * w.partial)]


def tp(shape: StepShape) -> list[Collective]:
    """TP: H/T heads of every row here, then the layer's partial output all-reduced."""
    return [all_reduce("step/attn", shape.world_size, shape.rows * shape.hidden * shape.widths.partial)] \
        + feed_forward(shape, rows_stay_with_owners=False)


def dp(shape: StepShape) -> list[Collective]:
    """DP-attention: every head of its own rows on the owner; rows stay there between blocks."""
    return feed_forward(shape, rows_stay_with_owners=True)


def dop(shape: StepShape) -> list[Collective]:
    """DOP: head slices of every row to its owner and back, then the partial o_proj all-reduced."""
    w = shape.widths
    local_heads = shape.heads // shape.world_size
    return [to_owners("step/attn", shape.owned_rows, local_heads * (shape.kv_lora + shape.qk_rope) * w.attention),
            from_owners("step/attn", shape.owned_rows, local_heads * shape.kv_lora * w.attention),
            all_reduce("step/attn", shape.world_size, shape.rows * shape.hidden * w.partial)] \
        + feed_forward(shape, rows_stay_with_owners=False)


def cp(shape: StepShape) -> list[Collective]:
    """CP: every rank's partial attention over the positions it stores, gathered and merged."""
    w, n = shape.widths, shape.rows
    every = (n,) * shape.world_size
    return [all_gather("step/attn", every, shape.heads * shape.kv_lora * w.cp_partial),
            all_gather("step/attn", every, shape.heads * w.lse),
            all_gather("step/attn", every, shape.score_columns * w.score, indexer_layers_only=True)] \
        + feed_forward(shape, rows_stay_with_owners=False)


BY_LAYOUT = {Layout.TP: tp, Layout.DP: dp, Layout.DOP: dop, Layout.CP: cp}
"""Each layout's per-layer account: what its executor (engine/executors/) runs, read by
``Engine.step_traffic`` and by the cost model. On one rank every collective moves 0 bytes."""


def step_totals(per_layer: list[Collective], layers: int, indexer_layers: int) -> dict[tuple[str, str], list[int]]:
    """Bytes of a whole step by (tag, op): [sent per rank..., received per rank...] of ``per_layer``
    summed over its ``layers`` decoder layers, ``indexer_layers`` of which have a DSA indexer."""
    out: dict[tuple[str, str], list[int]] = {}
    for c in per_layer:
        t = len(c.sent)
        times = indexer_layers if c.indexer_layers_only else layers
        acc = out.setdefault((c.tag, c.op), [0] * (2 * t))
        for r in range(t):
            acc[r] += c.sent[r] * times
            acc[t + r] += c.received[r] * times
    return out
