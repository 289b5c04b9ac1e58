"""t_ℓ(x; θ): stage-wise latency of one serving step in each attention layout (paper §4.2, Table 2).

A step runs N query rows of B requests (a prefill chunk of q_i rows, or one decode row) through
every decoder layer. Per layer the busiest rank's load follows the layout's two choices:

==========  =========  ===================  ==========================  ===============================
layout      weights    KV read / indexer    attention work              collectives per layer
==========  =========  ===================  ==========================  ===============================
TP          W_A / T    all B histories      H/T heads of every request  all-reduce [N, hidden]
CP          W_A        Σs / T positions     Σ work / T                   pass-Q: merge partials+LSE, top-k
                                                                         merge; pass-KV: gather histories;
                                                                         then gather output rows
DP-attn     W_A        busiest owner        all heads, own requests      all-gather output rows
DOP         W_A / T    busiest owner        all heads, own requests      q-latent all-gather, 2 variable
                                                                         all-to-alls, reduce-scatter after
                                                                         o_proj, gather of owner rows
==========  =========  ===================  ==========================  ===============================

Each stage costs ``max(flops / rate, weight_bytes / weight_bw + kv_bytes / kv_bw)`` (roofline) and
each collective ``latency + bytes / bandwidth`` on the busiest rank; stages add up, layers add up,
then a fixed per-layer and per-step overhead. The MLP / MoE part is the same in every layout (dense
TP, experts spread over ranks, all-reduce of [N, hidden]); it does not choose the layout but it sets
how much the attention differences matter.

DSA (DeepSeek-V3.2, GLM-5): a ``full`` layer's indexer scores every cached token for every row
(2·Hi·Di FLOP per pair, reading the indexer keys), and every layer attends over
``min(context, index_topk)`` tokens per row. The indexer weights are replicated and its keys live
with the KV, so TP runs the indexer of every request on every rank (no head split: the top-k must be
one set per row) — that redundancy, not attention itself, is what costs TP at long contexts.
CP runs whichever of its two exact algorithms is cheaper for the step (Yang et al. 2025): pass-Q
(every rank attends all rows over the positions it stores; partial outputs + LSE ``[N, H, kv_lora]``
are merged by row; the global top-k per row comes from exchanging local candidates or gathering the
indexer keys, per request the cheaper) suits decode; pass-KV (rows split over ranks end to end, each
rank gathers the stored latent and indexer keys of the requests in the step) suits long prefill
chunks of few requests.

Which algorithms are priced follows ``profile.engine``. ``ideal`` (the GPU presets) is the table
above with paged kernels that touch only causal or selected keys. ``torch_ref`` and ``cpu`` are this
package's engine, which a calibrated profile describes: attention scores the whole history as a
masked rectangle unless a DSA selection is sparse enough to gather (``REF_SPARSE_MIN_KEYS``); the
indexer scores the rectangle and every rank selects top-k from it; CP replicates the projections
of every row (variant ``replicated``). Its collectives are not restated here: they are the
executors' own account (``layout/traffic.py``, held to the bytes the engine moves by a test), priced
on the busiest rank's bytes at ``PRICED_WIDTHS``. Calibrated profiles also carry the costs no roofline sees: per request per
layer, per request per step, per score element, per expert call (``scheduling/fit.py`` fits them).

On the ``ideal`` engine DOP runs q_a / kv_a / indexer projections on the owner's rows only (the
replicated hidden rows are all there, but only the owner appends a request's KV), so its q latent
is all-gathered for the head-sharded q_b. Beyond the roofline a profile may carry per-layout fixed
costs (per prefill step, per request once its prefill completes, per prefill row) and per-stage
correction factors, all fitted to measured steps (``sim/paper.py`` fits them to published sweeps).

Units: seconds, bytes, FLOP. Activations are bf16 (2 bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from splash_rollout.layout import ALL_LAYOUTS, AttentionBytes, Layout, ceil_div, fits, traffic
from splash_rollout.layout.bytes import kv_vector_bytes, matrix_bytes
from splash_rollout.models.config import ModelConfig
from splash_rollout.scheduling.profile import HardwareProfile

ACT = 2  # bytes per bf16 activation element
PRICED_WIDTHS = traffic.ElementBytes(activation=ACT, partial=ACT, attention=ACT, cp_partial=ACT, lse=4, score=4)
"""The element widths this package's engine's traffic is priced at: bf16 rows and partial sums (what
a GPU run moves; a CPU profile's fitted bandwidth absorbs its float32 / float64 widths), float32
LSE and scores."""
_CURVE = {"all_reduce": "all_reduce", "reduce_scatter": "all_reduce", "all_gather": "all_gather",
          "all_to_all": "all_to_all"}
"""Which of a profile's collective curves prices each kind (a reduce-scatter: the all-reduce's)."""
REF_SPARSE_MIN_KEYS = 64
"""``models.attention_math.SPARSE_MIN_KEYS``: the reference backend attends histories shorter than
this densely (a test keeps the two equal; this layer may not import the models)."""


@dataclass(frozen=True)
class StepBatch:
    """x: the requests of one step."""

    context: np.ndarray
    """[B] int64: s_i, tokens in request i's history once this step's rows are appended."""
    query_rows: np.ndarray
    """[B] int64: q_i, rows this step (prefill chunk length, or 1 in decode)."""
    owners: np.ndarray
    """[B] int64: owner rank (DP-attention, DOP)."""
    sampling_rows: int | None = None
    """Rows that produce a token (lm_head); None means one per request."""
    prefill_done: int = 0
    """Requests whose prefill completes this step (each pays ``layout_request_s`` once)."""

    @classmethod
    def make(cls, context, query_rows, owners, sampling_rows: int | None = None, prefill_done: int = 0
             ) -> "StepBatch":
        c = np.asarray(context, dtype=np.int64).reshape(-1)
        q = np.broadcast_to(np.asarray(query_rows, dtype=np.int64), c.shape).copy()
        o = np.broadcast_to(np.asarray(owners, dtype=np.int64), c.shape).copy()
        if (q < 0).any() or (q > c).any():
            raise ValueError("query_rows: expected 0 <= q_i <= context_i")
        if not 0 <= int(prefill_done) <= c.size:
            raise ValueError(f"prefill_done: expected 0..{c.size} requests, got {prefill_done}")
        return cls(c, q, o, sampling_rows, int(prefill_done))

    @property
    def size(self) -> int:
        return int(self.context.size)

    @property
    def rows(self) -> int:
        return int(self.query_rows.sum())


@dataclass(frozen=True)
class StepCost:
    """Predicted latency of one step in one layout."""

    layout: Layout
    seconds: float
    """Step latency (inf when the layout cannot hold the batch)."""
    stages: Mapping[str, float] = field(default_factory=dict)
    """Seconds per stage summed over layers (``attn_in``, ``attn_proj``, ``indexer``, ``attention``,
    ``attn_comm``, ``mlp``, ``mlp_comm``, ``lm_head``, ``overhead``)."""
    layer_seconds: tuple[float, ...] = ()
    """[num_layers] seconds of each decoder layer (what hides a switch's next-layer transfer)."""
    feasible: bool = True
    reason: str = ""
    variant: str = ""
    """CP's algorithm this step: ``pass-q`` (merge partials) or ``pass-kv`` (gather the histories)."""


STAGES = ("attn_in", "attn_proj", "indexer", "attention", "attn_comm", "mlp", "mlp_comm", "lm_head", "overhead")
STAGE_GROUP_OF = {"compute": ("attn_in", "attn_proj", "mlp", "lm_head"), "attention": ("attention", "indexer"),
                  "comm": ("attn_comm", "mlp_comm")}
"""Which ``profile.stage_scale`` factor multiplies each stage (overhead is never scaled)."""


# ---- model constants (computed once per model / byte table) ----------------------------------

@dataclass(frozen=True)
class _Consts:
    hidden: int
    heads: int
    vocab: int
    f_in: float  # replicated q_a + kv_a FLOP per row
    f_in_idx: float  # indexer projections FLOP per row (full layers)
    f_q: float  # q_b + W_UK absorption FLOP per row per head
    f_o: float  # W_UV + o_proj FLOP per row per head
    f_att: float  # absorbed attention FLOP per (row, token, head)
    f_idx: float  # indexer FLOP per (row, token)
    topk: int  # 0: dense attention
    lat_bytes: int  # cached latent + rope bytes per token per layer
    idx_bytes: int  # cached indexer key bytes per token per full layer
    q_width: int  # q_lora (or hidden) + kv_lora + rope: latent row CP gathers
    q_lora: int  # q latent width (0: no q compression)
    kv_lora: int
    qk_rope: int
    nope: int  # qk_nope_head_dim
    v: int  # v_head_dim
    expert_bytes: int
    f_expert: float  # FLOP per routed row per expert
    dense_bytes: int
    f_dense: float
    n_experts: int
    top_k: int
    n_shared: int
    groups: tuple[tuple[tuple[bool, bool], tuple[int, ...]], ...]  # ((full_indexer, moe), layers)
    w_a: tuple[int, ...]
    w_rep: tuple[int, ...]
    head_bytes: int  # lm_head bytes (whole)


_CACHE: dict[tuple[int, int], tuple[ModelConfig, AttentionBytes, _Consts]] = {}


def _consts(model: ModelConfig, sizes: AttentionBytes) -> _Consts:
    key = (id(model), id(sizes))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is model and hit[1] is sizes:
        return hit[2]
    c = model
    wd, kf = sizes.weight_dtype, sizes.kv_format
    q_in = c.q_lora_rank or c.hidden_size
    h, d = c.hidden_size, c.kv_lora_rank
    f_in = 2.0 * h * ((c.q_lora_rank or 0) + d + c.qk_rope_head_dim)
    f_in_idx = 2.0 * (q_in * c.index_n_heads * c.index_head_dim + h * c.index_head_dim + h * c.index_n_heads)
    lat = kv_vector_bytes(d, kf) + c.qk_rope_head_dim * (2 if kf == "fp8-flashmla" else {"bf16": 2, "fp32": 4}[kf])
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i in range(c.num_layers):
        groups.setdefault((c.layer_has_indexer_cache(i), c.is_moe_layer(i)), []).append(i)
    vocab_dtype = "bf16" if wd == "fp8" else wd
    consts = _Consts(
        hidden=h, heads=c.num_heads, vocab=c.vocab_size, f_in=f_in, f_in_idx=f_in_idx,
        f_q=2.0 * (q_in * c.qk_head_dim + c.qk_nope_head_dim * d),
        f_o=2.0 * (d * c.v_head_dim + c.v_head_dim * h),
        f_att=2.0 * (d + c.qk_rope_head_dim) + 2.0 * d,
        f_idx=2.0 * c.index_n_heads * c.index_head_dim,
        topk=c.index_topk if c.has_indexer else 0,
        lat_bytes=lat, idx_bytes=kv_vector_bytes(c.index_head_dim, kf) if c.has_indexer else 0,
        q_width=(c.q_lora_rank or h) + d + c.qk_rope_head_dim, q_lora=c.q_lora_rank or 0, kv_lora=d, qk_rope=c.qk_rope_head_dim,
        nope=c.qk_nope_head_dim, v=c.v_head_dim,
        expert_bytes=3 * matrix_bytes(c.moe_intermediate_size or 1, h, wd),
        f_expert=2.0 * 3 * h * c.moe_intermediate_size,
        dense_bytes=3 * matrix_bytes(c.intermediate_size, h, wd), f_dense=2.0 * 3 * h * c.intermediate_size,
        n_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, n_shared=c.n_shared_experts,
        groups=tuple((k, tuple(v)) for k, v in groups.items()),
        w_a=sizes.switchable_weight_bytes, w_rep=sizes.replicated_weight_bytes,
        head_bytes=matrix_bytes(c.vocab_size, h, vocab_dtype))
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[key] = (model, sizes, consts)
    return consts


# ---- per-request work ---------------------------------------------------------------------------

def _pairs(start: np.ndarray, q: np.ndarray, cap: int) -> np.ndarray:
    """Σ_j min(start + j, cap) for j = 1..q (cap <= 0: no cap). [B] float."""
    start, q = start.astype(np.float64), q.astype(np.float64)
    full = q * start + q * (q + 1) / 2
    if cap <= 0:
        return full
    m = np.clip(cap - start, 0, q)
    return m * start + m * (m + 1) / 2 + (q - m) * cap


def expanded_is_cheaper(num_new, seq_len, kv_lora: int, nope: int, rope: int, v: int, topk: int = 0):
    """Whether a request's chunk (``num_new`` queries over ``seq_len`` keys; ints or arrays) costs
    fewer multiply-adds per head in expanded MLA (kv_b once per key, then nope+rope wide keys and v
    wide values over every causal key) than in absorbed MLA (W_UK and W_UV per query, kv_lora+rope
    wide keys and kv_lora wide values over at most ``topk`` keys a query, 0: no DSA selection).
    The engine's choice (``engine/attention/expanded_prefill.py``) and its price here."""
    keys = np.minimum(seq_len, topk) if topk else seq_len
    absorbed = num_new * (nope * kv_lora + keys * (2 * kv_lora + rope) + kv_lora * v)
    expanded = seq_len * kv_lora * (nope + v) + num_new * seq_len * (nope + rope + v)
    return expanded < absorbed


def _per_rank(owners: np.ndarray, values: np.ndarray, t: int) -> np.ndarray:
    return np.bincount(owners, weights=values, minlength=t)[:t]


def _roof(flops: float, rate: float, w_bytes: float, w_bw: float, kv_bytes: float = 0.0, kv_bw: float = 1.0) -> float:
    return max(flops / rate, w_bytes / w_bw + kv_bytes / kv_bw)


@dataclass(frozen=True)
class _AttentionLoad:
    """What the busiest rank's attention block does in one step (per layer; per head where it says)."""

    att_load: float
    """(row, key) pairs scored per head."""
    idx_load: float
    sel_load: float
    gather_load: float
    kv_load: float
    """Latent tokens read."""
    idxr_load: float
    busy_requests: float
    att_flop_load: float
    att_heads: float
    n_r: np.ndarray | None
    """[T] rows per owner rank (owner layouts), else None."""
    busy_rows: float


@dataclass(frozen=True)
class _FeedForwardPlan:
    """Where the feed-forward block's rows run and what closes it."""

    mlp_comm: float
    ff_t: int
    """Ranks the block's weights are divided over."""
    ff_n: float
    """Rows one rank runs them on."""
    replicated: bool


def step_time(layout: Layout | str, batch: StepBatch, model: ModelConfig, profile: HardwareProfile,
              sizes: AttentionBytes, pools: Mapping[Layout, int] | None = None) -> StepCost:
    """Predicted latency of one step of ``batch`` in ``layout``; inf when its KV does not fit ``pools``
    (per-rank pool tokens per layout, from ``layout.footprints``). The steps: what the attention
    block reads and scores on the busiest rank, where the feed-forward rows run, the attention
    block's collective (CP: each way of running it), the feed-forward cost, every layer's stages
    under the cheapest way, then the head and the per-step overheads."""
    layout = Layout.parse(layout)
    t = profile.world_size
    if pools is not None:
        pool = pools.get(layout, 0)
        if not fits(layout, batch.context, pool, t, batch.owners):
            return StepCost(layout, math.inf, {}, (), False,
                            f"{layout.value}: KV of {int(batch.context.sum())} tokens does not fit a {pool}-token pool per rank")
    k = _consts(model, sizes)
    p = profile
    ref = p.engine in ("torch_ref", "cpu")  # the engine this package runs: dense indexer, replicated CP
    paged = p.engine == "cpu"  # ... whose cpu backend attends only the keys a row sees, in place
    n = float(batch.query_rows.sum())
    load = _attention_load(layout, batch, k, t, ref, paged)
    engine_traffic = _engine_traffic(layout, batch, model, p, t) if ref else None
    ff = _feed_forward_plan(layout, p, n, load.n_r, t, engine_traffic, k.hidden)
    variants = _attention_variants(layout, batch, k, p, t, engine_traffic, n, load, ff.replicated)
    mlp = _mlp_seconds(k, p, ff, k.hidden)
    stages, layer_seconds, variant = _cheapest_layers(layout, model, k, p, t, load, ff, mlp, variants)
    q = batch.query_rows
    r = batch.size if batch.sampling_rows is None else batch.sampling_rows
    stages["lm_head"] = _stage_scales(p, layout)["lm_head"] * _roof(r * 2.0 * k.hidden * k.vocab / t, p.matmul_flops, k.head_bytes / t,
                                           p.weight_read_Bps) if r else 0.0
    stages["overhead"] += (p.step_overhead_s + batch.size * p.request_step_s
                           + (p.per_layout("layout_step_s", layout.value) if (q > 1).any() else 0.0)
                           + float(np.where(q > 1, q, 0).sum()) * p.per_layout("layout_token_s", layout.value)
                           + batch.prefill_done * p.per_layout("layout_request_s", layout.value))
    return StepCost(layout, float(sum(stages.values())), stages, tuple(layer_seconds), variant=variant)


def _attention_load(layout: Layout, batch: StepBatch, k, t: int, ref: bool, paged: bool) -> _AttentionLoad:
    """Keys scored, latent tokens read and attention FLOP of the busiest rank (owner layouts: the
    most loaded owner; TP / CP: the sum, over T where CP spreads it)."""
    s, q, own = batch.context, batch.query_rows, batch.owners
    start = s - q
    active = q > 0
    h = k.heads
    cp = layout is Layout.CP
    owner_layout = layout in (Layout.DP, Layout.DOP)
    if ref:
        # the reference backend scores every key of the history it holds (a dense masked rectangle)
        # unless the rows' selection is sparse enough to gather (models/attention_math.py)
        s_here = np.ceil(s / t) if cp else s.astype(np.float64)
        widest = np.minimum(s_here, np.ceil(np.minimum(s, k.topk) / t) if cp else np.minimum(s, k.topk)) \
            if k.topk else s_here
        gathered = (s_here >= REF_SPARSE_MIN_KEYS) & (4 * widest <= s_here)
        att_pairs = q * np.where(gathered, widest, s_here)  # [B] keys scored per head, on one rank
        att_gather = np.where(gathered, att_pairs, 0.0) * (k.kv_lora + k.qk_rope)  # [B] elements copied, all heads
        if paged:  # causal / selected keys only, read in place; a CP rank holds 1/T of them
            att_pairs = _pairs(start, q, k.topk) / (t if cp else 1)
            att_gather = np.zeros(s.shape)
        idx_pairs = (q * s_here).astype(np.float64) if k.topk else np.zeros(s.shape)
        select = (q * s).astype(np.float64) if k.topk else np.zeros(s.shape)  # every rank selects from all
    else:
        att_pairs = _pairs(start, q, k.topk)  # [B] (row, token) pairs attended, per head
        idx_pairs = _pairs(start, q, 0) if k.topk else np.zeros_like(att_pairs)
        select = np.zeros(s.shape)
        att_gather = np.zeros(s.shape)
    if ref:  # the reference backend gathers the whole history it holds, then selects
        kv_read = np.where(active, s_here, 0).astype(np.float64)
    else:
        kv_read = np.minimum(s, q * k.topk) if k.topk else s.astype(np.float64)  # latent tokens read
        kv_read = np.where(active, kv_read, 0).astype(np.float64)
    idx_read = np.where(active, s, 0).astype(np.float64)
    busy_rows = 0.0
    if owner_layout:
        n_r = _per_rank(own, q.astype(np.float64), t)
        busy_rows = float(n_r.max())
        att_load = float(_per_rank(own, att_pairs, t).max())
        idx_load = float(_per_rank(own, idx_pairs, t).max())
        sel_load = float(_per_rank(own, select, t).max())
        gather_load = float(_per_rank(own, att_gather, t).max())
        kv_load = float(_per_rank(own, kv_read, t).max())
        idxr_load = float(_per_rank(own, idx_read, t).max())
        busy_requests = float(_per_rank(own, active.astype(np.float64), t).max())
    else:
        n_r = None
        div = t if cp and not ref else 1  # the reference attention loads are per rank already
        att_load, idx_load = att_pairs.sum() / div, idx_pairs.sum() / div
        sel_load = float(select.sum())
        gather_load = float(att_gather.sum())
        kv_load = kv_read.sum() / (t if cp and not ref else 1)
        idxr_load = idx_read.sum() / (t if cp else 1)
        busy_requests = float(active.sum())
    att_heads = h / t if layout is Layout.TP else h
    # attention FLOP per head: absorbed, or (cpu engine, prefill chunks where it is cheaper, whole
    # histories only) expanded -- kv_b once per key, narrow dot products, no W_UK / W_UV per row
    att_flops = att_pairs * k.f_att
    if paged and not cp:
        wide = (q > 1) & expanded_is_cheaper(q.astype(np.float64), s.astype(np.float64), k.kv_lora, k.nope,
                                             k.qk_rope, k.v, k.topk)
        causal = _pairs(start, q, 0)  # the expanded form masks a DSA selection, it does not skip it
        att_flops = np.where(wide, 2.0 * (s * k.kv_lora * (k.nope + k.v) + causal * (k.nope + k.qk_rope + k.v)
                                          - q * k.kv_lora * (k.nope + k.v)), att_flops)
    att_flop_load = (float(_per_rank(own, att_flops, t).max()) if owner_layout
                     else float(att_flops.sum()) / (t if cp and not ref else 1))  # as att_load is
    return _AttentionLoad(att_load, idx_load, sel_load, gather_load, kv_load, idxr_load, busy_requests,
                          att_flop_load, att_heads, n_r, busy_rows)


def _feed_forward_plan(layout: Layout, p: HardwareProfile, n: float, n_r, t: int, engine_traffic,
                       hd: int) -> _FeedForwardPlan:
    """Which ranks run the feed-forward rows and the collective that closes the block."""
    rows_sh = float(ceil_div(int(n), t))
    # replicated feed-forward weights: each row is computed whole on one rank -- a DP-attention rank
    # its own rows, other layouts a 1/T slice of the replicated rows
    replicated_ff = p.feed_forward == "replicated" and t > 1
    ff_t, ff_n = t, n  # ranks the block's weights are divided over; rows one rank runs them on
    if replicated_ff:
        ff_t, ff_n = 1, (float(n_r.max()) if layout is Layout.DP else rows_sh)
    if engine_traffic is not None:  # this package's engine: what its executor states it sends
        mlp_comm = _priced(p, (c for c in engine_traffic if c.tag == "step/mlp"))
    elif replicated_ff:
        mlp_comm = 0.0 if layout is Layout.DP else p.all_gather.time((n - rows_sh) * hd * ACT)
    else:  # the published engines close the block with the all-reduce their profiles were fitted with
        mlp_comm = p.all_reduce.time(n * hd * ACT * 2 * (t - 1) / t)
    return _FeedForwardPlan(mlp_comm, ff_t, ff_n, replicated_ff)


def _engine_traffic(layout: Layout, batch: StepBatch, model: ModelConfig, p: HardwareProfile,
                    t: int) -> list[traffic.Collective]:
    """One layer's collectives of this package's engine for ``batch`` (``layout/traffic.py``; the
    indexer scores' width without the page rounding)."""
    q = batch.query_rows.astype(np.int64)
    owned = tuple(int(x) for x in np.bincount(batch.owners, weights=q, minlength=t)[:t]) if t > 1 else (int(q.sum()),)
    widest = int(batch.context.max()) if batch.size else 0
    shape = traffic.StepShape(owned, model.hidden_size, model.num_heads, model.kv_lora_rank, model.qk_rope_head_dim,
                              PRICED_WIDTHS, p.feed_forward, score_columns=ceil_div(widest, t))
    return traffic.BY_LAYOUT[layout](shape)


def _priced(p: HardwareProfile, collectives) -> float:
    """Seconds of these collectives, each on its busiest rank's bytes."""
    return float(sum(getattr(p, _CURVE[c.op]).time(c.busiest_bytes) for c in collectives))


def _attention_variants(layout: Layout, batch: StepBatch, k, p: HardwareProfile, t: int, engine_traffic,
                        n: float, load: _AttentionLoad,
                        replicated_ff: bool) -> list[tuple[str, float, float, float, float]]:
    """Each way of running the attention block: (name, rows projected in, projection FLOP, its
    collective per layer, the indexer's extra collective on full layers). One way outside CP.
    ``engine_traffic``: this package's engine's collectives (its executor's account), else None
    (a published engine's algorithms, below)."""
    ref = engine_traffic is not None
    s, q = batch.context, batch.query_rows
    active = q > 0
    h, hd = k.heads, k.hidden
    cp = layout is Layout.CP
    n_r, busy_rows = load.n_r, load.busy_rows
    rows_sh = float(ceil_div(int(n), t))
    ar_hidden = p.all_reduce.time(n * hd * ACT * 2 * (t - 1) / t)
    frac = (t - 1) / t
    if ref:
        attn = [c for c in engine_traffic if c.tag == "step/attn"]
        comm = _priced(p, (c for c in attn if not c.indexer_layers_only))
        comm_idx = _priced(p, (c for c in attn if c.indexer_layers_only))
    elif layout is Layout.TP:
        comm = ar_hidden
    elif layout is Layout.DP:
        comm = 0.0 if replicated_ff else p.all_gather.time(float((n - n_r).max()) * hd * ACT)
    elif layout is Layout.DOP:
        def a2a(width: int) -> float:
            sent = (n - n_r) * (h / t) * width * ACT
            recv = n_r * h * (t - 1) / t * width * ACT
            return p.all_to_all.time(float(np.maximum(sent, recv).max()))
        # the owner runs q_a / kv_a / indexer projections on its own rows, then the q latent of
        # every row is all-gathered for the head-sharded q_b; after o_proj a reduce-scatter
        # keeps every head's contribution to the owner's rows, which are all-gathered back
        q_lat = p.all_gather.time(float((n - n_r).max()) * k.q_lora * ACT) if k.q_lora else 0.0
        rs = p.all_reduce.time(n * hd * ACT * (t - 1) / t) if t > 1 else 0.0
        back = p.all_gather.time(float((n - n_r).max()) * hd * ACT)
        comm = q_lat + a2a(k.kv_lora + k.qk_rope) + a2a(k.kv_lora) + rs + back
    if layout is Layout.TP:
        in_rows, proj_flops = n, n * (k.f_q + k.f_o) * h / t
    elif layout is Layout.DOP:
        in_rows, proj_flops = (n if ref else busy_rows), n * (k.f_q + k.f_o) * h / t
    elif layout is Layout.DP:
        in_rows, proj_flops = busy_rows, busy_rows * (k.f_q + k.f_o) * h
    variants = [("", in_rows, proj_flops, comm, comm_idx if ref else 0.0)] if not cp else []
    if cp and ref:
        # replicated: every rank projects every row and attends them over the positions it stores;
        # the partial outputs and their LSE are all-gathered and merged on every rank; DSA scores
        # of the local positions are all-gathered so every rank selects the global top-k itself
        variants.append(("replicated", n, n * (k.f_q + k.f_o) * h, comm, comm_idx))
    elif cp:
        # pass-Q: every rank attends every row over its own positions, partials+LSE merged by row
        # owner; q_b/absorption run for all rows on every rank, W_UV/o_proj on N/T rows.
        topk = 0.0
        if k.topk:
            cand = q * np.minimum(k.topk, np.ceil(s / t)) * 8.0 * (t - 1)
            keys = s * k.idx_bytes * frac
            topk = p.all_gather.time(float(np.where(s > k.topk, np.minimum(cand, keys), 0).sum()))
        variants.append(("pass-q", rows_sh, n * k.f_q * h + rows_sh * k.f_o * h,
                         p.all_gather.time(frac * n * k.q_width * ACT)
                         + p.all_to_all.time(frac * n * h * (k.kv_lora + 2) * ACT)
                         + p.all_gather.time(frac * n * hd * ACT), topk))
        # pass-KV: rows split over ranks end to end; each rank gathers the stored latent (and
        # indexer keys) of the requests it serves this step. Wins for long prefill chunks.
        lat_gather = p.all_gather.time(frac * float(s[active].sum()) * k.lat_bytes)
        idx_gather = p.all_gather.time(frac * float(s[active].sum()) * k.idx_bytes) if k.topk else 0.0
        variants.append(("pass-kv", rows_sh, rows_sh * (k.f_q + k.f_o) * h,
                         lat_gather + p.all_gather.time(frac * n * hd * ACT), idx_gather))
    return variants


def _stage_scales(p: HardwareProfile, layout: Layout) -> dict[str, float]:
    """The profile's correction of each stage in ``layout`` (by the stage's group)."""
    return {name: p.scale(group, layout.value) for group, names in STAGE_GROUP_OF.items() for name in names}


def _mlp_seconds(k, p: HardwareProfile, ff: _FeedForwardPlan, hd: int) -> tuple[float, float]:
    """(MoE layer, dense layer) feed-forward seconds on one rank."""
    mf = p.matmul_flops
    ff_t, ff_n = ff.ff_t, ff.ff_n
    if k.n_experts:
        # sharded: a rank holds 1/T of the experts and runs them on every row; replicated: all of
        # them, run on its ff_n rows (ff_t = 1). Either way the router scores every row it sees.
        touched = k.n_experts * (1.0 - (1.0 - k.top_k / k.n_experts) ** ff_n) if ff_n else 0.0
        moe = _roof(ff_n * k.top_k * k.f_expert / ff_t + ff_n * k.n_shared * k.f_expert / ff_t
                    + ff_n * 2 * hd * k.n_experts, mf,
                    touched / ff_t * k.expert_bytes + k.n_shared * k.expert_bytes / ff_t + k.n_experts * hd * 4,
                    p.weight_read_Bps) + touched / ff_t * p.expert_call_s
    else:
        moe = 0.0
    dense = _roof(ff_n * k.f_dense / ff_t, mf, k.dense_bytes / ff_t, p.weight_read_Bps)
    return moe, dense


def _cheapest_layers(layout: Layout, model: ModelConfig, k, p: HardwareProfile, t: int, load: _AttentionLoad,
                     ff: _FeedForwardPlan, mlp: tuple[float, float], variants: list):
    """Every layer's stages under each way of running attention; the cheapest way's (stages summed
    over layers, seconds per layer, its name)."""
    mf, af = p.matmul_flops, p.attention_flops
    moe, dense = mlp
    sharded = layout.shards_projections
    scale = _stage_scales(p, layout)
    per_request = load.busy_requests * p.request_layer_s
    att_elements = (load.att_load * load.att_heads + load.gather_load) * p.score_element_s
    idx_elements = (load.idx_load * model.index_n_heads + load.sel_load) * p.score_element_s
    best = None
    for variant, in_rows, proj_flops, comm, comm_idx in variants:
        stages = dict.fromkeys(STAGES, 0.0)
        layer_seconds = [0.0] * model.num_layers
        for (full_idx, is_moe), layers in k.groups:
            i0 = layers[0]
            w_a = k.w_a[i0] / t if sharded else k.w_a[i0]
            st = {
                "attn_in": _roof(in_rows * (k.f_in + (k.f_in_idx if full_idx else 0.0)), mf, k.w_rep[i0], p.weight_read_Bps),
                "attn_proj": _roof(proj_flops, mf, w_a, p.weight_read_Bps),
                "indexer": _roof(load.idx_load * k.f_idx, af, 0.0, 1.0, load.idxr_load * k.idx_bytes, p.kv_read_Bps)
                + idx_elements if full_idx and k.topk else 0.0,
                "attention": _roof(load.att_flop_load * load.att_heads, af, 0.0, 1.0, load.kv_load * k.lat_bytes,
                                   p.kv_read_Bps) + att_elements,
                "attn_comm": comm + (comm_idx if full_idx else 0.0),
                "mlp": moe if is_moe else dense,
                "mlp_comm": ff.mlp_comm,
            }
            for name in st:
                st[name] *= scale[name]
            per_layer = float(sum(st.values())) + p.layer_overhead_s + per_request
            for name, v in st.items():
                stages[name] += float(v) * len(layers)
            stages["overhead"] += (p.layer_overhead_s + per_request) * len(layers)
            for i in layers:
                layer_seconds[i] = per_layer
        total = sum(stages.values())
        if best is None or total < best[0]:
            best = (total, variant, stages, layer_seconds)
    _, variant, stages, layer_seconds = best
    return stages, layer_seconds, variant


def step_times(batch: StepBatch, model: ModelConfig, profile: HardwareProfile, sizes: AttentionBytes,
               pools: Mapping[Layout, int] | None = None,
               layouts: tuple[Layout, ...] = ALL_LAYOUTS) -> dict[Layout, float]:
    """Seconds per step of ``batch`` in each layout (inf where it does not fit)."""
    return {l: step_time(l, batch, model, profile, sizes, pools).seconds for l in layouts}


def layout_fits(layout: Layout | str, context, owners, pools: Mapping[Layout, int], world_size: int) -> tuple[bool, str]:
    """Check-half of the fit pair: whether ``context`` (tokens per request) fits the layout's pool."""
    layout = Layout.parse(layout)
    pool = pools.get(layout, 0)
    ok = fits(layout, np.asarray(context, dtype=np.int64), pool, world_size, np.asarray(owners, dtype=np.int64))
    return ok, "" if ok else f"{layout.value}: KV does not fit a {pool}-token pool per rank"
