"""PageManager: which physical KV pages are free, and how many page tables hold each of the rest.

The pool (``kv_pool.py``) owns the memory; this class owns only page ids. A page is handed out with
one reference (``allocate``); the samples of a prompt that share its KV add one each (``share``);
``free`` drops one reference and the page returns to the free list when none is left. Admission
does not reserve pages here: the scheduler decides how much growth to expect
(``scheduling/admission.py``) and takes pages as tokens arrive.

The prefix cache (``prefix_cache.py``) holds pages too (``hold`` / ``drop``: one reference each). A
page only the cache holds is *reclaimable*: ``num_available`` counts it with the free ones, and an
``allocate`` that finds too few free pages asks the cache to evict (``reclaim``) first.
"""
from __future__ import annotations


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class PageManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: expected >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size: expected >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first, which keeps test failures readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}
        """page id -> page tables holding it (>= 1 while allocated)."""
        self._held: set[int] = set()
        """Pages the prefix cache holds a reference on."""
        self.num_reclaimable = 0
        """Pages only the prefix cache holds (evicted on demand)."""
        self.reclaim = None
        """(pages) -> None: evict cached pages until that many more are free (set by the prefix cache)."""

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Distinct pages allocated (a shared page counts once)."""
        return len(self._refs)

    @property
    def num_references(self) -> int:
        """Page-table entries pointing at allocated pages (a page shared by n samples counts n)."""
        return sum(self._refs.values())

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: the free ones and those only the prefix cache holds."""
        return len(self._free) + self.num_reclaimable

    @property
    def num_held(self) -> int:
        """Pages the prefix cache holds (some also held by running requests)."""
        return len(self._held)

    # ---- pages -------------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` page ids, one reference each (evicting cached pages first where too few are free)."""
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if not 0 <= n <= len(self._free):
            raise RuntimeError(f"allocate: {n} pages requested, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more page table holds each of ``pages``."""
        for p in pages:
            if p not in self._refs:
                raise RuntimeError(f"share: page {p} is not allocated")
            if self._refs[p] == 1 and p in self._held:
                self.num_reclaimable -= 1
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``; a page nobody holds any more is free again."""
        for p in pages:
            n = self._refs.get(p)
            if n is None:
                raise RuntimeError(f"free: page {p} is not allocated")
            if n == 1:
                del self._refs[p]
                self._free.append(p)
            else:
                self._refs[p] = n - 1
                if n == 2 and p in self._held:
                    self.num_reclaimable += 1

    def hold(self, page: int) -> None:
        """The prefix cache takes a reference on ``page``."""
        if page in self._held:
            raise RuntimeError(f"hold: page {page} is already cached")
        self.share([page])
        self._held.add(page)

    def drop(self, page: int) -> None:
        """The prefix cache lets ``page`` go."""
        if self._refs[page] == 1:
            self.num_reclaimable -= 1
        self._held.discard(page)
        self.free([page])

    # ---- capacity (memory follows the layout) ---------------------------------------------------
    def free_below(self, limit: int) -> int:
        """Free pages with ids < limit."""
        return sum(1 for p in self._free if p < limit)

    def retire_above(self, limit: int) -> None:
        """Stop handing out free pages with ids >= limit (they leave when ``resize`` shrinks)."""
        self._free = [p for p in self._free if p < limit]

    def resize(self, num_pages: int) -> None:
        """Set the page count: growing adds free ids at the top; shrinking needs every id >= num_pages
        free (those ids are dropped)."""
        if num_pages < 1:
            raise ValueError(f"num_pages: expected >= 1, got {num_pages}")
        busy = [p for p in self._refs if p >= num_pages]
        if busy:
            raise RuntimeError(f"resize: pages {sorted(busy)[:5]} >= {num_pages} are still in use")
        self._free = sorted(set(range(num_pages)) - set(self._refs), reverse=True)
        self.num_pages = num_pages
