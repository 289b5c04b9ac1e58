"""Decoupled rotary embedding for MLA: frequencies (plain or YaRN), the softmax scale, and the two
layouts the checkpoints use.

* ``interleaved``: DeepSeek stores the rope dims as pairs (2i, 2i+1). The rotated result is written
  de-interleaved ([evens | odds]), as transformers does; q and k get the same permutation so dot
  products are unchanged, and our cached ``k_pe`` stays bit-comparable with transformers'.
* half-split (``rotate_half``): pairs (i, i + d/2). Used by DeepSeek-V3.2's indexer and by
  DeepSeek-V3 checkpoints with ``rope_interleave: false``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from splash_rollout.models.config import ModelConfig
from splash_rollout.native.fused_rows import rope


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope/2] float32 on the CPU -- also when a model is built on the meta device: it is
    not a parameter -- and the attention_factor multiplying cos and sin)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    rope_type = _rope_type(config.rope_scaling)
    if rope_type == "default":
        return 1.0 / (base ** exponents), 1.0
    if rope_type != "yarn":
        raise NotImplementedError(f"rope_scaling: only 'yarn' is supported, got {rope_type!r}")
    s = dict(config.rope_scaling or {})
    original = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = config.qk_head_dim ** -0.5
    if _rope_type(config.rope_scaling) != "default":
        s = config.rope_scaling or {}
        if s.get("mscale_all_dim"):
            m = _yarn_mscale(s["factor"], s["mscale_all_dim"])
            scale = scale * m * m
    return scale


def _version(t: torch.Tensor) -> int:
    """In-place writes bump a tensor's version; inference tensors keep none (the engine builds a
    step's positions once and never writes them)."""
    return 0 if t.is_inference() else t._version


class RotaryEmbedding(nn.Module):
    """Holds inv_freq; ``cos_sin(positions)`` gives the per-pair angles' cos and sin."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(config)
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round the frequencies.
        self.inv_freq = inv_freq  # [rope/2] float32
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._last: tuple = (None, -1, None, None)  # (positions, its version, dtype, (cos, sin))

    def forget(self) -> None:
        """Drop the kept answer: the next ``cos_sin`` computes (a forward that a CUDA graph records must
        compute its own, not reuse one from before the capture)."""
        self._last = (None, -1, None, None)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int -> (cos, sin) each [N, rope/2] in ``dtype``. Every layer of a step asks
        with the same positions tensor, so the last answer is kept (keyed by identity and version)."""
        last, version, last_dtype, result = self._last
        if positions is last and _version(positions) == version and dtype == last_dtype:
            return result
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        result = cos.to(dtype), sin.to(dtype)
        self._last = (positions, _version(positions), dtype, result)
        return result


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [N, d] or [N, H, d]; cos/sin [N, d/2]. Returns the rotated x, same shape, layout [a | b].
    On the CPU without autograd one native pass computes it, bit for bit the same."""
    fused = rope(x, cos, sin, interleaved)
    if fused is not None:
        return fused
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
