"""Decode steps replayed from CUDA graphs: one graph per (layout, requests bucket, key width), captured at start.

Why: on one H200 an eager decode step of this engine took 9-18 ms where the bytes it reads bound it
at ~0.5 ms -- hundreds of kernel launches and the host work between them, the GPU idle most of the
step. A CUDA graph launches the whole decoder at once. A graph replays fixed shapes and fixed
addresses, so a graphed step is a *padded* decode step (``ForwardBatch.padded_decode``: requests
padded to a bucket, keys to a power of two of pages, padded rows writing the pool's scratch slot)
whose inputs are copied into the graph's own tensors before each replay; the step has no host sync
(``engine/host_syncs.py`` counts them on any device). What the graph holds: the decoder from the
embedding to the last layer's output (``ModelRunner.hidden``); the LM head and the sampler run
after it, on the real rows only.

Which layouts: those whose padded step has the same shapes for every batch of a bucket and the
same host decisions (``AttentionExecutor.fixed_shapes``, every history whole on every rank): one
rank, and TP on T ranks (its collectives -- an all-reduce of [requests, hidden] per block -- are
NCCL calls captured into the graph; the bytes they move are counted once at capture and added to the
step's counters at every replay). DP-attention, DOP and CP steps run eagerly: their collectives are
sized by which rank owns which request. A switch replays the destination's graphs.

Graphs hold the addresses of the KV pool and the weights: anything that replaces those tensors (a
switch that resizes the pool, sleep and wake) invalidates every graph, and the next decode step of a
key captures it again. ``compute.cuda_graphs``: ``auto`` (default) captures on CUDA and checks the
first replay of each graph against the eager step -- a mismatch turns graphs off with one warning
and the step's eager result is used; ``on`` the same without the check, and refused off CUDA; ``off``
never. The memory the graphs keep (one pool shared by all of them, the largest captured first) is
measured (``memory_stats()["cuda_graphs"]``) against the reserve the engine took out of its budget
for them (``graph_reserve_bytes``).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from splash_rollout.engine.block_table import BlockTable
from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.config import ModelConfig

log = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ("auto", "on", "off")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
"""Requests per graphed decode step (a step pads up to the next one); the engine adds its
``max_num_seqs`` and drops larger ones."""
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
"""How far a first replay may be from the eager step (max |difference| over max |value|)."""


def decode_buckets(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets of an engine that runs at most ``max_num_seqs`` requests."""
    return tuple(sorted({b for b in buckets if b < max_num_seqs} | {max_num_seqs}))


def width_buckets(max_pages: int) -> tuple[int, ...]:
    """Key widths in pages a padded step takes (powers of two up to the longest history's)."""
    out, p = [], 1
    while p < max_pages:
        out.append(p)
        p *= 2
    return tuple(out) + (p,)


def graph_reserve_bytes(config: ModelConfig, max_requests: int, max_pages: int, page_size: int,
                        dtype: torch.dtype) -> int:
    """A bound on what the graphs keep: the activations of the largest bucket's decode step at the
    widest key axis (one shared pool holds every graph's), from the model's widths. Measured against
    the real figure at capture."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads_latent = config.num_heads * (config.kv_lora_rank + config.qk_rope_head_dim)
    per_row = (32 * config.hidden_size + 8 * heads_latent
               + 6 * config.num_experts_per_tok * config.moe_intermediate_size) * max(elem, 4)
    keys = max_pages * page_size
    if config.has_indexer:  # indexer scores, masks and the selection over the key axis
        per_row += keys * (4 * 3 + config.index_n_heads * 4)
    split_partials = config.num_heads * 16 * (config.kv_lora_rank + 1) * 4
    return max_requests * (per_row + split_partials)


@dataclass(frozen=True)
class GraphKey:
    layout: Layout
    requests: int
    pages: int


STATIC_INPUTS = ("input_ids", "positions", "out_slots", "block_table", "seq_lens", "row_seq")
"""The tensors of a padded decode batch the decoder reads: copied into a graph's own before a replay."""


class DecodeGraph:
    """One captured decoder: its input tensors (a padded batch it owns), the graph, its output."""

    def __init__(self, batch: ForwardBatch, replay: Callable[[], torch.Tensor],
                 counted: dict[tuple[str, str], tuple[int, int]]) -> None:
        self.batch, self._replay, self.counted = batch, replay, counted
        self.checked = False

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """The decoder's output [requests, hidden] for ``batch`` (padded to this graph's key)."""
        for name in STATIC_INPUTS:
            getattr(self.batch, name).copy_(getattr(batch, name), non_blocking=True)
        return self._replay()


