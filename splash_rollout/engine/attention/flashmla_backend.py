"""The ``flashmla`` attention backend: decode rows through FlashMLA's dense paged kernel (SM90).

A thin adapter. FlashMLA's dense decode (``flash_mla_with_kvcache(..., use_legacy=True)`` of the
``sgl-flash-mla`` wheel) reads the pool's pages as they are -- ``[pages, 64, 1, 576]`` bfloat16,
the latent and rope parts of a token contiguous -- through an int32 block table and int32 history
lengths. It attends every position below a request's length, so it serves exactly the rows whose
history this rank stores whole: decode rows (one query each) without a DSA selection. The other
rows of the step (prefill chunks, DSA-selected rows, histories with pages on another rank) go to a
fallback backend (``triton`` where Triton imports, else ``torch``), and the two results are
written into one output; the reference semantics (``base.AttentionBackend``) hold for every row.

The kernel module is imported when the backend is built, so the registry and the CPU path never
need it. ``kernel`` replaces ``flash_mla.flash_mla_with_kvcache`` (tests pass a torch emulation of
its documented contract to check the metadata and the routing on the CPU).
"""
from __future__ import annotations

from typing import Callable

import torch

from splash_rollout.engine.attention.base import AttentionBackend
from splash_rollout.engine.attention.kv_format import FLASHMLA_PAGE, pack_pages
from splash_rollout.engine.forward_batch import device_index
from splash_rollout.models.numerics import acc_dtype


def load_flash_mla():
    try:
        import flash_mla
    except (ImportError, OSError) as exc:
        raise ImportError("attention_backend='flashmla' needs the flash_mla module (CUDA, SM90): "
                          "pip install sgl-flash-mla --no-deps (its torch pin may be newer than yours); "
                          f"importing it failed: {exc}") from exc
    return flash_mla


def dense_metadata(batch, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's paging inputs for requests ``seqs`` ([b] int64 into the batch's B):
    (block_table [b, P] int32, cache_seqlens [b] int32). Pages past a request's length may be -1;
    FlashMLA never reads them, but it wants valid ids, so they become 0."""
    table = batch.block_table.index_select(0, seqs)
    return table.clamp(min=0).to(torch.int32).contiguous(), batch.seq_lens.index_select(0, seqs).to(torch.int32)


SPARSE_HEADS = (64, 128)
"""Query heads FlashMLA's sparse kernels take."""
SPARSE_TOPK_MULTIPLE = 128
"""Index columns of a sparse call come in multiples of this on SM90 (padded with -1)."""


