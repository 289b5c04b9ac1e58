"""RMSNorm as the DeepSeek/GLM checkpoints define it.

The statistic is taken in float32 and the weight multiplies the result after the cast back to the
input dtype, exactly the order transformers uses, so bf16 runs round the same way. Reproducible
numerics (models/numerics.py) take the statistic in float64 instead. Inference under fast numerics
on the CPU takes one native pass that rounds at the same steps (native/fused_rows.py).
"""
from __future__ import annotations

import torch
from torch import nn

from splash_rollout.models.numerics import acc_dtype, numerics_mode
from splash_rollout.native.fused_rows import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if numerics_mode() == "fast":
            fused = rms_norm(x, self.weight, self.eps)
            if fused is not None:
                return fused
        dtype = x.dtype
        xa = x.to(acc_dtype(dtype))  # float32, or float64 in reproducible numerics
        xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xa.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
