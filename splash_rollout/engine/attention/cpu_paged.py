"""The ``cpu`` attention backend: one native call per layer that reads the paged pool in place.

Why it exists: the batched torch backend pads each step's requests to a common history length and
gathers every history into a ``[C, S, r + rope]`` temporary (then zeroes what a row may not see)
before two einsums read it again -- on the CPU that copying was half of a decode step. The native
kernel (``splash_rollout/native/paged_mla.cpp``) walks each request's pages through the block table instead,
scores a tile of query rows against each key once, and accumulates the output, with no
history-sized temporary. Same contract as every backend (``base.AttentionBackend``): causal rows or
a DSA selection, only positions stored on this rank, ``partial`` results in the accumulation dtype
with lse for an exact merge; float64 accumulation under reproducible numerics.

Pools in float32 or bfloat16 on the CPU take the kernel; anything else (float16, a CUDA pool)
goes to the batched torch backend, which is also what runs (with a warning) when the kernel cannot
be built here.
"""
from __future__ import annotations

import warnings

import torch

from splash_rollout.engine.attention.base import AttentionBackend
from splash_rollout.engine.attention.torch_batched import TorchBackend
from splash_rollout.models.numerics import acc_dtype
from splash_rollout.native.build import DTYPES, NativeUnavailable, load_native

_ACC_CODES = {torch.float32: 0, torch.float64: 1}
MAX_TILE_VECTORS = 16
"""Query vectors (rows x heads) one work item scores against each key it reads."""


def _rows_heads(t: torch.Tensor) -> torch.Tensor:
    """t: [N, H, d] with its last dim contiguous (any row and head strides), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def work_split(num_seqs: int, heads: int, threads: int) -> tuple[int, int]:
    """(rows per tile, heads per group): tiles of up to ``MAX_TILE_VECTORS`` query vectors. Every
    head group of a request reads its whole history again, so heads are split only until each
    thread has a work item (a batch of one request still uses every thread). On the 4-request tail
    workload this halves the KV bytes a step reads; its step time moved within noise."""
    group = min(heads, MAX_TILE_VECTORS)
    while group > 1 and num_seqs * -(-heads // group) < threads:
        group = -(-group // 2)
    return max(1, MAX_TILE_VECTORS // group), group


class CpuPagedBackend(AttentionBackend):
    name = "cpu"
    expands_prefill = True

    def __init__(self) -> None:
        self.fallback = TorchBackend()
        try:
            self.lib = load_native()
        except NativeUnavailable as exc:  # no compiler here: every call takes the batched torch path
            warnings.warn(f"attention_backend='cpu': the native kernel is unavailable ({exc}); using the "
                          "batched torch backend", RuntimeWarning, stacklevel=2)
            self.lib = None

    def forward(self, layer, q_nope_abs, q_pe, pool, batch, selected: torch.Tensor | None, scale,
                partial: bool = False):
        cache = pool.kv[layer]  # [num_pages, page_size, r + rope]
        acc = acc_dtype(q_nope_abs.dtype)
        if self.lib is None or cache.device.type != "cpu" or cache.dtype not in DTYPES or acc not in _ACC_CODES:
            return self.fallback.forward(layer, q_nope_abs, q_pe, pool, batch, selected, scale, partial)
        n, h, r = q_nope_abs.shape
        q_nope, q_pe = _rows_heads(q_nope_abs.to(acc)), _rows_heads(q_pe.to(acc))  # [N, H, r], [N, H, rope]
        out = torch.empty((h, n, r), dtype=acc).transpose(0, 1)  # [N, H, r] stored head-major: W_UV's per-head matmul reads it without a transposing copy
        lse = torch.empty((n, h), dtype=acc)
        if n:
            table, seq_lens, row_start, positions = self._paging(batch)
            sel, sel_width = (None, 0) if selected is None else (selected.contiguous(), selected.shape[1])
            rows, group = work_split(batch.num_seqs, h, torch.get_num_threads())
            cache = cache.contiguous()
            code = self.lib.splash_paged_mla(
                _ACC_CODES[acc], DTYPES[cache.dtype], q_nope.data_ptr(), *q_nope.stride()[:2], q_pe.data_ptr(),
                *q_pe.stride()[:2], cache.data_ptr(), table.data_ptr(), table.shape[1], seq_lens.data_ptr(),
                row_start.data_ptr(), batch.num_seqs, positions.data_ptr(), None if sel is None else sel.data_ptr(),
                sel_width, n, h, r, q_pe.shape[-1], batch.page_size, float(scale), out.data_ptr(), *out.stride()[:2],
                lse.data_ptr(), rows, group)
            if code != 0:
                raise RuntimeError(f"cpu attention: the native kernel refused acc {acc} with KV {cache.dtype}")
        if partial:
            return out, lse
        return out.to(q_nope_abs.dtype), lse.float()

    @staticmethod
    def _paging(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_table [B, P] int64, seq_lens [B] int64, row_start [B + 1] int64, positions [N] int64),
        contiguous on the CPU; the same for every layer of the step, so cached on the batch."""
        if "cpu_paging" not in batch.scratch:
            batch.scratch["cpu_paging"] = (
                batch.block_table.to(torch.int64).contiguous(), batch.seq_lens.to(torch.int64).contiguous(),
                torch.tensor(batch.query_start, dtype=torch.int64), batch.positions.to(torch.int64).contiguous())
        return batch.scratch["cpu_paging"]
