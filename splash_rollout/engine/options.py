"""The engine's options, each group beside the engine that reads it, and the one object it is built from.

``EngineConfig`` (rollout/config.py) holds one of each group, as the user wrote it: ``parallel``
(ranks, layout, device), ``memory`` (KV pool, admission, prefix sharing), ``batching`` (per-step
and per-call bounds), ``compute`` (kernels, numerics, speculation, threads, graphs) and ``outputs``
(progress, routing); each field is documented and checked here, once. ``EngineSettings`` is what an
engine is built from: those groups as given, plus what ``rollout.build.engine_settings`` derives from
them for one model on T ranks (the starting layout, KV pages per layout, the resolved draft source).
The engine reads a knob from its group (``settings.compute.speculation``); adding an option is a
field here and the line that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splash_rollout.config_fields import is_int
from splash_rollout.engine.layout_driver import DriverConfig
from splash_rollout.layout.layouts import Layout
from splash_rollout.models.numerics import NUMERICS_MODES

SPECULATION_MODES = ("off", "always", "auto")
DRAFT_SOURCES = ("auto", "mtp", "ngram")
"""``compute.draft``: what a user may ask for (``auto`` resolves to one of the others)."""
DRAFT_KINDS = ("ngram", "mtp")
"""``EngineSettings.draft``: where an engine's drafts come from."""


@dataclass(frozen=True)
class ParallelOptions:
    """The ranks and the attention layout over them."""

    world_size: int = 1
    """Ranks in the attention group (T). More than 1: spawned here, or the caller's torchrun ranks."""
    layout: str = "tp"
    """Attention layout over the T ranks: tp, dp (DP-attention), dop, cp, or auto (the scheduler's
    policy picks and switches, starting in DP-attention); meaningless at world_size 1."""
    device: str = "cpu"
    """Where every engine tensor lives (weights, KV pool, block tables, batch, logits): ``cpu``,
    ``cuda`` (rank r on GPU r mod the device count) or an explicit ``cuda:N``."""
    rank_timeout_s: float = 60.0
    """Longest wait for any other rank (collectives, step plans); a dead rank becomes an error."""
    switch_schedule: dict | None = None
    """{step: layout}: switch at these engine steps (tests and benchmarks; the scheduler decides otherwise)."""
    feed_forward: str = "sharded"
    """Where the MLP / MoE weights live over the ranks, in every layout. ``sharded``: experts spread
    and dense blocks split over the ranks (each holds 1/T); every layer's block ends in a collective.
    ``replicated``: every rank holds the whole block (T times the bytes; only for models whose
    feed-forward weights fit every rank) and runs it on its own rows: no per-layer collective under
    DP-attention, one all-gather elsewhere. Not with ``outputs.return_routing`` (a rank's router then
    sees only its rows)."""
    decode_window: int = 8
    """DP-attention: most steps the ranks decode their own requests between two exchanges of the
    sampled tokens (1: they meet after every step). A window opens only where nothing but a stop can
    change the batch inside it (every request decoding, none queued, no drafts, no switch due, no
    length cap and no page shortage before its end); a request that stops inside one is cut at its
    stop token when it closes, so the tokens are those of meeting every step. Longer windows wait less
    for the slowest rank; the layout policy and ``abort`` are heard at window ends."""

    def __post_init__(self) -> None:
        from splash_rollout.layout import FEED_FORWARD_PLACEMENTS, Layout

        if not is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size!r}")
        if str(self.layout).lower() != "auto":
            Layout.parse(self.layout, "layout")
        if self.feed_forward not in FEED_FORWARD_PLACEMENTS:
            raise ValueError(f"feed_forward: expected one of {FEED_FORWARD_PLACEMENTS}, got {self.feed_forward!r}")
        if not is_int(self.decode_window) or self.decode_window < 1:
            raise ValueError(f"decode_window: expected a positive integer, got {self.decode_window!r}")
        if not self.rank_timeout_s > 0:
            raise ValueError(f"rank_timeout_s: expected > 0 seconds, got {self.rank_timeout_s}")
        for step, name in (self.switch_schedule or {}).items():
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"switch_schedule: steps must be non-negative integers, got {step!r}")
            Layout.parse(name, f"switch_schedule[{step}]")

    @property
    def auto(self) -> bool:
        """Whether the scheduler's policy chooses the layout."""
        return str(self.layout).lower() == "auto"