class DecodeGraphs:
    """The engine's graphs: captured at start for the layouts that take them, replayed by ``hidden``."""

    def __init__(self, hidden: Callable[[ForwardBatch], torch.Tensor], block_table: BlockTable, pool, comm, control,
                 page_size: int, buckets: tuple[int, ...], max_pages: int, check: bool, reserve_bytes: int,
                 capture: str = "cuda") -> None:
        """hidden: the eager decoder (``ModelRunner.hidden``); comm / control: the step's and the host
        groups (bytes re-counted per replay; a first-replay check agreed by every rank); capture:
        ``cuda`` (CUDA graphs) or ``eager`` (the graph is the decoder run again on the graph's own
        inputs: the bookkeeping without CUDA, what the CPU tests drive)."""
        if capture not in ("cuda", "eager"):
            raise ValueError(f"capture: expected 'cuda' or 'eager', got {capture!r}")
        self.hidden_eager, self.block_table, self.pool = hidden, block_table, pool
        self.comm, self.control = comm, control
        self.page_size, self.buckets, self.widths = page_size, buckets, width_buckets(max_pages)
        self.check, self.reserve_bytes, self.capture = check, reserve_bytes, capture
        self.graphs: dict[GraphKey, DecodeGraph] = {}
        self.generation = pool.generation
        self.mempool = torch.cuda.graph_pool_handle() if capture == "cuda" else None
        self.disabled: str | None = None
        """Why graphs are off for good (a first replay that differed from the eager step)."""
        self.bytes = 0
        """Device memory the graphs keep (measured around the captures)."""
        self.replays = 0

    # ---- capture ------------------------------------------------------------------------------
    def capture_all(self, layout: Layout, graphable: bool) -> None:
        """Every (bucket, width) of ``layout``, largest first (smaller graphs reuse its memory)."""
        if not graphable or self.disabled:
            return
        for pages in reversed(self.widths):
            for requests in reversed(self.buckets):
                if self._capture(GraphKey(layout, requests, pages)) is None:
                    return
        log.info("cuda graphs: %d captured for %s, %.1f MiB kept (reserve %.1f MiB)", len(self.graphs),
                 layout.value, self.bytes / 2**20, self.reserve_bytes / 2**20)
        if self.bytes > self.reserve_bytes:
            warnings.warn(f"cuda graphs keep {self.bytes / 2**20:.1f} MiB, more than the {self.reserve_bytes / 2**20:.1f} "
                          f"MiB the engine reserved for them in its memory budget", stacklevel=2)

    def _capture(self, key: GraphKey) -> DecodeGraph | None:
        """The graph of ``key``, captured now; None when capturing failed (``check``: graphs turn off
        with one warning, the engine decodes eagerly; unchecked: the error is raised)."""
        rows = [self.block_table.empty_row] * key.requests  # every row padding: writes go to scratch
        self.block_table.rows([], 0, key.pages)  # the table is at least this wide
        batch = ForwardBatch.padded_decode([], [], [], self.block_table.slice(rows, key.pages), self.page_size,
                                           key.requests, [])
        try:
            graph = (DecodeGraph(batch, lambda: self._run(batch), {}) if self.capture == "eager"
                     else self._capture_cuda(batch))
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured: decode eagerly
            if not self.check:
                raise
            self._turn_off(f"capturing the graph for {key.requests} requests x {key.pages} pages in "
                           f"{key.layout.value} failed: {type(exc).__name__}: {exc}")
            return None
        self.graphs[key] = graph
        return graph

    def _turn_off(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()
        warnings.warn(f"cuda graphs turned off: {why}; decoding eagerly", stacklevel=3)

    def _capture_cuda(self, batch: ForwardBatch) -> DecodeGraph:
        before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: kernels compiled, the allocator settled
                self._run(batch)
        torch.cuda.current_stream().wait_stream(side)
        counter = self.comm.counter
        before_ops = {key: tuple(both) for key, both in counter.by_op.items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._run(batch)
        counted = {key: (both[0] - before_ops.get(key, (0, 0))[0], both[1] - before_ops.get(key, (0, 0))[1])
                   for key, both in counter.by_op.items() if tuple(both) != before_ops.get(key, (0, 0))}
        for (tag, op), (sent, received) in counted.items():  # a capture moves nothing: only replays do
            counter.add(tag, -sent, -received, op)
        torch.cuda.synchronize()
        self.bytes += max(0, torch.cuda.memory_reserved() - before)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return DecodeGraph(batch, replay, counted)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager decoder on a graph's own batch, computing everything it derives from its inputs
        (nothing kept from an earlier run: a graph must record those ops, a rerun must redo them)."""
        batch.scratch.clear()
        return self.hidden_eager(batch)

    # ---- replay -------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """The pool's or the weights' tensors were replaced: every graph is stale."""
        self.graphs.clear()
        self.generation = self.pool.generation

    def hidden(self, batch: ForwardBatch, layout: Layout) -> torch.Tensor | None:
        """The decoder's output for a padded decode step from its graph (captured now if it is not yet),
        or None: graphs are off, or the step is not padded."""
        if self.disabled or batch.num_real is None:
            return None
        if self.pool.generation != self.generation:
            self.invalidate()
        key = GraphKey(layout, batch.num_seqs, batch.block_table.shape[1])
        graph = self.graphs.get(key) or self._capture(key)
        if graph is None:
            return None
        out = graph.replay(batch)
        for (tag, op), (sent, received) in graph.counted.items():
            self.comm.counter.add(tag, sent, received, op)
        self.replays += 1
        if self.check and not graph.checked:
            graph.checked = True
            eager = self.hidden_eager(batch)
            real = batch.real_seqs
            scale = float(eager[:real].abs().max().clamp(min=1e-6)) if real else 1.0
            gap = float((out[:real].float() - eager[:real].float()).abs().max()) / scale if real else 0.0
            gap = max(self.control.gather_objects(gap))  # every rank takes the same decision
            if gap > TOLERANCE.get(eager.dtype, 1e-3):
                self._turn_off(f"the first replay of the graph for {key.requests} requests x {key.pages} pages in "
                               f"{key.layout.value} differs from the eager step by {gap:.3g} (relative)")
                return eager
        return out
