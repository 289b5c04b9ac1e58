"""A MoE block's routed experts in one native call (``routed_experts.cpp``), for decode-sized steps.

Through torch, each expert that got rows costs about fifteen small ops (gather, three products,
SiLU, gating product, scatter-add); with a handful of rows per step that dispatch, not the
arithmetic, is the block's cost, and with a few dozen rows per expert torch's matmul is still
far from its large-matrix speed. ``routed_experts`` returns None where the kernel does not apply
(too many rows, another device or dtype, autograd, experts that are not SiLU MLPs with contiguous
weights, no compiler) and the caller loops over experts in torch.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from splash_rollout.native.build import DTYPES, library_or_none

MAX_ROWS = 512
"""Largest number of rows a call takes. Measured (16 experts of 512 x 256, top-2, 2 threads): the
native call is 2.4x the torch loop at 64 rows, 1.7x (float32) / 2.6x (bfloat16) at 256, and even
at 2048 rows (0.9x / 1.0x), where each expert has enough rows for torch's blocked matmul."""

_weights: "weakref.WeakKeyDictionary[nn.ModuleList, list[torch.Tensor] | None]" = weakref.WeakKeyDictionary()


def _expert_weights(experts: nn.ModuleList) -> list[torch.Tensor] | None:
    """gate, up, down weight of each expert in order (the tensors, not their addresses: sleep and
    wake move storage, so addresses are read per call), or None unless every expert is a bias-free
    SiLU MLP with contiguous CPU weights of one dtype and one shape."""
    if experts not in _weights:
        flat: list[torch.Tensor] | None = []
        for e in experts:
            mods = [getattr(e, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
            if any(getattr(m, "weight", None) is None or getattr(m, "bias", None) is not None for m in mods):
                flat = None
                break
            flat += [m.weight for m in mods]
        if flat:
            inter, hidden = flat[0].shape
            shapes = [(inter, hidden), (inter, hidden), (hidden, inter)] * len(experts)
            if any(tuple(w.shape) != shape or w.dtype != flat[0].dtype or w.device.type != "cpu"
                   or not w.is_contiguous() for w, shape in zip(flat, shapes)):
                flat = None
        _weights[experts] = flat
    return _weights[experts]


def routed_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: nn.ModuleList,
                   first_expert: int) -> torch.Tensor | None:
    """sum over slots j of weight[r, j] * expert_{idx[r, j]}(x[r]) for the experts held here, as
    float32 [N, hidden]; x [N, hidden], idx [N, k] int64 global ids, weight [N, k] float32.
    None where the kernel does not apply."""
    n = x.shape[0]
    if (n == 0 or n > MAX_ROWS or x.device.type != "cpu" or x.dtype not in DTYPES or len(experts) == 0
            or (torch.is_grad_enabled() and x.requires_grad) or library_or_none() is None):
        return None
    flat = _expert_weights(experts)
    if flat is None or flat[0].dtype != x.dtype or (torch.is_grad_enabled() and flat[0].requires_grad):
        return None
    inter, hidden = flat[0].shape
    if hidden != x.shape[1]:
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    gate_weight = weight.to(torch.float32).contiguous()
    table = torch.tensor([w.data_ptr() for w in flat], dtype=torch.int64)
    out = torch.empty((n, hidden), dtype=torch.float32)
    code = library_or_none().splash_routed_experts(DTYPES[x.dtype], n, hidden, inter, x.data_ptr(), x.stride(0),
                                            idx.data_ptr(), gate_weight.data_ptr(), idx.shape[1], table.data_ptr(),
                                            len(experts), first_expert, out.data_ptr())
    if code != 0:
        raise RuntimeError(f"routed_experts: the native kernel refused {x.dtype} (code {code})")
    return out
