"""PrefixCache: the KV pages of finished requests, kept for the next request that starts the same way.

Why: an agent's next turn is its previous turn's whole context plus a reply; a GRPO prompt comes back
in a later step; a server sees the same system prompt in every request. Without a cache a request's
pages are freed when it ends, and the next one prefills its whole history again. Here a finished
request's full, computed pages stay, and a request whose tokens start with a cached chain of pages
takes them by reference and computes only the rest.

The structure is a trie of full pages: a node is one logical page -- its ``page_size`` tokens, the
physical page on each rank that stores it, its parent (the pages before it). A request matches a
chain by walking its own tokens page by page, so a match is exact (tokens are compared, never
hashed). Under a layout whose histories live on an owner rank (DP-attention, DOP) each owner has its
own trie and a request that takes a chain takes its owner; TP (every rank) and CP (pages spread by
position) have one.

The cache holds one reference on each of its pages (``PageManager.hold`` / ``drop``); a page that
only the cache holds is *reclaimable*: the page managers count it as free for admission, and an
allocation that finds too few free pages evicts cached pages, least recently used leaves first,
before anything is retracted. Every decision is a function of the requests and of a logical clock
(the scheduler's step), so every rank's replica keeps the same cache. What replaces the KV's meaning
or its placement empties it: a weight update, a layout switch, sleep.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from splash_rollout.engine.page_manager import PageManager
from splash_rollout.engine.request import Request
from splash_rollout.layout.layouts import Ownership

NOT_HERE = -1


@dataclass(eq=False)
class CachedPage:
    """One full logical page of a cached history."""

    tokens: tuple[int, ...]
    root: int
    """The trie it belongs to (its owner rank, -1 where the layout has no owners)."""
    depth: int
    """Its logical page index (0: the first page of a history)."""
    pages: list[int]
    """[T] the physical page on each rank, NOT_HERE where that rank does not store it."""
    parent: "CachedPage | None"
    children: dict[tuple[int, ...], "CachedPage"] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    """The cache of one scheduler replica over its ranks' page managers."""

    def __init__(self, managers: list[PageManager], page_size: int, ownership: Ownership) -> None:
        self.managers, self.page_size, self.ownership = managers, page_size, ownership
        self._roots: dict[int, dict[tuple[int, ...], CachedPage]] = {}
        """Per owner rank (-1 where the layout has no owners): the first pages of cached histories."""
        self._lru: OrderedDict[CachedPage, None] = OrderedDict()
        """Every node, least recently used first."""
        self.clock = 0
        """The logical time of uses (advanced by the scheduler, once a step)."""
        self.evicted_pages = 0
        for rank, m in enumerate(managers):
            m.reclaim = lambda pages, rank=rank: self._reclaim(rank, pages)

    # ---- lookup ---------------------------------------------------------------------------------
    def _root_key(self, owner: int) -> int:
        return owner if self.ownership is Ownership.OWNER else -1

    @property
    def num_pages(self) -> int:
        """Cached logical pages."""
        return len(self._lru)

    def match(self, tokens: list[int], max_pages: int, owners: list[int]) -> tuple[int | None, list[CachedPage]]:
        """The longest cached chain of full pages that ``tokens`` starts with, at most ``max_pages``
        long, among the ``owners`` a request may take (in that order on ties): (its owner, the chain).
        (None, []) when nothing matches."""
        best_owner, best = None, []
        ps = self.page_size
        for owner in (owners if self.ownership is Ownership.OWNER else owners[:1]):
            level, chain = self._roots.get(self._root_key(owner), {}), []
            for i in range(max_pages):
                node = level.get(tuple(tokens[i * ps:(i + 1) * ps]))
                if node is None:
                    break
                chain.append(node)
                level = node.children
            if len(chain) > len(best):
                best_owner, best = owner, chain
        return best_owner, best

    def reclaimable_in(self, chain: list[CachedPage]) -> list[int]:
        """[T] pages of ``chain`` only the cache holds on each rank: free to admission until a request
        takes them."""
        out = [0] * len(self.managers)
        for node in chain:
            for rank, page in enumerate(node.pages):
                if page != NOT_HERE and self.managers[rank].refs(page) == 1:
                    out[rank] += 1
        return out

    def take(self, request: Request, chain: list[CachedPage]) -> None:
        """``request`` (admitted, empty tables) starts with ``chain``'s pages, one reference each."""
        for node in chain:
            for rank, page in enumerate(node.pages):
                if page != NOT_HERE:
                    self.managers[rank].share([page])
                request.rank_pages[rank].append(page)
            self._touch(node)
        request.num_shared_pages = len(chain)

    # ---- insertion ------------------------------------------------------------------------------
    def insert(self, request: Request) -> None:
        """Keep ``request``'s full computed pages (before its own references are dropped). Where the
        cache already holds a page of the same tokens computed by another request, the cached copy
        stays and nothing after it is inserted: below a node, only the pages of the request table it
        came from. So a request that holds a cached page holds every cached page before it (its own
        table's), and a page only the cache holds always becomes evictable once its descendants are
        -- what lets admission count such pages as free."""
        ps = self.page_size
        full = min(request.num_computed_tokens, request.num_tokens) // ps
        full = min(full, request.num_logical_pages)
        if not full:
            return
        tokens = request.token_ids
        root = self._root_key(request.owner)
        level, parent = self._roots.setdefault(root, {}), None
        for i in range(full):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            node = level.get(key)
            pages = [table[i] for table in request.rank_pages]
            if node is None:
                node = level[key] = CachedPage(key, root, i, pages, parent)
                for rank, page in enumerate(pages):
                    if page != NOT_HERE:
                        self.managers[rank].hold(page)
            elif node.pages != pages:  # another request's copy of these tokens
                self._touch(node)
                return
            self._touch(node)
            parent, level = node, node.children

    def _touch(self, node: CachedPage) -> None:
        node.last_used = self.clock
        self._lru[node] = None
        self._lru.move_to_end(node)

    # ---- eviction ---------------------------------------------------------------------------------
    def _evictable(self, node: CachedPage) -> bool:
        """A leaf whose pages only the cache holds."""
        return not node.children and all(page == NOT_HERE or self.managers[rank].refs(page) == 1
                                         for rank, page in enumerate(node.pages))

    def _evict(self, node: CachedPage) -> None:
        siblings = node.parent.children if node.parent is not None else self._roots[node.root]
        del siblings[node.tokens]
        del self._lru[node]
        for rank, page in enumerate(node.pages):
            if page != NOT_HERE:
                self.managers[rank].drop(page)
                self.evicted_pages += 1

    def _reclaim(self, rank: int, pages: int) -> None:
        """Evict least recently used leaves until ``pages`` more are free on ``rank``: leaves with a page
        there first; where none is evictable, any evictable leaf -- a page here whose node still has
        children stored on other ranks (CP spreads a history's pages over the ranks) becomes a leaf
        once they go. Every page only the cache holds is reachable so: a request that holds a page
        holds every page before it."""
        manager = self.managers[rank]
        target = manager.num_free + pages
        while manager.num_free < target:
            leaves = [n for n in self._lru if self._evictable(n)]
            victim = next((n for n in leaves if n.pages[rank] != NOT_HERE), leaves[0] if leaves else None)
            if victim is None:
                return
            self._evict(victim)

    def clear(self) -> None:
        """Drop every cached page (the cache's references; pages a live request holds stay with it)."""
        for node in list(self._lru):
            for rank, page in enumerate(node.pages):
                if page != NOT_HERE:
                    self.managers[rank].drop(page)
        self._roots.clear()
        self._lru.clear()
