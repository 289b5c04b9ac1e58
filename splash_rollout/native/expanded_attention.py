"""Prefill attention in expanded form in one native call (``expanded_attention.cpp``).

Through torch the expanded form concatenated each head's k_nope with the shared rope key, padded
the values to the query width (the CPU flash kernel wants one head width) and then computed every
score of a causal block, masked or not: on the benchmark model 8/3 of the needed work plus three
key- and value-sized copies per layer. The kernel reads kv_b's output and the rope keys in place,
scores only the keys a tile of rows may see, and sums values at their own width.
``expanded_attention`` returns None where it does not apply (another device or dtype, mixed dtypes,
a gradient needed, no compiler) and the caller takes the torch path; fast numerics only (the
caller's rule for the expanded form).
"""
from __future__ import annotations

import torch

from splash_rollout.native.build import DTYPES, library_or_none


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor,
                       k_pe: torch.Tensor, q_len: int, s_len: int, v_dim: int, selected: torch.Tensor | None,
                       scale: float) -> torch.Tensor | None:
    """Causal (or DSA-selected) attention of ``g = rows.numel() // q_len`` requests, each with q_len
    query rows that are the last of its s_len keys.

    q_nope [N, h, nope], q_pe [N, h, rope]: the batch's queries (last dim contiguous); rows
    [g * q_len] int64: the batch row of each query, request by request; kv [g * s_len, h, nope + v]:
    kv_b's output per key (k_nope then v per head); k_pe [g * s_len, rope]: the rope key every head
    shares; selected: Bool [N, >= s_len] (a row sees the keys it selected) or None (causal).
    Returns [g * q_len, h, v] in q's dtype, or None."""
    tensors = (q_nope, q_pe, kv, k_pe)
    if (q_nope.dtype not in DTYPES or any(t.dtype != q_nope.dtype or t.device.type != "cpu" for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    if selected is not None and (selected.dtype not in (torch.bool, torch.uint8) or selected.device.type != "cpu"
                                 or selected.dim() != 2 or selected.shape[0] != q_nope.shape[0]
                                 or selected.shape[1] < s_len):
        raise ValueError(f"expanded_attention: selected must be a CPU bool / uint8 [{q_nope.shape[0]}, >= {s_len}] "
                         f"(one row per batch row, a column per key), got {selected.dtype} {tuple(selected.shape)}")
    lib = library_or_none()
    if lib is None:
        return None
    heads, nope = q_nope.shape[1:]
    rope = q_pe.shape[-1]
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    kv, k_pe = kv.contiguous(), k_pe.contiguous()
    rows = rows.to(torch.int64).contiguous()
    groups = rows.numel() // q_len
    if kv.shape != (groups * s_len, heads, nope + v_dim) or k_pe.shape != (groups * s_len, rope):
        raise ValueError(f"expanded_attention: kv {tuple(kv.shape)} / k_pe {tuple(k_pe.shape)} do not hold "
                         f"{groups} x {s_len} keys of {heads} heads (nope {nope} + v {v_dim}, rope {rope})")
    sel = None if selected is None else selected.contiguous()
    sel = sel.view(torch.uint8) if sel is not None and sel.dtype == torch.bool else sel  # same bytes, no copy
    out = torch.empty((rows.numel(), heads, v_dim), dtype=q_nope.dtype)
    code = lib.splash_expanded_attention(
        DTYPES[q_nope.dtype], groups, q_len, s_len, heads, nope, rope, v_dim, q_nope.data_ptr(), q_nope.stride(0),
        q_nope.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1), rows.data_ptr(), kv.data_ptr(),
        k_pe.data_ptr(), None if sel is None else sel.data_ptr(), 0 if sel is None else sel.stride(0), float(scale),
        out.data_ptr())
    if code != 0:
        raise RuntimeError(f"expanded_attention: the native kernel refused {q_nope.dtype} (code {code})")
    return out
