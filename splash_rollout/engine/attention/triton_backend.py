"""The ``triton`` attention backend: the whole step's paged MLA attention in two Triton launches.

Every row of the step (decode rows and prefill rows alike: a prefill chunk is one query row per
token, each causal to its own position) goes through the split-KV kernel of ``triton_mla``; a DSA
selection is turned into per-row pool slots first (int32, -1 invalid) and runs the sparse variant.
Triton is optional: this module imports without it and says how to install it when the backend is
built. On a machine without CUDA the kernels only run under Triton's interpreter
(``TRITON_INTERPRET=1``, about a millisecond per program instance: tests and small shapes only).
"""
from __future__ import annotations

import os

import torch

from splash_rollout.engine.attention.base import AttentionBackend, selected_keys
from splash_rollout.models.numerics import acc_dtype

TARGET_PROGRAMS = 264
"""Stage-1 programs the split count aims for (two per SM of a 132-SM GPU)."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def load_kernels():
    """The kernel module, or an ImportError that says how to get Triton."""
    try:
        from splash_rollout.engine.attention import triton_mla
    except ImportError as exc:
        raise ImportError("attention_backend='triton' needs Triton: pip install triton "
                          f"(or pip install 'splash_rollout[gpu]'); importing it failed: {exc}") from exc
    return triton_mla


def selected_slots(batch, selected: torch.Tensor) -> torch.Tensor:
    """selected: Bool [N, S] over history positions → [N, K] int32 pool slots of the selected keys
    this rank stores (K = the widest row; -1 pads rows with fewer and marks nothing stored)."""
    stored = batch.key_stored().index_select(0, batch.row_seq)  # [N, S]
    index, valid = selected_keys(batch, selected & stored)  # [N, K] int64, [N, 1, K]
    pages = batch.block_table[batch.row_seq[:, None], index // batch.page_size]  # [N, K]
    slots = pages * batch.page_size + index % batch.page_size
    return torch.where(valid[:, 0] & (pages >= 0), slots, torch.full_like(slots, -1)).to(torch.int32)


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, max_splits: int = 16, block_h: int = 16, block_n: int = 16,
                 target_programs: int = TARGET_PROGRAMS) -> None:
        """max_splits: most key ranges one row is cut into (1: no split); block_h / block_n: heads and
        keys per program tile (powers of two, >= 16 for GPU ``tl.dot``); target_programs: stage-1
        programs the split count aims for."""
        for field, value in (("max_splits", max_splits), ("block_h", block_h), ("block_n", block_n),
                             ("target_programs", target_programs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TritonBackend.{field}: expected a positive int, got {value!r}")
        for field, value in (("block_h", block_h), ("block_n", block_n)):
            if value & (value - 1):
                raise ValueError(f"TritonBackend.{field}: expected a power of two, got {value}")
        self.kernels = load_kernels()
        self.max_splits, self.block_h, self.block_n = max_splits, block_h, block_n
        self.target_programs = target_programs

    def index_scores(self, pool, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, batch) -> torch.Tensor:
        """The DSA indexer's scores of every row against this rank's stored positions, like the
        single-rank executor's ``index_scores``: index_q [N, Hi, D], index_w [N, Hi] → [N, S] float32
        (S = ``batch.max_seq_len``; 0 at positions not stored here, which callers mask)."""
        cache = pool.index_k[layer]  # [num_pages, page_size, D]
        if cache is None:
            raise RuntimeError(f"layer {layer} caches no indexer keys")
        return self.kernels.indexer_logits(index_q, index_w, cache.view(-1, cache.shape[-1]), batch.block_table,
                                           batch.row_seq, batch.seq_lens, batch.max_seq_len, batch.page_size,
                                           block_n=self.block_n, upcast=interpreting() or index_q.dtype != cache.dtype)

    def num_splits(self, rows: int, heads: int, max_keys: int) -> int:
        """Key ranges per row: enough programs to fill the GPU, never a range under one key block."""
        programs = rows * -(-heads // self.block_h)
        wanted = -(-self.target_programs // max(programs, 1))
        return max(1, min(self.max_splits, wanted, -(-max_keys // self.block_n)))

    def forward(self, layer, q_nope_abs, q_pe, pool, batch, selected: torch.Tensor | None, scale,
                partial: bool = False):
        acc = acc_dtype(q_nope_abs.dtype)
        if acc != torch.float32:
            raise ValueError(f"attention_backend='triton' accumulates in float32; numerics that accumulate in "
                             f"{acc} (reproducible mode) need attention_backend='torch' or 'torch_ref'")
        if q_nope_abs.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"attention_backend='triton': tensors are on {q_nope_abs.device}; the kernels need "
                               "CUDA, or TRITON_INTERPRET=1 to run them (slowly) on the CPU interpreter")
        n, h, _ = q_nope_abs.shape
        cache = pool.kv[layer]  # [num_pages, page_size, r + rope]
        kv = cache.view(-1, cache.shape[-1])  # [slots, r + rope]
        out_dtype = acc if partial else q_nope_abs.dtype
        upcast = interpreting() or q_nope_abs.dtype != kv.dtype
        common = dict(page_size=batch.page_size, block_h=self.block_h, block_n=self.block_n, upcast=upcast)
        if selected is not None:
            slots = selected_slots(batch, selected) if n else torch.empty((0, 0), dtype=torch.int32)
            splits = self.num_splits(n, h, max(int(slots.shape[1]), 1))
            return self.kernels.paged_mla(q_nope_abs, q_pe, kv, scale, out_dtype, slots=slots, num_splits=splits,
                                          **common)
        max_keys = batch.max_seq_len
        return self.kernels.paged_mla(q_nope_abs, q_pe, kv, scale, out_dtype, block_table=batch.block_table,
                                      row_seq=batch.row_seq, positions=batch.positions, max_keys=max_keys,
                                      num_splits=self.num_splits(n, h, max(max_keys, 1)), **common)
