"""Re-placing every running history for a layout switch (driver side, paper §4.1 steps 1 and 4).

At a step boundary the driver computes, for each running request, its page tables under the
destination ownership: a rank that already stores a logical page keeps that very page (a discard
keeps what the destination needs in place), every other destination copy gets a freshly allocated
page — all before the step runs, so no layer ever waits for memory; the running requests' expected
growth must fit next to them. If any rank lacks the pages, the switch is deferred with the reason
and nothing changes. Pages only the source needed are freed after the step.

``KVMove`` records are broadcast to the ranks, which turn them into per-layer token transfers.
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.engine.placement import NOT_HERE, KVPlacement, rank_of_page
from splash_rollout.engine.request import Request
from splash_rollout.layout.layouts import Layout


@dataclass(frozen=True)
class KVMove:
    """One request's history across a switch."""

    request_id: int
    owner: int
    num_tokens: int
    """Tokens with KV in the pool when the switch starts."""
    src_pages: list[list[int]]
    """[T][L] page tables before the switch (-1: not stored there)."""
    dst_pages: list[list[int]]
    """[T][L] page tables after the switch."""


@dataclass
class PlacementSwitch:
    """What the driver committed for a switch: the moves, and the source pages to free after the step."""

    src: Layout
    dst: Layout
    moves: list[KVMove]
    retire: list[list[int]]
    """[T] page references to drop once the switching step is done (a shared page once per sample)."""
    capacity: list[int]
    """[T] pages per rank in the destination layout (the page managers shrink to it after the step)."""


def switch_placement(placement: KVPlacement, running: list[Request], dst: Layout,
                     capacity: list[int] | None = None, waiting: list[Request] = (),
                     promised: list[int] | None = None) -> PlacementSwitch | str:
    """Re-place every running history under ``dst``; a string (the reason) when it cannot be done.

    ``capacity``: pages per rank in ``dst`` (memory follows the layout: fewer when ``dst`` replicates
    the projections). Pages at or above a shrinking capacity are relocated below it. ``promised``:
    [T] pages the running requests are expected to still take in ``dst`` (the scheduler's
    estimate); they must fit next to the re-placed histories. A page several samples share (their
    prompt) is placed, moved and freed once: every sample's table points at the same destination page."""
    t = placement.world_size
    src = placement.layout
    cap_src = [m.num_pages for m in placement.managers]
    cap = list(capacity) if capacity is not None else cap_src
    for req in waiting:  # never switch into a layout that could not admit what is queued
        if not placement.can_ever_admit(req, dst, cap):
            return (f"request {req.request_id} ({req.max_total_tokens} tokens) could never be admitted in {dst} "
                    f"({min(cap)} pages per rank)")
    new_pages = [0] * t
    planned: set[tuple[int, tuple[int, ...]]] = set()
    for req in running:
        for p in range(req.num_logical_pages):
            key = tuple(table[p] for table in req.rank_pages)
            where = rank_of_page(p, dst.ownership, req.owner, t)
            for r in range(t):
                if where in (-1, r) and not 0 <= key[r] < cap[r] and (r, key) not in planned:
                    planned.add((r, key))
                    new_pages[r] += 1
    promised = promised or [0] * t
    for r, m in enumerate(placement.managers):
        free = m.num_free + cap[r] - cap_src[r] if cap[r] >= cap_src[r] else m.free_below(cap[r])
        if new_pages[r] + promised[r] > free:
            return (f"rank {r} needs {new_pages[r]} new KV pages plus {promised[r]} expected growth in "
                    f"{dst} ({cap[r]} pages there), but has {free} free while the source pages are still held")
    for r, m in enumerate(placement.managers):
        if cap[r] >= cap_src[r]:
            m.resize(cap[r])  # sharded projections give memory back: more pages at once
        else:
            m.retire_above(cap[r])  # replicated ones take it: nothing new above the line
    moves, retire = [], [[] for _ in range(t)]
    placed: dict[tuple[int, tuple[int, ...]], int] = {}
    for req in running:
        src_pages = [list(x) for x in req.rank_pages]
        dst_pages = [[NOT_HERE] * req.num_logical_pages for _ in range(t)]
        for p in range(req.num_logical_pages):
            key = tuple(table[p] for table in src_pages)
            where = rank_of_page(p, dst.ownership, req.owner, t)
            for r in range(t):
                if where not in (-1, r):
                    continue
                if 0 <= key[r] < cap[r]:
                    dst_pages[r][p] = key[r]  # kept in place
                elif (r, key) in placed:
                    dst_pages[r][p] = placed[(r, key)]  # another sample already placed this page
                    placement.managers[r].share([dst_pages[r][p]])
                else:
                    dst_pages[r][p] = placed[(r, key)] = placement.managers[r].allocate(1)[0]
        for r in range(t):
            retire[r] += [p for p, q in zip(src_pages[r], dst_pages[r]) if p != NOT_HERE and p != q]
        req.rank_pages = dst_pages
        moves.append(KVMove(req.request_id, req.owner, req.num_computed_tokens, src_pages,
                            [list(x) for x in dst_pages]))
    placement.layout = dst
    return PlacementSwitch(src, dst, moves, retire, cap)


def retire_source_pages(placement: KVPlacement, switch: PlacementSwitch) -> None:
    """After the switching step: free the pages only the source layout needed, and shrink the page
    managers to the destination's capacity."""
    for r, pages in enumerate(switch.retire):
        placement.managers[r].free(pages)  # one reference per entry: a shared page goes with its last
        if switch.capacity[r] < placement.managers[r].num_pages:
            placement.managers[r].resize(switch.capacity[r])