@dataclass(frozen=True)
class MemoryOptions:
    """The KV pool and how requests are admitted into it."""

    memory_budget_gib: float = 0.25
    """KV-pool memory per rank; ignored when ``num_pages`` is given."""
    num_pages: int | None = None
    """Exact KV-pool size in pages (overrides ``memory_budget_gib``)."""
    page_size: int = 16
    """Tokens per KV page."""
    admission: str = "optimistic"
    """``optimistic``: admit on each request's expected growth (a ratio of its remaining cap that decays
    while memory holds, scheduling/admission.py) and, when a step runs out of KV pages, retract the
    youngest requests (tokens kept; they re-prefill later and continue exactly). ``worst_case``:
    every request holds its whole cap (prompt + max_new_tokens) from admission; never retracts."""
    init_growth_ratio: float = 0.7
    """``optimistic`` admission: the share of each running request's remaining cap (max_new_tokens
    left) it expects the request to still write, at first; the share decays toward
    ``min_growth_ratio`` while memory holds and climbs back after a retraction. Lower admits more
    requests at once and retracts more often."""
    min_growth_ratio: float = 0.1
    """The floor of that expected share."""
    prefix_sharing: bool = True
    """The samples of a prompt (``n`` > 1) share its KV pages and prefill it once."""
    prefix_cache: bool = True
    """A finished request's full KV pages stay cached, so a later request that starts with the same
    tokens (an agent's next turn, a prompt seen before, a shared system prompt) prefills only what is
    new. Cached pages count as free: they are evicted, least recently used first, before any request
    is retracted. A weight update, a layout switch and sleep empty the cache. Needs ``prefix_sharing``;
    off with ``outputs.return_routing``. Counted per call as ``rollout/cached_tokens``."""

    def __post_init__(self) -> None:
        from splash_rollout.scheduling.admission import ADMISSION_MODES

        if self.page_size < 1:
            raise ValueError(f"page_size: expected >= 1, got {self.page_size}")
        if self.num_pages is None and not self.memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib: expected > 0, got {self.memory_budget_gib}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages: expected >= 1, got {self.num_pages}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission: expected one of {ADMISSION_MODES}, got {self.admission!r}")
        for name in ("init_growth_ratio", "min_growth_ratio"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a number in [0, 1], got {getattr(self, name)!r}")
        if not 0.0 <= self.min_growth_ratio <= self.init_growth_ratio <= 1.0:
            raise ValueError(f"init_growth_ratio: expected 0 <= min_growth_ratio <= init_growth_ratio <= 1, got "
                             f"min_growth_ratio={self.min_growth_ratio}, init_growth_ratio={self.init_growth_ratio}")
        for name in ("prefix_sharing", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")

    @property
    def admission_settings(self):
        """What the request scheduler's admission reads (scheduling/admission.py)."""
        from splash_rollout.scheduling.admission import AdmissionSettings

        return AdmissionSettings(mode=self.admission, init_ratio=self.init_growth_ratio,
                                 min_ratio=self.min_growth_ratio)


@dataclass(frozen=True)
class BatchingOptions:
    """How much one step and one call may hold."""

    max_num_batched_tokens: int = 512
    """Per-step query-row budget shared by decode rows and prefill chunks."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_queued_requests: int = 65536
    """Most samples one ``generate`` call may ask for (prompts x n): a call beyond it is refused up
    front, naming the bound, instead of building millions of requests."""
    poll_steps: int = 1
    """Requests submitted one by one (``RolloutEngine.submit``, the server): the serving loop runs the
    ranks this many steps between two looks at what arrived, was aborted and progressed. 1: a request
    joins at the next step and tokens stream step by step; more: less per-poll overhead on spawned ranks."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: expected >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {self.max_num_seqs}")
        if not is_int(self.poll_steps) or self.poll_steps < 1:
            raise ValueError(f"poll_steps: expected an integer >= 1, got {self.poll_steps!r}")
        if not is_int(self.max_queued_requests) or self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests: expected an integer >= 1, got {self.max_queued_requests!r}")


@dataclass(frozen=True)
class ComputeOptions:
    """How a step computes: kernels, numerics, speculation, threads."""

    attention_backend: str = "cpu"
    """``cpu`` (default): a native kernel (built with the system C++ compiler at first use, cached)
    that reads the paged KV pool in place, for float32 / bfloat16 pools on the CPU; other pools,
    or a machine without a compiler, take ``torch``. ``torch``: one layer for every request of a
    step in a few batched tensor ops; ``torch_ref``: one exact attention per request, the reference
    the others are tested against; ``triton``: split-KV Triton kernels (the ``gpu`` extra; CUDA);
    ``flashmla``: FlashMLA's dense decode for whole-history decode rows, the rest through ``triton``
    (``sgl-flash-mla``, SM90, page_size 64, bfloat16)."""
    numerics: str = "fast"
    """``fast``: float32 kernels as torch picks them. ``reproducible``: matmuls and reductions
    accumulate in float64 and round once, so a token's logprob no longer depends on batch size,
    padding, chunking or layout, and equals a trainer's (same process, same mode) to float32
    rounding; costs float64 matmul speed. Process-wide while the engine lives (models/numerics.py),
    set on every rank and in the calling process."""
    speculation: str = "auto"
    """Speculative decoding without a draft model (engine/drafter.py): ``always`` drafts the next
    tokens of every decoding request from its prompt's other samples (live, and earlier calls') and
    its own text, and verifies them in one step, keeping exactly the tokens decoding one at a time
    gives (every row sampled with its own seeded draw); ``auto`` (default) drafts on the steps where
    the cost model, with the measured acceptance, predicts more tokens per second (as the batch
    drains) and, while requests wait, where drafted steps measured faster; ``off`` decodes one token
    a step. The tokens are the same in all three."""
    draft: str = "auto"
    """Where drafts come from under ``speculation`` ``always`` / ``auto``: ``mtp``, the model's own
    multi-token-prediction module (DeepSeek-V3 / GLM-5 ``num_nextn_predict_layers``), run on rank 0
    after each drafting step and chained for the draft's later tokens, each drafted token the
    sampler's draw from the module with the verifier's own uniform (engine/mtp_drafter.py); refused
    for a model without one. ``ngram``: text the samples have seen (engine/drafter.py). ``auto``
    (default): ``mtp`` where the model has the module and a pass of it is at most 1/8 of a step (a
    decoder of 8 layers or more: DeepSeek-V3, GLM-5), else ``ngram`` (glm5-nano's 4 layers: measured
    slower with the module). The engine holds the module (rank 0, whole) only when it drafts with it."""
    max_draft_tokens: int | None = None
    """Most drafted tokens a request verifies in one step (vLLM's ``num_speculative_tokens``); the
    drafters' own caps and the ``auto`` gate's choices stay under it. None: the draft source's own
    (8 for n-grams, 4 for the MTP module, whose every drafted token costs a pass)."""
    cpu_share: bool = True
    """On CPU with one rank: each step uses only the cores other processes leave free (read from
    /proc every 0.5 s), at most the threads the engine was built with, at least one. A trainer or
    another job on the same cores then slows the engine by its fair share instead of stalling every
    OpenMP barrier (measured 2 cores, one 2-thread job beside: 7-21 tokens/s with 2 threads kept,
    89-125 with 1). Ranks of a multi-rank engine keep their thread count: they compute replicated
    values that must agree bit for bit. False: always the threads set at build time."""
    flush_denormal: bool = True
    """On CPU, flush float denormals to zero (process-wide ``torch.set_flush_denormal``). Softmax tails
    of long histories are denormal and make CPU matmuls ~7x slower; the numerical effect is below
    1e-38. Set False to leave the process flag alone."""
    retain_heap: bool = True
    """On CPU with glibc malloc, keep freed large blocks in the process's heap (mmap threshold 32 MiB,
    trim threshold 1 GiB, top pad 256 MiB; process-wide) so each step's large temporaries reuse warm
    pages instead of fresh ones the kernel faults in and zeroes: 1.10-1.22x tokens/s measured on a
    wide batch. The heap then holds up to 1 GiB it no longer uses. Set False to leave malloc alone."""
    pack_weights: bool = True
    """On CPU with fast numerics: float32 products of more than 16 rows (decode steps, prefill chunks,
    experts' shares of them) go to oneDNN over a copy of the weight packed once for it, instead of MKL
    re-packing it every call: 2-3x per product, the float32 wide call's products 5.8 s instead of 7.2
    measured. Costs one more copy of every float32 weight. Process-wide (models/packed_linear.py).
    Set False to keep torch's path and no copies."""

    cuda_graphs: str = "auto"
    """Decode steps replayed from CUDA graphs, one per (layout, requests bucket, key width), captured at
    engine start (engine/cuda_graphs.py): a decode step is padded to the next bucket of requests and a
    power of two of pages and launches the whole decoder at once instead of hundreds of kernels.
    One rank and TP take them (DP-attention, DOP and CP steps run eagerly: their collectives follow
    the owners). ``auto`` (default): on a CUDA device, each graph's first replay checked against the
    eager step (a mismatch turns graphs off, with one warning); ``on``: unchecked, refused off CUDA;
    ``off``: eager. The graphs' memory comes out of ``memory.memory_budget_gib``. Nothing changes on
    the CPU."""

    decode_buckets: tuple[int, ...] = ()
    """Request counts a plain decode step is padded up to (its key width padded to a power of two of
    pages), so every step of a bucket runs the same shapes -- what CUDA graphs replay. Empty (default):
    no padding where graphs are off (on the CPU padded rows would cost compute), the graphs' own
    buckets where they are on."""

    def __post_init__(self) -> None:
        from splash_rollout.engine.attention import available_backends
        from splash_rollout.engine.cuda_graphs import CUDA_GRAPH_MODES

        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs: expected one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")
        if self.attention_backend not in available_backends():
            raise ValueError(f"attention_backend: expected one of {available_backends()}, "
                             f"got {self.attention_backend!r}")
        if self.numerics not in NUMERICS_MODES:
            raise ValueError(f"numerics: expected one of {NUMERICS_MODES}, got {self.numerics!r}")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation: expected one of {SPECULATION_MODES}, got {self.speculation!r}")
        if self.max_draft_tokens is not None and (not is_int(self.max_draft_tokens) or self.max_draft_tokens < 1):
            raise ValueError(f"max_draft_tokens: expected None or an integer >= 1, got {self.max_draft_tokens!r}")
        if self.draft not in DRAFT_SOURCES:
            raise ValueError(f"draft: expected one of {DRAFT_SOURCES}, got {self.draft!r}")
        buckets = tuple(self.decode_buckets) if isinstance(self.decode_buckets, (list, tuple)) else None
        if buckets is None or not all(is_int(b) and b >= 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"decode_buckets: expected increasing positive integers, got {self.decode_buckets!r}")
        object.__setattr__(self, "decode_buckets", buckets)  # a YAML list becomes the tuple
        for name in ("cpu_share", "flush_denormal", "retain_heap", "pack_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class OutputOptions:
    """What a call hands back beyond the samples, and what it shows while it runs."""

    progress: bool | None = None
    """A progress bar on ``generate`` (requests done / total, layout, tokens/s), drawn on stderr by the
    driver (rank 0). None: only when stderr is a terminal (logs, CI and tests stay clean); True /
    False: always / never."""
    return_routing: bool = False
    """Every sample carries ``routing``: the experts each of its tokens was routed to in every MoE
    layer ([positions run, MoE layers, top_k] int16), so a trainer can replay them
    (``models.moe.routing_context``). Off by default: it costs that array per sample."""

    def __post_init__(self) -> None:
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"progress: expected None, True or False, got {self.progress!r}")
        if not isinstance(self.return_routing, bool):
            raise TypeError(f"return_routing: expected a bool, got {type(self.return_routing).__name__}")


@dataclass(frozen=True)
class EngineSettings:
    """One engine's options: the groups it reads, as configured, and what the builder derived from them
    for this model on these ranks. ``rollout.build.engine_settings`` makes it; nothing else does."""

    parallel: ParallelOptions
    memory: MemoryOptions
    batching: BatchingOptions
    compute: ComputeOptions
    outputs: OutputOptions
    driver: DriverConfig
    layout: Layout
    """The layout the engine starts in (``parallel.layout``; DP-attention under ``auto``)."""
    num_pages: int
    """KV pages per rank in ``layout`` (ignored where ``pages_by_layout`` names the layout)."""
    dtype: torch.dtype
    """Weights and KV pool (``model.dtype``)."""
    max_model_len: int
    """Longest history a request may reach: the widest key axis a graph is captured at."""
    device: str
    """Where this rank's tensors live (``parallel.device``; a bare ``cuda`` resolved to this rank's GPU)."""
    draft: str | None = None
    """Where drafts come from (``DRAFT_KINDS``; ``compute.draft`` resolved for this model); None with
    ``compute.speculation="off"``."""
    pages_by_layout: dict[Layout, int] | None = None
    """KV pages per rank in each layout under one memory budget (memory follows the layout on a
    switch); None keeps ``num_pages`` in every layout."""
    switch_schedule: dict[int, Layout] = field(default_factory=dict)
    """Engine step -> layout to switch to at that step (``parallel.switch_schedule``, parsed)."""
    reachable_layouts: tuple[Layout, ...] = ()
    """Layouts the engine may enter on its own (``auto`` on T > 1): a request that any of their pools
    can hold is accepted. Empty: only the current layout's pools count. Every rank's replica uses
    this, so they all accept the same requests."""
    graph_reserve_bytes: int = 0
    """What the budget set aside for CUDA graphs (``cuda_graphs.graph_reserve_bytes``), checked at capture."""

    def __post_init__(self) -> None:
        if (self.draft is None) != (self.compute.speculation == "off") or self.draft not in (None, *DRAFT_KINDS):
            raise ValueError(f"draft: expected one of {DRAFT_KINDS} with speculation, None without; got "
                             f"{self.draft!r} with compute.speculation={self.compute.speculation!r}")

    @property
    def initial_pages(self) -> int:
        return self.pages_by_layout[self.layout] if self.pages_by_layout else self.num_pages