def sparse_inputs(batch, selected: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A DSA selection as FlashMLA's sparse call reads it: (k_cache [pages', 64, 1, 656] uint8 -- the fp8
    packing of just the pages this step reads --, indices [N, 1, K] int32 of ``page' * 64 + offset``
    into it, -1 where invalid, K a multiple of 128). selected: Bool [N, S]; cache: a layer's pool pages."""
    from splash_rollout.engine.attention.triton_backend import selected_slots

    slots = selected_slots(batch, selected).long()  # [N, K0], -1 invalid
    pages = torch.unique(batch.block_table[batch.block_table >= 0])  # [p'] the step's pages
    remap = torch.full((cache.shape[0],), -1, dtype=torch.int64, device=cache.device)
    remap[pages] = torch.arange(pages.numel(), device=cache.device)
    here = slots >= 0
    page_of = remap[torch.where(here, slots // FLASHMLA_PAGE, torch.zeros_like(slots))]
    idx = torch.where(here, page_of * FLASHMLA_PAGE + slots % FLASHMLA_PAGE, torch.full_like(slots, -1))
    width = max(SPARSE_TOPK_MULTIPLE, -(-idx.shape[1] // SPARSE_TOPK_MULTIPLE) * SPARSE_TOPK_MULTIPLE)
    padded = torch.full((idx.shape[0], width), -1, dtype=torch.int32, device=idx.device)
    padded[:, :idx.shape[1]] = idx.to(torch.int32)
    return pack_pages(cache.index_select(0, pages), kv_lora_rank), padded[:, None, :]


def whole_here(batch) -> torch.Tensor:
    """Bool [B]: every history position of the request is stored on this rank."""
    return batch.key_stored().sum(1) == batch.seq_lens


def fallback_backend() -> AttentionBackend:
    try:
        from splash_rollout.engine.attention.triton_backend import TritonBackend
        return TritonBackend()
    except ImportError:
        from splash_rollout.engine.attention.torch_batched import TorchBackend
        return TorchBackend()


class FlashMLABackend(AttentionBackend):
    name = "flashmla"

    def __init__(self, kernel: Callable | None = None, fallback: AttentionBackend | None = None,
                 sparse_fp8: bool = False) -> None:
        """kernel: ``flash_mla_with_kvcache`` and its ``get_mla_metadata`` come from the wheel when
        None; fallback: the backend for rows FlashMLA cannot serve (default: triton, else torch);
        sparse_fp8: DSA-selected rows (64 or 128 heads) go to FlashMLA's sparse fp8 kernel, the
        step's pages packed to the 656-byte format on each call (a check of that kernel: it rounds
        the latent to fp8 and packs per layer; the pool itself stays in bfloat16)."""
        if kernel is None:
            flash_mla = load_flash_mla()
            kernel, self.new_metadata = flash_mla.flash_mla_with_kvcache, flash_mla.get_mla_metadata
        else:
            self.new_metadata = lambda: (None, None)
        self.kernel, self.sparse_fp8 = kernel, sparse_fp8
        self.fallback = fallback if fallback is not None else fallback_backend()

    def forward(self, layer, q_nope_abs, q_pe, pool, batch, selected: torch.Tensor | None, scale,
                partial: bool = False):
        if batch.page_size != FLASHMLA_PAGE:
            raise ValueError(f"attention_backend='flashmla': page_size must be {FLASHMLA_PAGE}, got {batch.page_size}")
        if pool.dtype != torch.bfloat16 or q_nope_abs.dtype != torch.bfloat16:
            raise ValueError("attention_backend='flashmla': dense FlashMLA reads bfloat16 queries and KV, got "
                             f"queries {q_nope_abs.dtype} and KV {pool.dtype} (dtype='bfloat16')")
        n, h, r = q_nope_abs.shape
        acc = acc_dtype(q_nope_abs.dtype)
        if selected is not None and n and self.sparse_fp8 and h in SPARSE_HEADS:
            return self.sparse(layer, q_nope_abs, q_pe, pool, batch, selected, scale, acc if partial else None)
        if selected is not None or n == 0:
            return self.fallback.forward(layer, q_nope_abs, q_pe, pool, batch, selected, scale, partial)
        served, rest = self.split(batch)
        if not len(served):
            return self.fallback.forward(layer, q_nope_abs, q_pe, pool, batch, selected, scale, partial)
        out = q_nope_abs.new_empty((n, h, r), dtype=acc if partial else q_nope_abs.dtype)  # [N, H, r]
        lse = q_nope_abs.new_empty((n, h), dtype=acc if partial else torch.float32)  # [N, H]
        rows = batch.scratch["flashmla_rows"]  # [b] the decode row of each served request
        meta_key = "flashmla_meta"
        if meta_key not in batch.scratch:  # the split-KV schedule: the same for every layer of the step
            batch.scratch[meta_key] = self.new_metadata()[0]
        table, seqlens = batch.scratch["flashmla_paging"]
        q = torch.cat([q_nope_abs[rows], q_pe[rows]], dim=-1)[:, None]  # [b, 1, H, r + rope]
        cache = pool.kv[layer]  # [pages, 64, r + rope]
        o, l = self.kernel(q, cache[:, :, None, :], table, seqlens, r, batch.scratch[meta_key],
                           softmax_scale=scale, causal=False, use_legacy=True)  # [b, 1, H, r], [b, H, 1]
        out[rows] = o[:, 0].to(out.dtype)
        lse[rows] = l[:, :, 0].to(lse.dtype)
        if len(rest):
            sub, sub_rows = batch.scratch["flashmla_rest"]
            o, l = self.fallback.forward(layer, q_nope_abs[sub_rows], q_pe[sub_rows], pool, sub, None, scale, partial)
            out[sub_rows] = o
            lse[sub_rows] = l
        return out, lse

    def sparse(self, layer, q_nope_abs, q_pe, pool, batch, selected, scale, keep: torch.dtype | None):
        """Every row as its own one-query request of FlashMLA's sparse fp8 decode."""
        r = q_nope_abs.shape[-1]
        k_cache, indices = sparse_inputs(batch, selected, pool.kv[layer], r)  # [p', 64, 1, 656], [N, 1, K]
        meta_key = ("flashmla_sparse_meta", indices.shape[-1])
        if meta_key not in batch.scratch:  # one schedule per index width, shared by the step's layers
            batch.scratch[meta_key] = self.new_metadata()[0]
        q = torch.cat([q_nope_abs, q_pe], dim=-1)[:, None]  # [N, 1, H, r + rope] bf16
        o, l = self.kernel(q, k_cache, None, None, r, batch.scratch[meta_key], softmax_scale=scale,
                           is_fp8_kvcache=True, indices=indices, use_legacy=True)  # [N, 1, H, r], [N, H, 1]
        out, lse = o[:, 0], l[:, :, 0]
        if keep is not None:
            return out.to(keep), lse.to(keep)
        return out, lse.float()

    def split(self, batch) -> tuple[list[int], list[int]]:
        """(requests FlashMLA serves: one decode row, history whole here; the others), cached on the
        batch with their paging inputs and the others' sub-batch."""
        if "flashmla_split" not in batch.scratch:
            whole = batch.whole_here if batch.whole_here is not None else whole_here(batch).tolist()
            served = [b for b, (k, w) in enumerate(zip(batch.num_new, whole)) if k == 1 and w]
            taken = set(served)
            rest = [b for b in range(batch.num_seqs) if b not in taken]
            batch.scratch["flashmla_split"] = (served, rest)
            if served:
                seqs = device_index(served, batch.device)
                batch.scratch["flashmla_rows"] = device_index([batch.query_start[b] for b in served], batch.device)
                batch.scratch["flashmla_paging"] = dense_metadata(batch, seqs)
            if rest and served:
                batch.scratch["flashmla_rest"] = batch.subset(rest)
        return batch.scratch["flashmla_split"]
