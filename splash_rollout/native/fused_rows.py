"""RMSNorm and the rotary embedding in one native pass each (``fused_rows.cpp``), for inference.

Through torch an RMSNorm of a decode step's rows is six to eight small kernels and a rotation seven,
each with its dispatch, its temporary and (above a few thousand elements) an OpenMP barrier: 13 %
of a 4-row decode step of the DeepSeek-V3-shaped benchmark model went to the norms alone. The
kernels round exactly where the torch expressions round (see the C++ file), so only the norm's sum
of squares differs in order. Both functions return None where they do not apply (another device or
dtype, mixed dtypes, a gradient needed, no compiler) and the caller takes its torch expression;
callers use them under fast numerics only.
"""
from __future__ import annotations

import torch

from splash_rollout.native.build import DTYPES, library_or_none


def _no_grad_needed(*tensors: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * round(x * rsqrt(mean(x^2) + eps)) for x [..., dim] and weight [dim] of one dtype
    (float32 or bfloat16, statistic in float32); a new contiguous tensor shaped like x, or None."""
    dim = x.shape[-1] if x.dim() else 0
    if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype not in DTYPES or weight.dtype != x.dtype
            or weight.shape != (dim,) or x.numel() == 0 or not _no_grad_needed(x, weight)):
        return None
    lib = library_or_none()
    if lib is None:
        return None
    rows = x.reshape(-1, dim)  # a view where x's rows are evenly spaced
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype)
    code = lib.splash_rms_norm(DTYPES[x.dtype], rows.shape[0], dim, rows.data_ptr(), rows.stride(0),
                               weight.data_ptr(), float(eps), out.data_ptr())
    if code != 0:
        raise RuntimeError(f"rms_norm: the native kernel refused {x.dtype} (code {code})")
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """The rotation of models/rope.py's apply_rope: x [N, d] or [N, H, d] (elements contiguous),
    cos / sin [N, d/2], all one dtype; a new contiguous tensor in layout [a | b], or None."""
    if x.dim() not in (2, 3) or x.numel() == 0:
        return None
    n, d = x.shape[0], x.shape[-1]
    if (x.device.type != "cpu" or x.dtype not in DTYPES or d % 2 or cos.dtype != x.dtype or sin.dtype != x.dtype
            or cos.shape != (n, d // 2) or sin.shape != (n, d // 2) or cos.device.type != "cpu"
            or not _no_grad_needed(x, cos, sin)):
        return None
    lib = library_or_none()
    if lib is None:
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    heads = x.shape[1] if x.dim() == 3 else 1
    head_stride = x.stride(1) if x.dim() == 3 else d
    out = torch.empty(x.shape, dtype=x.dtype)
    code = lib.splash_rope(DTYPES[x.dtype], n, heads, d, x.data_ptr(), x.stride(0), head_stride, cos.data_ptr(),
                           sin.data_ptr(), int(interleaved), out.data_ptr())
    if code != 0:
        raise RuntimeError(f"rope: the native kernel refused {x.dtype} (code {code})")
    return out
