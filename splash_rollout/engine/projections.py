"""ProjectionShard: one layer's switchable attention projections (Q-B, KV-B, O) for a head slice.

A layout decides whether a rank holds these for all H heads (DP-attention, CP) or for its H/T heads
(TP, DOP). The executors compute through a shard, never through the full ``nn.Linear`` modules, so
the bytes resident on a rank are exactly the ownership model's W_A or W_A/T, and a switch only has
to replace the shard (discard = slice what is kept, all-gather = fetch the missing heads).
Weight layouts follow HF: q_b rows are head-major [H*(nope+rope)], kv_b rows [H*(nope+v)], o_proj
columns [H*v]; a head slice is a contiguous block of each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash_rollout.models.numerics import head_matmul, linear
from splash_rollout.models.rope import apply_rope


@dataclass
class ProjectionShard:
    heads: slice
    """Global head indices this shard covers."""
    q_b: torch.Tensor
    """[h*(nope+rope), q_lora_rank] (or [h*(nope+rope), hidden] without a query LoRA)."""
    kv_b: torch.Tensor
    """[h*(nope+v), kv_lora_rank]."""
    o: torch.Tensor
    """[hidden, h*v]."""

    @property
    def num_heads(self) -> int:
        return self.heads.stop - self.heads.start

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q_b, self.kv_b, self.o))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q_b": self.q_b, "kv_b": self.kv_b, "o": self.o}

    def full_parts(self, attn, prefix: str) -> list[tuple[str, torch.Tensor, tuple]]:
        """(full tensor name, this shard's tensor, the part of the full tensor it holds) for the layer
        whose attention names start with ``prefix`` (e.g. ``model.layers.0.self_attn``): head-major
        row blocks of Q-B and KV-B, a column block of O."""
        a, b = self.heads.start, self.heads.stop
        qk, kvd, v = attn.nope_dim + attn.rope_dim, attn.nope_dim + attn.v_dim, attn.v_dim
        q_name = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
        return [(f"{prefix}.{q_name}.weight", self.q_b, (slice(a * qk, b * qk),)),
                (f"{prefix}.kv_b_proj.weight", self.kv_b, (slice(a * kvd, b * kvd),)),
                (f"{prefix}.o_proj.weight", self.o, (slice(None), slice(a * v, b * v)))]

    # ---- compute ---------------------------------------------------------------------------------
    def project_q(self, attn, x: torch.Tensor, positions: torch.Tensor):
        """x [N, hidden] -> (q_nope [N,h,nope], q_pe [N,h,rope] roped, q_a [N,q_lora] or None)."""
        if attn.q_lora_rank is None:
            q_a, q = None, linear(x, self.q_b)
        else:
            q_a = attn.q_a_layernorm(attn.q_a_proj(x))
            q = linear(q_a, self.q_b)
        q = q.view(-1, self.num_heads, attn.nope_dim + attn.rope_dim)
        cos, sin = attn._rotary[0].cos_sin(positions, q.dtype)
        q_pe = apply_rope(q[..., attn.nope_dim:], cos, sin, attn.rope_interleave)
        return q[..., : attn.nope_dim], q_pe, q_a

    def _kv_b(self, attn) -> torch.Tensor:  # [h, nope + v, r]
        return self.kv_b.view(self.num_heads, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)

    def absorb(self, attn, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, h, nope] -> q_nope_abs [N, h, kv_lora] (W_UK absorbed)."""
        return head_matmul(q_nope, self._kv_b(attn)[:, : attn.nope_dim, :])

    def values(self, attn, out_latent: torch.Tensor) -> torch.Tensor:
        """out_latent [N, h, kv_lora] -> per-head values [N, h, v] (W_UV, the absorbed form's last step)."""
        w_uv = self._kv_b(attn)[:, attn.nope_dim:, :].transpose(1, 2)  # [h, r, v]
        return head_matmul(out_latent, w_uv)

    def o_project(self, attn, values: torch.Tensor) -> torch.Tensor:
        """values [N, h, v] -> [N, hidden]: this shard's o_proj columns (a partial sum over heads when
        the shard is H/T of them: then it stays in the accumulation dtype, and the caller rounds it
        after the all-reduce)."""
        return linear(values.reshape(values.shape[0], -1), self.o, keep=self.num_heads < attn.num_heads)

    def output(self, attn, out_latent: torch.Tensor) -> torch.Tensor:
        """out_latent [N, h, kv_lora] -> [N, hidden]: W_UV then o_proj (see ``o_project``)."""
        return self.o_project(attn, self.values(attn, out_latent))


def slice_projections(attn, heads: slice, q_b: torch.Tensor | None = None, kv_b: torch.Tensor | None = None,
                      o: torch.Tensor | None = None) -> ProjectionShard:
    """The shard for ``heads`` cut out of full weights (the module's, unless given). Copies, so the
    full tensors can be freed; a full-head slice of the module's own weights is a view."""
    q_b = attn.q_b_proj.weight if q_b is None and attn.q_lora_rank is not None else q_b
    q_b = attn.q_proj.weight if q_b is None else q_b
    kv_b = attn.kv_b_proj.weight if kv_b is None else kv_b
    o = attn.o_proj.weight if o is None else o
    qk, kvd, v = attn.nope_dim + attn.rope_dim, attn.nope_dim + attn.v_dim, attn.v_dim
    a, b = heads.start, heads.stop
    if (a, b) == (0, attn.num_heads):
        return ProjectionShard(heads, q_b.detach(), kv_b.detach(), o.detach())
    return ProjectionShard(heads, q_b[a * qk: b * qk].detach().clone(), kv_b[a * kvd: b * kvd].detach().clone(),
                           o[:, a * v: b * v].detach().clone())


def drop_full_projections(attn) -> None:
    """Free the module's full Q-B / KV-B / O weights (the shards hold what this rank keeps)."""
    for name in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj"):
        if hasattr(attn, name) and getattr(attn, name) is not None:
            setattr(attn, name, None)
