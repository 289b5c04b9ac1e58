"""Per-rank footprint of each layout (paper Table 2, Table 3): weights, KV pool, distinct tokens.

A rank's budget for attention weights and KV is its memory times the memory fraction, less a
transient reserve and less the weights that do not change with the attention layout (embeddings,
dense MLP, experts, norms: ``other_weight_bytes``). The KV pool is what remains after the layout's
attention weights, in whole pages. TP keeps a copy of every history on every rank, so its group holds
``pool`` distinct tokens; the other three hold ``T * pool``.
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.layout.arith import GiB, ceil_div
from splash_rollout.layout.bytes import AttentionBytes, matrix_bytes, vector_bytes
from splash_rollout.layout.layouts import ALL_LAYOUTS, Layout, Ownership
from splash_rollout.models.config import ModelConfig


@dataclass(frozen=True)
class RankBudget:
    """Memory one rank gives to attention weights and KV."""

    memory_bytes: int
    """Device memory per rank."""
    mem_fraction: float = 1.0
    """Share of memory the engine may use (SGLang's mem_fraction_static)."""
    reserve_bytes: int = 0
    """Transient reserve (activations, graphs) kept out of the pool."""
    other_weight_bytes: int = 0
    """Per-rank weights that no attention layout changes (MLP/MoE/embeddings shards)."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"memory: expected a positive size, got {self.memory_bytes} bytes")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction: expected a value in (0, 1], got {self.mem_fraction}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve: expected a non-negative size, got {self.reserve_bytes} bytes")

    @property
    def attention_bytes(self) -> int:
        """Bytes for the layout's attention weights plus its KV pool."""
        return int(self.memory_bytes * self.mem_fraction) - self.reserve_bytes - self.other_weight_bytes

    @classmethod
    def from_gib(cls, memory_gib: float, mem_fraction: float = 1.0, reserve_gib: float = 0.0,
                 other_weight_bytes: int = 0) -> "RankBudget":
        if memory_gib <= 0:
            raise ValueError(f"memory_gib: expected a positive number, got {memory_gib}")
        return cls(int(memory_gib * GiB), mem_fraction, int(reserve_gib * GiB), other_weight_bytes)


@dataclass(frozen=True)
class LayoutFootprint:
    """One layout's per-rank footprint."""

    layout: Layout
    world_size: int
    weight_bytes_per_rank: int
    """Attention weights resident on each rank: W_A or W_A/T, plus the replicated parts."""
    kv_bytes_per_token: int
    """KV bytes of one token across all layers."""
    pool_tokens_per_rank: int
    """KV pool per rank in tokens, whole pages."""

    @property
    def pool_bytes_per_rank(self) -> int:
        return self.pool_tokens_per_rank * self.kv_bytes_per_token

    @property
    def distinct_tokens(self) -> int:
        """Tokens the whole group can hold, replicated copies counted once."""
        if self.layout.ownership is Ownership.EVERY:
            return self.pool_tokens_per_rank
        return self.pool_tokens_per_rank * self.world_size

    def to_dict(self) -> dict:
        return {
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "pool_tokens_per_rank": self.pool_tokens_per_rank,
            "distinct_tokens": self.distinct_tokens,
            "pool_bytes_per_rank": self.pool_bytes_per_rank,
        }


def attention_weight_bytes_per_rank(layout: Layout, sizes: AttentionBytes, world_size: int) -> int:
    """W_A (replicated projections) or W_A/T (sharded), plus the always-replicated weights."""
    w_a = sizes.w_a if not layout.shards_projections else ceil_div(sizes.w_a, world_size)
    return w_a + sizes.w_replicated


def pool_tokens(budget_bytes: int, weight_bytes: int, kv_bytes_per_token: int, page_size: int) -> int:
    """Whole pages of KV that fit in what the weights leave; 0 when they leave nothing."""
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive integer, got {page_size}")
    free = budget_bytes - weight_bytes
    if free <= 0:
        return 0
    return free // kv_bytes_per_token // page_size * page_size


def footprint(layout: Layout, sizes: AttentionBytes, world_size: int, budget: RankBudget,
              page_size: int = 64) -> LayoutFootprint:
    weights = attention_weight_bytes_per_rank(layout, sizes, world_size)
    kv = sizes.kv_bytes_per_token_total
    return LayoutFootprint(layout, world_size, weights, kv,
                           pool_tokens(budget.attention_bytes, weights, kv, page_size))


def footprints(sizes: AttentionBytes, world_size: int, budget: RankBudget,
               page_size: int = 64) -> dict[Layout, LayoutFootprint]:
    return {l: footprint(l, sizes, world_size, budget, page_size) for l in ALL_LAYOUTS}


FEED_FORWARD_PLACEMENTS = ("sharded", "replicated")
"""Where the MLP / MoE weights live over T ranks: 1/T on each, or whole on every rank."""

VOCAB_PLACEMENTS = ("replicated", "sharded")
"""Where the embeddings and the LM head live over T ranks: whole on every rank (this engine: each rank
embeds its own rows and computes whole-vocabulary logits for the rows it samples) or split over the
vocabulary (vocab-parallel, as SGLang and vLLM deploy with tensor parallelism)."""


def other_weight_bytes_per_rank(config: ModelConfig, world_size: int, weight_dtype: str = "fp8",
                                feed_forward: str = "sharded", vocab: str = "replicated") -> int:
    """Weights no attention layout moves, per rank: the embeddings and the LM head -- ``vocab``
    ``replicated`` (this engine) or ``sharded`` over the vocabulary --, the feed-forward blocks --
    ``sharded``: dense MLP in TP, routed experts spread over ranks, shared experts in TP (all / T);
    ``replicated``: all of them on every rank --, plus the replicated router and layer norms.
    Embeddings and lm_head stay bf16 in fp8 checkpoints."""
    if feed_forward not in FEED_FORWARD_PLACEMENTS:
        raise ValueError(f"feed_forward: expected one of {FEED_FORWARD_PLACEMENTS}, got {feed_forward!r}")
    if vocab not in VOCAB_PLACEMENTS:
        raise ValueError(f"vocab: expected one of {VOCAB_PLACEMENTS}, got {vocab!r}")
    c, d = config, weight_dtype
    ff_ranks = world_size if feed_forward == "sharded" else 1
    vocab_dtype = "bf16" if d == "fp8" else d
    total = matrix_bytes(c.vocab_size, c.hidden_size, vocab_dtype) * (1 if c.tie_word_embeddings else 2)
    per_rank = ceil_div(total, world_size if vocab == "sharded" else 1)
    replicated = vector_bytes(c.hidden_size, d)  # final norm
    for layer in range(c.num_layers):
        replicated += 2 * vector_bytes(c.hidden_size, d)
        if c.is_moe_layer(layer):
            expert = 3 * matrix_bytes(c.moe_intermediate_size, c.hidden_size, d)
            per_rank += ceil_div(expert * (c.n_routed_experts + c.n_shared_experts), ff_ranks)
            replicated += c.n_routed_experts * c.hidden_size * 4 + c.n_routed_experts * 4  # fp32 router + bias
        else:
            per_rank += ceil_div(3 * matrix_bytes(c.intermediate_size, c.hidden_size, d), ff_ranks)
    return per_rank + replicated
