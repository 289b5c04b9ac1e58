"""Byte accounting per layer: switchable projections W_A, replicated attention weights, KV per token.

Paper §2 / Table 2: the projections whose placement a layout changes are Q-B (``q_b_proj``, or
``q_proj`` without a query LoRA), KV-B (``kv_b_proj``) and O (``o_proj``). The down-projections
q_a / kv_a, their norms and the DSA indexer stay replicated in every layout.

Weight dtypes: ``fp8`` stores 1 byte per element plus one fp32 scale per 128x128 block (DeepSeek's
``weight_scale_inv``); norms and the indexer's ``weights_proj`` stay in bf16 as the checkpoints ship
them. KV formats (per token per layer): ``fp8-flashmla`` stores the latent in fp8 with one fp32 scale
per 128 values and the RoPE key in bf16 (FlashMLA's 656-byte layout for 512+64), and the indexer key
in fp8 with one fp32 scale per 128 values; ``bf16`` and ``fp32`` store every value at that width (the
CPU engine runs ``fp32``).
"""
from __future__ import annotations

from dataclasses import dataclass

from splash_rollout.layout.arith import ceil_div
from splash_rollout.models.config import ModelConfig

WEIGHT_DTYPES = ("fp8", "bf16", "fp32")
KV_FORMATS = ("fp8-flashmla", "bf16", "fp32")
_ELEMENT_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
QUANT_BLOCK = 128


def matrix_bytes(rows: int, cols: int, dtype: str) -> int:
    """Bytes of one [rows, cols] weight matrix, fp8 including its 128x128 block scales."""
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"weight dtype: expected one of {WEIGHT_DTYPES}, got {dtype!r}")
    n = rows * cols * _ELEMENT_BYTES[dtype]
    if dtype == "fp8":
        n += ceil_div(rows, QUANT_BLOCK) * ceil_div(cols, QUANT_BLOCK) * 4
    return n


def vector_bytes(n: int, dtype: str) -> int:
    """Norm weights and other 1-D parameters: bf16 when the matrices are fp8."""
    return n * (2 if dtype == "fp8" else _ELEMENT_BYTES[dtype])


def kv_vector_bytes(n: int, fmt: str) -> int:
    """One cached vector of n values: fp8 + fp32 scale per 128, or plain bf16 / fp32."""
    if fmt == "fp8-flashmla":
        return n + ceil_div(n, QUANT_BLOCK) * 4
    return n * _ELEMENT_BYTES[fmt]


@dataclass(frozen=True)
class AttentionBytes:
    """Per-layer byte counts of one model in one weight dtype and KV format."""

    switchable_weight_bytes: tuple[int, ...]
    """W_A of each layer: Q-B + KV-B + O, whole (all heads)."""
    replicated_weight_bytes: tuple[int, ...]
    """q_a, kv_a, their norms and the indexer of each layer (the same on every rank)."""
    kv_bytes_per_token: tuple[int, ...]
    """Cached bytes per token of each layer: latent + rope (+ indexer key where the layer has one)."""
    num_heads: int
    weight_dtype: str = "fp8"
    """Weight dtype the table was built with."""
    kv_format: str = "fp8-flashmla"
    """KV format the table was built with."""

    @property
    def num_layers(self) -> int:
        return len(self.kv_bytes_per_token)

    @property
    def w_a(self) -> int:
        """W_A: the switchable projections of all layers."""
        return sum(self.switchable_weight_bytes)

    @property
    def w_replicated(self) -> int:
        return sum(self.replicated_weight_bytes)

    @property
    def kv_bytes_per_token_total(self) -> int:
        return sum(self.kv_bytes_per_token)

    @classmethod
    def from_model(cls, config: ModelConfig, weight_dtype: str = "fp8", kv_format: str = "fp8-flashmla") -> "AttentionBytes":
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype: expected one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
        c, d = config, weight_dtype
        h = c.num_heads
        q_in = c.q_lora_rank or c.hidden_size
        w_a = (matrix_bytes(h * c.qk_head_dim, q_in, d)
               + matrix_bytes(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, d)
               + matrix_bytes(c.hidden_size, h * c.v_head_dim, d))
        rep = matrix_bytes(c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size, d) + vector_bytes(c.kv_lora_rank, d)
        if c.q_lora_rank:
            rep += matrix_bytes(c.q_lora_rank, c.hidden_size, d) + vector_bytes(c.q_lora_rank, d)
        switchable, replicated, kv = [], [], []
        latent = kv_vector_bytes(c.kv_lora_rank, kv_format)
        rope = c.qk_rope_head_dim * (2 if kv_format == "fp8-flashmla" else _ELEMENT_BYTES[kv_format])
        for layer in range(c.num_layers):
            layer_rep = rep
            layer_kv = latent + rope
            if c.layer_has_indexer_cache(layer):
                # wq_b [Hi*D, q_lora], wk [D, hidden], k_norm (weight + bias), weights_proj [Hi, hidden]: bf16 in
                # fp8 checkpoints, float32 in a bf16 / fp32 model (kept float32 like the router, as transformers does)
                layer_rep += (matrix_bytes(c.index_n_heads * c.index_head_dim, q_in, d)
                              + matrix_bytes(c.index_head_dim, c.hidden_size, d)
                              + 2 * vector_bytes(c.index_head_dim, d)
                              + c.index_n_heads * c.hidden_size * (2 if d == "fp8" else 4))
                layer_kv += kv_vector_bytes(c.index_head_dim, kv_format)
            switchable.append(w_a)
            replicated.append(layer_rep)
            kv.append(layer_kv)
        return cls(tuple(switchable), tuple(replicated), tuple(kv), h, weight_dtype, kv_format)
