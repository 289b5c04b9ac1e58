"""KVPlacement: which rank stores which page of every history, and the page managers of all ranks.

Every rank holds a replica of this for the whole group, updated by the same deterministic
decisions (so page ids never cross the network): one ``PageManager`` per rank and, per request, a
page table per rank; each rank copies its own row of those tables into its device ``BlockTable``. Logical page i of a request lives, under the current layout's
ownership, on every rank (TP), on the request's owner (DP-attention, DOP) or on rank i mod T (CP);
a rank's table holds -1 for logical pages it does not store. Owners are chosen at admission by
projected KV growth (prompt + max_new_tokens) and never change.

Admission reserves a request's worst-case pages on every rank that will store them, so a running
request never stalls for memory; tables grow one page at a time against that reservation.
"""
from __future__ import annotations

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


class KVPlacement:
    def __init__(self, pages_per_rank: list[int], page_size: int, layout: Layout) -> None:
        if not pages_per_rank or min(pages_per_rank) < 1:
            raise ValueError(f"num_pages: every rank needs at least one page, got {pages_per_rank}")
        self.managers = [PageManager(n, page_size) for n in pages_per_rank]
        self.page_size = page_size
        self.layout = layout
        self.projected_tokens = [0] * len(pages_per_rank)
        """Per owner: worst-case tokens of the live requests it owns (owner balancing)."""

    @property
    def world_size(self) -> int:
        return len(self.managers)

    @property
    def ownership(self) -> Ownership:
        return self.layout.ownership

    # ---- admission --------------------------------------------------------------------------
    def choose_owner(self, request: Request) -> int:
        """The rank whose projected KV (live requests' prompt + max_new_tokens) is smallest."""
        return min(range(self.world_size), key=lambda r: (self.projected_tokens[r], r))

    def _need(self, request: Request, owner: int) -> list[int]:
        return pages_on_each_rank(request.pages_needed(self.page_size), self.ownership, owner, self.world_size)

    def can_ever_admit(self, request: Request, layout: Layout | None = None,
                       pages_per_rank: list[int] | None = None) -> bool:
        """Whether the request fits an empty group (else it can never run in this layout); by default
        in the current layout and pools, or in ``layout`` with ``pages_per_rank`` pages per rank."""
        if layout is None:
            need = self._need(request, self.choose_owner(request))
            return all(n <= m.num_pages for n, m in zip(need, self.managers))
        pages = pages_per_rank or [m.num_pages for m in self.managers]
        need = pages_on_each_rank(request.pages_needed(self.page_size), layout.ownership, 0, self.world_size)
        return all(n <= p for n, p in zip(need, pages))  # owner 0: every rank's pool is alike when empty

    def can_admit(self, request: Request) -> bool:
        need = self._need(request, self.choose_owner(request))
        return all(m.can_reserve(n) for n, m in zip(need, self.managers))

    def admit(self, request: Request) -> None:
        """Pick the owner and reserve the worst-case pages on every storing rank."""
        owner = self.choose_owner(request)
        need = self._need(request, owner)
        if not all(m.can_reserve(n) for n, m in zip(need, self.managers)):
            raise RuntimeError(f"admit: request {request.request_id} does not fit (needs {need} pages per rank)")
        for n, m in zip(need, self.managers):
            m.reserve(n)
        request.owner = owner
        request.reserved_per_rank = need
        request.rank_pages = [[] for _ in range(self.world_size)]
        self.projected_tokens[owner] += request.max_total_tokens

    # ---- growth and release -----------------------------------------------------------------
    def grow(self, request: Request, num_tokens: int) -> None:
        """Give the request pages for positions [0, num_tokens), out of its reservation."""
        have = len(request.rank_pages[0]) if request.rank_pages else 0
        want = num_pages_for(num_tokens, self.page_size)
        for logical in range(have, want):
            where = rank_of_page(logical, self.ownership, request.owner, self.world_size)
            for rank, table in enumerate(request.rank_pages):
                if where in (-1, rank):
                    if request.reserved_per_rank[rank] < 1:
                        raise RuntimeError(f"request {request.request_id} outgrew its reservation on rank {rank}")
                    table.append(self.managers[rank].allocate(1, reserved=True)[0])
                    request.reserved_per_rank[rank] -= 1
                else:
                    table.append(NOT_HERE)

    def release(self, request: Request) -> None:
        """Free the request's pages and what is left of its reservations."""
        for rank, table in enumerate(request.rank_pages):
            self.managers[rank].free([p for p in table if p != NOT_HERE])
        for rank, n in enumerate(request.reserved_per_rank):
            self.managers[rank].release(n)
        if request.rank_pages:
            self.projected_tokens[request.owner] -= request.max_total_tokens
        request.rank_pages = []
        request.reserved_per_rank = [0] * self.world_size

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> list[int]:
        return [m.num_used for m in self.managers]

    @property
    def pages_reserved(self) -> list[int]:
        return [m.num_reserved for m in self.managers]
