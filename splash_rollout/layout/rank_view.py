"""RankView: one rank's share of a layout — the local sizes layers read instead of the world size.

Layers never read the world size. An executor asks its rank view which heads it projects
(``head_slice``), whether it stores a request's history (``stores_request`` / ``page_rank``) and
how many ranks share the work. A live switch swaps the view; the layers stay the same.
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.layout.arith import div_even
from splash_rollout.layout.layouts import Layout, Ownership


@dataclass(frozen=True)
class RankView:
    layout: Layout
    rank: int
    world_size: int
    num_heads: int
    """H, all heads of the model."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.world_size}, got {self.rank}")
        div_even(self.num_heads, self.world_size)

    @property
    def local_heads(self) -> int:
        """Heads whose projections this rank holds: H/T when sharded, H when replicated."""
        return self.num_heads // self.world_size if self.layout.shards_projections else self.num_heads

    @property
    def heads_per_rank(self) -> int:
        """H/T: the head slice each rank owns in the sharded placement."""
        return self.num_heads // self.world_size

    @property
    def head_slice(self) -> slice:
        """The heads this rank projects (global head indices)."""
        if not self.layout.shards_projections:
            return slice(0, self.num_heads)
        h = self.heads_per_rank
        return slice(self.rank * h, (self.rank + 1) * h)

    def head_slice_of(self, rank: int) -> slice:
        """The sharded head slice of any rank (DOP's all-to-all addresses head slices)."""
        h = self.heads_per_rank
        return slice(rank * h, (rank + 1) * h)

    def page_rank(self, logical_page: int, owner: int) -> int:
        """The rank that stores a request's logical page under this layout (-1: every rank)."""
        ownership = self.layout.ownership
        if ownership is Ownership.EVERY:
            return -1
        if ownership is Ownership.OWNER:
            return owner
        return logical_page % self.world_size

    def stores_page(self, logical_page: int, owner: int) -> bool:
        where = self.page_rank(logical_page, owner)
        return where == -1 or where == self.rank

    def holds_whole(self, num_pages: int, owner: int) -> bool:
        """Whether this rank stores every page of a request's history of ``num_pages`` pages."""
        ownership = self.layout.ownership
        if ownership is Ownership.EVERY:
            return True
        if ownership is Ownership.OWNER:
            return owner == self.rank
        return all(self.page_rank(p, owner) == self.rank for p in range(min(num_pages, self.world_size + 1)))

    def stores_request(self, owner: int) -> bool:
        """Whether this rank holds (part of) the history of a request with this owner."""
        return self.layout.ownership is not Ownership.OWNER or owner == self.rank
