"""PageManager: which physical KV pages are free, and who holds reservations on the rest.

The pool (``kv_pool.py``) owns the memory; this class owns only page ids. Admission reserves a
request's worst-case page count up front (prompt + max_new_tokens), so a running request can never
run out of pages mid-decode; its page table still grows one page at a time as tokens arrive, drawn
against that reservation. Check-and-act pairs: ``can_allocate`` / ``allocate``,
``can_reserve`` / ``reserve``.
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
        self._in_use: set[int] = set()
        self._reserved = 0
        """Pages promised to admitted requests but not yet allocated."""

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._in_use)

    @property
    def num_reserved(self) -> int:
        return self._reserved

    @property
    def num_available(self) -> int:
        """Free pages nobody holds a reservation on."""
        return len(self._free) - self._reserved

    # ---- reservations (admission) ---------------------------------------------------------
    def can_reserve(self, n: int) -> bool:
        return 0 <= n <= self.num_available

    def reserve(self, n: int) -> None:
        if not self.can_reserve(n):
            raise RuntimeError(f"reserve: {n} pages requested, {self.num_available} available")
        self._reserved += n

    def release(self, n: int) -> None:
        """Give back an unused part of a reservation."""
        if not 0 <= n <= self._reserved:
            raise RuntimeError(f"release: {n} pages, only {self._reserved} reserved")
        self._reserved -= n

    # ---- pages -------------------------------------------------------------------------------
    def can_allocate(self, n: int, reserved: bool = False) -> bool:
        """Whether ``n`` pages can be handed out (from a reservation when ``reserved``)."""
        if n < 0:
            return False
        return n <= (min(self._reserved, len(self._free)) if reserved else self.num_available)

    def allocate(self, n: int, reserved: bool = False) -> list[int]:
        """Hand out ``n`` page ids; with ``reserved`` the pages come out of a reservation."""
        if not self.can_allocate(n, reserved):
            raise RuntimeError(f"allocate: {n} pages requested, {self.num_available} available "
                               f"({self._reserved} reserved)")
        pages = [self._free.pop() for _ in range(n)]
        self._in_use.update(pages)
        if reserved:
            self._reserved -= n
        return pages

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
        busy = [p for p in self._in_use if p >= num_pages]
        if busy:
            raise RuntimeError(f"resize: pages {sorted(busy)[:5]} >= {num_pages} are still in use")
        free = sorted(set(range(num_pages)) - self._in_use, reverse=True)
        if self._reserved > len(free):
            raise RuntimeError(f"resize: {self._reserved} pages reserved, only {len(free)} would be free")
        self._free, self.num_pages = free, num_pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._in_use:
                raise RuntimeError(f"free: page {p} is not allocated")
            self._in_use.remove(p)
            self._free.append(p)
