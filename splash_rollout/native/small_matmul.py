"""Products with few activation rows, on the CPU, through ``small_matmul.cpp``.

A decode step multiplies a handful of rows by every weight of the model, so it is bound by reading
the weights. torch's CPU matmul reads a weight at ~5 GB/s in that regime where a plain stream
reaches ~30 GB/s (measured on the development machine: a [4, 512] x [512, 256] float32 product
with the weight out of cache takes 91 us); the native kernel reads each weight once, in storage
order. ``small_matmul`` returns None whenever it does not apply (too many rows, another device or
dtype, autograd needed, no compiler), and the caller takes torch's path: the choice is made per
call, the results agree to float32 rounding (both accumulate in float32 and round once).
"""
from __future__ import annotations

import torch

from splash_rollout.native.build import DTYPES, library_or_none

MAX_ROWS = 16
"""Largest number of activation rows sent to the kernel; above it torch's blocked matmul is faster
(it reuses each loaded weight across more rows than the kernel's 4-row register tile)."""


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x [..., M, K] times this weight: CPU, float32/bfloat16 alike,
    at most MAX_ROWS rows per weight, and nothing that needs a gradient."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and x.dtype in DTYPES and x.shape[-2] <= MAX_ROWS and x.shape[-2] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and library_or_none() is not None)  # none: torch's path, silently (a speed choice)


def small_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """y [B, M, N] = x [B, M, K] @ weight [B, N, K]^T (+ bias [N]), or None where the kernel does not
    apply. ``weight`` may be strided: its last dim (nn.Linear's [out, in]) or its middle dim (an
    [in, out] matrix seen transposed) must have stride 1. 2-D x [M, K] with weight [N, K] gives [M, N]."""
    if not applies(x, weight):
        return None
    flat = x.dim() == 2
    if flat != (weight.dim() == 2) or (not flat and (x.dim() != 3 or weight.dim() != 3 or weight.shape[0] != x.shape[0])):
        return None
    m, k = x.shape[-2:]
    n = weight.shape[-2]
    if weight.shape[-1] != k or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)):
        return None
    if weight.stride(-1) != 1 and weight.stride(-2) != 1:
        weight = weight.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if flat:
        b, (x_sb, w_sb) = 1, (0, 0)
        y = torch.empty((m, n), dtype=x.dtype)
    else:
        b, x_sb, w_sb = x.shape[0], x.stride(0), weight.stride(0)
        y = torch.empty((b, m, n), dtype=x.dtype)
    code = library_or_none().splash_small_matmul(
        DTYPES[x.dtype], b, m, n, k, x.data_ptr(), x_sb, x.stride(-2), weight.data_ptr(), w_sb, weight.stride(-2),
        weight.stride(-1), None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0) if not flat else 0,
        y.stride(-2))
    if code != 0:
        raise RuntimeError(f"small_matmul: the native kernel refused {x.dtype} x {tuple(weight.stride())} (code {code})")
    return y
