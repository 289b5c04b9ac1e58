"""Reproducible numerics: float32 results that do not depend on how a computation was batched.

Why this exists: RL needs the rollout's logprob of a token to equal the trainer's (the GRPO ratio is
exp(trainer - rollout)). Both run this package's model code, but never in the same shapes: the
engine decodes one row per request and shards heads and FFN columns over ranks, the trainer runs
whole padded sequences on full weights. torch's float32 kernels round differently for different
shapes (MKL takes another path below ~12 rows; a softmax over 47 keys and over 48 keys with the last
masked group their partial sums differently), and a trained model amplifies one ulp of difference
in its first layer into ~3e-5 of logprob (glm5-nano after SFT: a 121-wide activation in the
residual stream). Measured on the recipe's checkpoint: engine vs trainer up to 3.2e-5, with most
tokens bit-identical and the rest one rounding apart.

Mode ``"fast"`` (default): float32 kernels as torch picks them.
Mode ``"reproducible"``: every matmul, einsum and reduction of the model accumulates in float64 and
rounds once to the activation dtype. A float64 sum of float32 products is exact up to ~1e-16
relative, so its float32 rounding does not depend on the order the kernel chose: results agree
bit-for-bit across batch sizes, padding, prefill chunking and layouts (except when a value falls
within 1e-16 of a rounding boundary). Partial sums that ranks add together (row-parallel o_proj
and FFN-down outputs, CP's partial attention) stay float64 through the collective (``keep=True``)
and are rounded (``.to(activation dtype)``) after it, so a sharded sum rounds exactly like the
trainer's unsharded one.

The mode is process-wide: the engine sets it on every rank from ``EngineConfig.compute.numerics``, and a
trainer sharing the process computes its logprobs under the same rules. It costs float64 matmul
throughput (about 2x on AVX-512 CPUs); it is meant for CPU runs and parity checks, not GPU serving.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from splash_rollout.models.packed_linear import packed_linear
from splash_rollout.native.small_matmul import MAX_ROWS, small_matmul

NUMERICS_MODES = ("fast", "reproducible")
_accumulate: torch.dtype | None = None  # None: fast mode (each op in its input dtype)


def set_numerics(mode: str) -> None:
    """Select the process-wide mode: ``"fast"`` or ``"reproducible"``."""
    global _accumulate
    if mode not in NUMERICS_MODES:
        raise ValueError(f"numerics: expected one of {NUMERICS_MODES}, got {mode!r}")
    _accumulate = torch.float64 if mode == "reproducible" else None


def numerics_mode() -> str:
    return "fast" if _accumulate is None else "reproducible"


@contextlib.contextmanager
def numerics(mode: str) -> Iterator[None]:
    """Run a block under ``mode``, restoring the previous mode after it."""
    previous = numerics_mode()
    set_numerics(mode)
    try:
        yield
    finally:
        set_numerics(previous)


def acc_dtype(dtype: torch.dtype = torch.float32) -> torch.dtype:
    """Dtype reductions run in: float64 in reproducible mode, else float32 (never below it)."""
    return _accumulate if _accumulate is not None else torch.promote_types(dtype, torch.float32)


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype a partial sum of ``dtype`` activations is kept in until it is complete: float64 in
    reproducible mode, else ``dtype`` itself (what ``linear(..., keep=True)`` returns)."""
    return _accumulate if _accumulate is not None else dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, keep: bool = False) -> torch.Tensor:
    """F.linear; in reproducible mode accumulated in float64. The result has ``weight``'s dtype, or
    stays float64 with ``keep`` (a partial sum that a collective or a later sum completes).
    In fast mode a CPU product of a few rows takes the weight-streaming native kernel, and a float32
    product of more rows oneDNN over the weight packed once (``packed_linear``)."""
    if _accumulate is None:
        few = x.dim() == 2 and x.shape[0] <= MAX_ROWS
        y = small_matmul(x, weight, bias) if few else packed_linear(x, weight, bias)
        return F.linear(x, weight, bias) if y is None else y
    y = F.linear(x.to(_accumulate), weight.to(_accumulate), None if bias is None else bias.to(_accumulate))
    return y if keep else y.to(weight.dtype)


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head product: x [N, H, K] @ weight [H, K, M] -> [N, H, M] (the absorbed W_UK and W_UV); in
    reproducible mode accumulated in float64 and rounded to ``weight``'s dtype. In fast mode few rows
    on the CPU take the weight-streaming native kernel (weight seen as [H, M, K], either stride 1),
    more rows one ``bmm`` over heads; the result may then be stored head-major (a strided view)."""
    if _accumulate is None:
        if x.shape[0] <= MAX_ROWS:
            y = small_matmul(x.transpose(0, 1), weight.transpose(1, 2))  # [H, N, M]
            if y is not None:
                return y.transpose(0, 1)
        # one batched product over heads, the result stored head-major: the same values as the einsum,
        # 1.4x (W_UK) / 1.15x (W_UV) its speed alone at 256 rows x 8 heads float32, but within 1 % on
        # a whole decode step (in-process A/B)
        return torch.bmm(x.transpose(0, 1), weight).transpose(0, 1)
    return einsum("nhk,hkm->nhm", x, weight)


def einsum(equation: str, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Two-operand torch.einsum of activations and a weight; in reproducible mode accumulated in
    float64 and rounded to ``weight``'s dtype."""
    if _accumulate is None:
        return torch.einsum(equation, a, weight)
    return torch.einsum(equation, a.to(_accumulate), weight.to(_accumulate)).to(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict names) that follows the numerics mode. Called as a
    module even for ``keep`` so parameter-gathering hooks (ZeRO-3, FSDP) still run."""

    def forward(self, x: torch.Tensor, keep: bool = False) -> torch.Tensor:
        return linear(x, self.weight, self.bias, keep=keep)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that normalises in the accumulation dtype (row statistics are reductions too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _accumulate is None:
            return super().forward(x)
        acc = _accumulate
        weight = None if self.weight is None else self.weight.to(acc)
        bias = None if self.bias is None else self.bias.to(acc)
        return F.layer_norm(x.to(acc), self.normalized_shape, weight, bias, self.eps).to(x.dtype)
