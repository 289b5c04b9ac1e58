"""Triton kernels of paged absorbed-MLA attention: split-KV partials, then one reduce.

Why two stages: a decode step has few query rows (one per request) and long histories, so one
program per row would leave most of a GPU idle. Stage 1 cuts every row's keys into ``num_splits``
equal ranges and runs one program per (row, head block, split); each writes its normalised partial
output and its log-sum-exp. Stage 2 merges a row's splits exactly (the same merge a CP layout does
across ranks), so the result does not depend on the split count beyond float rounding.

Which keys a row reads comes in one of two forms (``SPARSE`` picks at compile time):

* dense causal: keys are the row's positions ``[0, position]``, their slots looked up in the
  request's block-table row (a page of -1 is stored on another rank: masked);
* sparse (a DSA selection): an int32 ``[N, K]`` table of pool slots per row, -1 where invalid.

Every load of a key a row may not see is masked (``other=0``) and its logit set to -inf, so
unused pages -- even NaN-filled ones -- never reach the result. fp16 / bf16 operands feed ``tl.dot``
natively on a GPU (float32 accumulation); ``upcast`` converts them to float32 right after loading
(what the CPU interpreter needs: its bf16 arithmetic is wrong), and float32 dots run in IEEE
precision (no TF32) so they match the torch reference.

Shapes at the boundary (one layer): q [N, H, r], q_pe [N, H, rope], kv [slots, r + rope] (the
pool's pages flattened), outputs out [N, H, r] and lse [N, H] float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(q_ptr, qpe_ptr, kv_ptr, table_ptr, row_seq_ptr, pos_ptr, idx_ptr, part_out_ptr, part_lse_ptr,
                  num_heads, num_splits, sparse_keys, split_len, stride_qn, stride_qh, stride_pn, stride_ph, stride_table,
                  stride_idx, scale,
                  R: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                  SPARSE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dr = tl.arange(0, BLOCK_R)
    dp = tl.arange(0, BLOCK_P)
    r_ok = dr < R
    p_ok = dp < ROPE
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + dr[None, :],
                mask=head_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(qpe_ptr + row * stride_pn + heads[:, None] * stride_ph + dp[None, :],
                   mask=head_ok[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]
    if UPCAST:
        q = q.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    if SPARSE:
        num_keys = sparse_keys
        seq = 0
    else:
        num_keys = tl.load(pos_ptr + row) + 1  # causal: positions [0, own position]
        seq = tl.load(row_seq_ptr + row)
    start = split * split_len
    end = tl.minimum(start + split_len, num_keys)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        offs = k0 + tl.arange(0, BLOCK_N)
        inside = offs < end
        if SPARSE:
            slot = tl.load(idx_ptr + row * stride_idx + offs, mask=inside, other=-1).to(tl.int64)
            valid = slot >= 0
        else:
            page = tl.load(table_ptr + seq * stride_table + offs // PAGE, mask=inside, other=-1).to(tl.int64)
            valid = inside & (page >= 0)
            slot = page * PAGE + offs % PAGE
        slot = tl.where(valid, slot, 0)
        base = kv_ptr + slot[:, None] * (R + ROPE)
        c = tl.load(base + dr[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(base + R + dp[None, :], mask=valid[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_P]
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(c), input_precision="ieee") + tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays exact
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m = m_new
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    part = (row * num_heads + heads) * num_splits + split  # [BLOCK_H]
    tl.store(part_out_ptr + part[:, None] * BLOCK_R + dr[None, :], out, mask=head_ok[:, None])
    tl.store(part_lse_ptr + part, lse, mask=head_ok)


@triton.jit
def _reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_heads, num_splits,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dr = tl.arange(0, BLOCK_R)
    splits = tl.arange(0, BLOCK_S)
    first = (row * num_heads + heads) * num_splits  # [BLOCK_H]
    lse = tl.load(part_lse_ptr + first[:, None] + splits[None, :],
                  mask=head_ok[:, None] & (splits[None, :] < num_splits), other=float("-inf"))  # [BLOCK_H, BLOCK_S]
    top = tl.max(lse, 1)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - top_safe[:, None]), 1)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(part_lse_ptr + first + s, mask=head_ok, other=float("-inf")) - top_safe)
        o = tl.load(part_out_ptr + (first + s)[:, None] * BLOCK_R + dr[None, :], mask=head_ok[:, None], other=0.0)
        acc += w[:, None] * o
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    final = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(out_ptr + (row * num_heads + heads)[:, None] * R + dr[None, :], out,
             mask=head_ok[:, None] & (dr[None, :] < R))
    tl.store(lse_ptr + row * num_heads + heads, final, mask=head_ok)


def paged_mla(q: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, scale: float, out_dtype: torch.dtype, *,
              page_size: int, block_table: torch.Tensor | None = None, row_seq: torch.Tensor | None = None,
              positions: torch.Tensor | None = None, slots: torch.Tensor | None = None,
              max_keys: int | None = None, num_splits: int = 1, block_h: int = 16, block_n: int = 16,
              upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of every row over paged latent KV.

    q: [N, H, r]; q_pe: [N, H, rope]; kv: [slots, r + rope] (a layer's pages flattened, any dtype).
    Dense causal: ``block_table`` [B, P] int (-1: page elsewhere), ``row_seq`` [N] int and
    ``positions`` [N] int, ``max_keys`` >= every position + 1 (read from ``positions`` when None).
    Sparse: ``slots`` [N, K] int32 pool slots, -1 invalid. ``num_splits`` key ranges per row.
    → (out [N, H, r] in ``out_dtype``, lse [N, H] float32; a row that sees no key gets 0 and -inf).
    """
    n, h, r = q.shape
    rope = q_pe.shape[-1]
    if kv.shape[-1] != r + rope:
        raise ValueError(f"kv: expected rows of kv_lora_rank + rope = {r + rope}, got {kv.shape[-1]}")
    sparse = slots is not None
    if not sparse and (block_table is None or row_seq is None or positions is None):
        raise ValueError("paged_mla: dense attention needs block_table, row_seq and positions")
    q, q_pe, kv = q.contiguous(), q_pe.contiguous(), kv.contiguous()
    block_r, block_p = triton.next_power_of_2(r), triton.next_power_of_2(rope)
    out = torch.empty((n, h, r), dtype=out_dtype, device=q.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    if sparse:
        keys = int(slots.shape[1])
        idx = slots.to(torch.int32).contiguous() if keys else torch.full((n, 1), -1, dtype=torch.int32,
                                                                        device=q.device)
        table, seq, pos = idx, idx, idx  # unused by the sparse variant
    else:
        keys = int(positions.max()) + 1 if max_keys is None else int(max_keys)
        table, seq, pos, idx = block_table.contiguous(), row_seq.contiguous(), positions.contiguous(), positions
    per_split = -(-max(keys, 1) // num_splits)
    split_len = -(-per_split // block_n) * block_n  # a whole number of key blocks
    head_blocks = -(-h // block_h)
    part_out = torch.empty((n, h, num_splits, block_r), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n, h, num_splits), dtype=torch.float32, device=q.device)
    ieee = upcast or q.dtype == torch.float32
    _split_kernel[(n, head_blocks, num_splits)](
        q, q_pe, kv, table, seq, pos, idx, part_out, part_lse,
        h, num_splits, keys, split_len, q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), table.stride(0),
        idx.stride(0), float(scale),
        R=r, ROPE=rope, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_H=block_h, BLOCK_N=block_n, PAGE=page_size,
        SPARSE=sparse, UPCAST=upcast, IEEE=ieee)
    # the split count is a runtime argument (one compiled kernel whatever the batch); the lse tile
    # covers at least 16 splits so it changes only past that
    _reduce_kernel[(n, head_blocks)](part_out, part_lse, out, lse, h, num_splits, R=r, BLOCK_R=block_r,
                                     BLOCK_H=block_h, BLOCK_S=max(16, triton.next_power_of_2(num_splits)))
    return out, lse


@triton.jit
def _indexer_kernel(q_ptr, w_ptr, k_ptr, table_ptr, row_seq_ptr, seq_lens_ptr, out_ptr, num_heads, width,
                    stride_qn, stride_qh, stride_wn, stride_table, stride_out,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = tl.arange(0, BLOCK_HI)
    dd = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    d_ok = dd < D
    seq = tl.load(row_seq_ptr + row)
    length = tl.load(seq_lens_ptr + seq)
    inside = (offs < length) & (offs < width)
    page = tl.load(table_ptr + seq * stride_table + offs // PAGE, mask=inside, other=-1).to(tl.int64)
    valid = inside & (page >= 0)
    slot = tl.where(valid, page * PAGE + offs % PAGE, 0)
    k = tl.load(k_ptr + slot[:, None] * D + dd[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + dd[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_HI, BLOCK_D]
    w = tl.load(w_ptr + row * stride_wn + heads, mask=head_ok, other=0.0).to(tl.float32)  # [BLOCK_HI]
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # [BLOCK_HI, BLOCK_N]
    logits = tl.sum(w[:, None] * tl.maximum(s, 0.0), 0)  # [BLOCK_N]
    tl.store(out_ptr + row * stride_out + offs, tl.where(valid, logits, 0.0), mask=offs < width)


def indexer_logits(index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor, block_table: torch.Tensor,
                   row_seq: torch.Tensor, seq_lens: torch.Tensor, width: int, page_size: int, *,
                   block_n: int = 16, upcast: bool = False) -> torch.Tensor:
    """DSA lightning-indexer logits over paged keys: sum_h w[n, h] * relu(q[n, h] . k[s]).

    index_q: [N, Hi, D]; index_w: [N, Hi]; index_k: [slots, D] (a layer's indexer pages flattened);
    block_table [B, P], row_seq [N], seq_lens [B] int → [N, width] float32, 0 at positions past a
    request's length or stored on another rank (callers mask those)."""
    n, hi, d = index_q.shape
    out = torch.empty((n, width), dtype=torch.float32, device=index_q.device)
    if n == 0 or width == 0:
        return out
    q, w, k = index_q.contiguous(), index_w.contiguous(), index_k.contiguous()
    table = block_table.contiguous()
    _indexer_kernel[(n, -(-width // block_n))](
        q, w, k, table, row_seq.contiguous(), seq_lens.contiguous(), out, hi, width, q.stride(0), q.stride(1),
        w.stride(0), table.stride(0), out.stride(0), D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_HI=max(16, triton.next_power_of_2(hi)), BLOCK_N=block_n, PAGE=page_size, UPCAST=upcast,
        IEEE=upcast or q.dtype == torch.float32)
    return out
