"""A MoE block's routed experts on the GPU in two Triton launches, with no host sync and fixed shapes.

Why: the torch path loops over the experts that got rows (``torch.unique(...).tolist()``): a host
sync per MoE layer, a data-dependent number of launches, nothing a CUDA graph can replay. Here the
step's (row, slot) assignments are sorted by expert on the device and laid out in blocks of
``BLOCK_M`` assignments, each block one expert's (an expert's segment is padded to a whole number
of blocks); the layout's size is bounded by ``N k + E (BLOCK_M - 1)`` whatever the routing, so every
shape depends only on N. Stage 1 runs one program per (block, slice of the intermediate dim):
``silu(x W_gate^T) * (x W_up^T)`` for its block's rows. Stage 2 one per (block, slice of the hidden
dim): ``h W_down^T`` times the row's routing weight, written per assignment; the k slots of a row are
summed in a fixed order at the end (deterministic, no atomics). Blocks past the last expert's
segment and assignments of experts held elsewhere (expert parallelism) do nothing.

The experts' weights are read stacked ([E, I, H] gate and up, [E, H, I] down): the engine places a
rank's experts as views of such stacks (``stack_experts``), so no copy is made. Accumulation is
float32; the intermediate is kept in float32 (the torch path rounds it to the activation dtype).
Runs on CUDA, and on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _up_kernel(x_ptr, w_gate_ptr, w_up_ptr, rows_ptr, block_expert_ptr, h_ptr, num_experts, top_k, hidden, inter,
               num_assign, stride_x, stride_we, stride_wi, stride_h,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
               IEEE: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < num_experts:
        offs = block * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(rows_ptr + offs)  # [BLOCK_M]; num_assign where padding
        valid = assign < num_assign
        token = tl.where(valid, assign // top_k, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_base = expert.to(tl.int64) * stride_we
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            x = tl.load(x_ptr + token[:, None] * stride_x + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w_gate_ptr + w_base + n[:, None] * stride_wi + kk[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            wu = tl.load(w_up_ptr + w_base + n[:, None] * stride_wi + kk[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            if IEEE:
                gate += tl.dot(x, tl.trans(wg), input_precision="ieee")
                up += tl.dot(x, tl.trans(wu), input_precision="ieee")
            else:
                gate += tl.dot(x, tl.trans(wg))
                up += tl.dot(x, tl.trans(wu))
        h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
        tl.store(h_ptr + offs[:, None].to(tl.int64) * stride_h + n[None, :], h, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_down_ptr, rows_ptr, block_expert_ptr, gate_weight_ptr, out_ptr, num_experts, hidden,
                 inter, num_assign, stride_h, stride_we, stride_wh, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < num_experts:
        offs = block * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(rows_ptr + offs)
        valid = assign < num_assign
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_base = expert.to(tl.int64) * stride_we
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter
            h = tl.load(h_ptr + offs[:, None].to(tl.int64) * stride_h + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)  # float32
            w = tl.load(w_down_ptr + w_base + n[:, None] * stride_wh + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_K]
            if IEEE:
                acc += tl.dot(h, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(h, tl.trans(w.to(tl.float32)))
        g = tl.load(gate_weight_ptr + tl.where(valid, assign, 0), mask=valid, other=0.0)  # [BLOCK_M] float32
        safe = tl.where(valid, assign, 0).to(tl.int64)
        tl.store(out_ptr + safe[:, None] * stride_out + n[None, :], acc * g[:, None], mask=valid[:, None] & n_ok[None, :])


def block_layout(idx: torch.Tensor, first_expert: int, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's assignments sorted by expert, in blocks of ``block_m``, on the device with no host
    sync: (rows [L] int64: assignment ``r * k + j`` at each place, ``N k`` where padding; block_expert
    [L / block_m] int64: the local expert of each block, ``num_experts`` for blocks past the last
    segment). L = ``N k + E (block_m - 1)`` rounded up to a block: fixed for a given N.
    idx: [N, k] global expert ids; ids outside [first_expert, first_expert + E) are held elsewhere."""
    device = idx.device
    assignments = idx.numel()
    local = idx.reshape(-1) - first_expert
    expert = torch.where((local >= 0) & (local < num_experts), local, torch.full_like(local, num_experts))  # [M]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, expert, torch.ones_like(expert))[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    seg_start = torch.cumsum(padded, 0) - padded  # [E]
    first_sorted = torch.cumsum(counts, 0) - counts  # [E] where each expert starts in sorted order
    order = torch.argsort(expert, stable=True)  # [M], experts held elsewhere last
    sorted_expert = expert[order]
    held = sorted_expert < num_experts
    e = torch.where(held, sorted_expert, torch.zeros_like(sorted_expert))
    length = -(-(assignments + num_experts * (block_m - 1)) // block_m) * block_m
    place = torch.where(held, seg_start[e] + torch.arange(assignments, device=device) - first_sorted[e],
                        torch.full_like(e, length))  # [M]; past the end: dropped
    rows = torch.full((length + 1,), assignments, dtype=torch.int64, device=device)
    rows[place] = order
    seg_end = seg_start + padded
    starts = torch.arange(0, length, block_m, device=device)
    block_expert = torch.searchsorted(seg_end, starts, right=True)  # [L / block_m]; num_experts past the end
    return rows[:length], block_expert


def fused_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, first_expert: int = 0, block_m: int = 16, block_n: int = 32,
                  block_k: int = 32) -> torch.Tensor:
    """sum over slots j of weight[r, j] * expert_{idx[r, j]}(x[r]) for the experts stacked here, as
    float32 [N, hidden]. x [N, hidden]; idx [N, k] int64 global ids; weight [N, k]; w_gate / w_up
    [E, I, hidden], w_down [E, hidden, I] (contiguous in their last two dims), expert e of the stacks
    being global expert ``first_expert + e``."""
    n, hidden = x.shape
    experts, inter, _ = w_gate.shape
    k = idx.shape[1]
    out = torch.zeros((n * k, hidden), dtype=torch.float32, device=x.device)
    if n == 0:
        return out.view(n, k, hidden).sum(1)
    rows, block_expert = block_layout(idx, first_expert, experts, block_m)
    h = torch.empty((rows.shape[0], inter), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    gate_weight = weight.reshape(-1).to(torch.float32).contiguous()
    upcast = os.environ.get("TRITON_INTERPRET", "0") == "1" or x.dtype != w_gate.dtype  # the interpreter's bf16 is wrong
    ieee = upcast or x.dtype == torch.float32  # float32 products in IEEE precision (no TF32), like the torch path
    blocks = block_expert.shape[0]
    _up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w_gate, w_up, rows, block_expert, h, experts, k, hidden, inter, n * k, x.stride(0), w_gate.stride(0),
        w_gate.stride(1), h.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, IEEE=ieee)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w_down, rows, block_expert, gate_weight, out, experts, hidden, inter, n * k, h.stride(0), w_down.stride(0),
        w_down.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=True)
    return out.view(n, k, hidden).sum(1)
