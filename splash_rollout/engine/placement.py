"""KVPlacement: which rank stores which page of every history, and the page managers of all ranks.

Every rank holds a replica of this for the whole group, updated by the same deterministic
decisions (so page ids never cross the network): one ``PageManager`` per rank and, per request, a
page table per rank; each rank copies its own row of those tables into its device ``BlockTable``.
Logical page i of a request lives, under the current layout's ownership, on every rank (TP), on
the request's owner (DP-attention, DOP) or on rank i mod T (CP); a rank's table holds -1 for
logical pages it does not store. Owners are chosen at admission (balancing the owners' projected
KV) and never change.

The samples of one prompt share its KV: their tables point at the same physical pages for the
prompt's full pages (``attach`` / ``fork`` add references), and a sample that writes into a page
another sample also needs gets its own copy first (``fork``: copy-on-write of the prompt's partly
filled last page). Pages are taken as tokens arrive (``grow``); how much growth to expect, and
whether a request is admitted at all, is the scheduler's decision (``scheduling/admission.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.engine.page_manager import PageManager, num_pages_for
from splash_rollout.engine.request import Request
from splash_rollout.layout.layouts import Layout, Ownership

NOT_HERE = -1
"""Page-table entry of a logical page that this rank does not store."""


def pages_on_each_rank(num_logical_pages: int, ownership: Ownership, owner: int, world_size: int) -> list[int]:
    """How many of a request's first ``num_logical_pages`` pages each rank stores. [T]."""
    t = world_size
    if ownership is Ownership.EVERY:
        return [num_logical_pages] * t
    if ownership is Ownership.OWNER:
        return [num_logical_pages if r == owner else 0 for r in range(t)]
    return [num_logical_pages // t + (1 if r < num_logical_pages % t else 0) for r in range(t)]


def rank_of_page(logical_page: int, ownership: Ownership, owner: int, world_size: int) -> int:
    """The rank storing a logical page; -1 means every rank."""
    if ownership is Ownership.EVERY:
        return -1
    if ownership is Ownership.OWNER:
        return owner
    return logical_page % world_size


@dataclass(frozen=True)
class PageCopy:
    """Copy-on-write of one page on one rank: the whole page (every layer) from ``src`` to ``dst``."""

    rank: int
    src: int
    dst: int


class KVPlacement:
    def __init__(self, pages_per_rank: list[int], page_size: int, layout: Layout) -> None:
        if not pages_per_rank or min(pages_per_rank) < 1:
            raise ValueError(f"num_pages: every rank needs at least one page, got {pages_per_rank}")
        self.managers = [PageManager(n, page_size) for n in pages_per_rank]
        self.page_size = page_size
        self.layout = layout
        self.projected_tokens = [0] * len(pages_per_rank)
        """Per owner: prompt + max_new_tokens of the live requests it owns (owner balancing)."""

    @property
    def world_size(self) -> int:
        return len(self.managers)

    @property
    def ownership(self) -> Ownership:
        return self.layout.ownership

    def on_each_rank(self, num_logical_pages: int, owner: int, layout: Layout | None = None) -> list[int]:
        """[T] pages each rank stores of a history's first ``num_logical_pages`` pages (in ``layout``,
        by default the current one)."""
        ownership = (layout or self.layout).ownership
        return pages_on_each_rank(num_logical_pages, ownership, owner, self.world_size)

    def pages_between(self, first: int, last: int, owner: int, layout: Layout | None = None) -> list[int]:
        """[T] pages each rank stores of a history's logical pages [first, last) (0 where last <= first)."""
        if last <= first:
            return [0] * self.world_size
        return [b - a for a, b in zip(self.on_each_rank(first, owner, layout), self.on_each_rank(last, owner, layout))]

    def owners_by_balance(self) -> list[int]:
        """Ranks in the order a new owner is chosen: least projected KV first."""
        return sorted(range(self.world_size), key=lambda r: (self.projected_tokens[r], r))

    def can_ever_admit(self, request: Request, layout: Layout | None = None,
                       pages_per_rank: list[int] | None = None) -> bool:
        """Whether the request's whole cap fits an empty group (else it can never run there); by
        default in the current layout and pools, or in ``layout`` with ``pages_per_rank`` pages.
        The one page-level rule for it: submission (``Engine.can_ever_admit``, over every layout
        the policy may enter) and a switch's deferral (engine/kv_switch.py, for the queue) ask here."""
        layout = layout or self.layout
        pages = pages_per_rank or [m.num_pages for m in self.managers]
        need = pages_on_each_rank(request.pages_needed(self.page_size), layout.ownership, 0, self.world_size)
        return all(n <= p for n, p in zip(need, pages))  # owner 0: every rank's pool is alike when empty

    # ---- admission ----------------------------------------------------------------------------
    def start(self, request: Request, owner: int, prefix: Request | None = None, num_shared_pages: int = 0) -> None:
        """Give an admitted request its owner and empty tables, or the first ``num_shared_pages``
        pages of ``prefix`` (a live sample of the same prompt, whose KV there is computed)."""
        request.owner = owner
        request.rank_pages = [[] for _ in range(self.world_size)]
        request.num_shared_pages = 0
        if prefix is not None and num_shared_pages:
            self._share(prefix, request, num_shared_pages)
        self.projected_tokens[owner] += request.max_total_tokens

    def _share(self, src: Request, dst: Request, num_pages: int) -> None:
        for rank, table in enumerate(src.rank_pages):
            head = table[:num_pages]
            self.managers[rank].share([p for p in head if p != NOT_HERE])
            dst.rank_pages[rank] = list(head)
        dst.num_shared_pages = num_pages

    def fork(self, leader: Request, follower: Request, num_tokens: int) -> list[PageCopy]:
        """``follower`` (admitted with ``leader``, no pages yet) takes the leader's first ``num_tokens``
        tokens of KV: the full pages shared, the partly filled last page copied into a page of its
        own on every rank storing it. The copies must run after the leader's KV there is written."""
        full, partial = divmod(num_tokens, self.page_size)
        self._share(leader, follower, full)
        copies = []
        if partial:
            where = rank_of_page(full, self.ownership, follower.owner, self.world_size)
            for rank, table in enumerate(follower.rank_pages):
                if where in (-1, rank):
                    page = self.managers[rank].allocate(1)[0]
                    copies.append(PageCopy(rank, leader.rank_pages[rank][full], page))
                    table.append(page)
                else:
                    table.append(NOT_HERE)
        return copies

    # ---- growth and release -----------------------------------------------------------------
    def growth(self, request: Request, num_tokens: int) -> list[int]:
        """[T] new pages each rank must hand out for the request to hold positions [0, num_tokens)."""
        return self.pages_between(request.num_logical_pages, num_pages_for(num_tokens, self.page_size), request.owner)

    def grow(self, request: Request, num_tokens: int) -> None:
        """Give the request pages for positions [0, num_tokens) (the scheduler checked they are free)."""
        have = request.num_logical_pages
        for logical in range(have, num_pages_for(num_tokens, self.page_size)):
            where = rank_of_page(logical, self.ownership, request.owner, self.world_size)
            for rank, table in enumerate(request.rank_pages):
                table.append(self.managers[rank].allocate(1)[0] if where in (-1, rank) else NOT_HERE)

    def release(self, request: Request) -> None:
        """Drop the request's references to its pages (shared ones stay while another sample holds them)."""
        for rank, table in enumerate(request.rank_pages):
            self.managers[rank].free([p for p in table if p != NOT_HERE])
        if request.rank_pages:
            self.projected_tokens[request.owner] -= request.max_total_tokens
        request.rank_pages = []
        request.num_shared_pages = 0

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> list[int]:
        """[T] distinct pages requests hold on each rank (a shared page counts once; pages only the
        prefix cache holds are not in use: they go as soon as a request needs them)."""
        return [m.num_used - m.num_reclaimable for m in self.managers]

    @property
    def pages_free(self) -> list[int]:
        """[T] pages an allocation can get on each rank: free, or held by the prefix cache alone."""
        return [m.num_available for m in self.managers]

    @property
    def pages_cached(self) -> list[int]:
        """[T] pages the prefix cache holds on each rank (some also held by running requests)."""
        return [m.num_held for m in self.managers]
