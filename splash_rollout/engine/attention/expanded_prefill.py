"""Prefill chunks in expanded form: per-head keys and values instead of the absorbed latent.

Why it exists: absorbed MLA (what every backend computes) scores each query head against the
latent row of every key (kv_lora + rope wide, 576 on DeepSeek-V3-shaped models) and accumulates a
kv_lora-wide output, then pays W_UK before and W_UV after, per query. The expanded form pays kv_b
once per key instead (per-head k_nope and v from the latent) and attends with qk-wide keys and
v-wide values (128 and 64 on the benchmark checkpoint): ~5.7x fewer attention multiply-adds per
(query, head, key). A prefill chunk has as many queries as new keys, so its projections cost the
same in both forms and the attention decides; a decode row has one query against a long history,
and absorbed stays far cheaper. ``scheduling.cost_model.expanded_is_cheaper`` is that count, per
request (the cost model prices the same choice).

The expanded form rounds differently from the absorbed one (k_nope is rounded before the dot
product), so it is used only under ``fast`` numerics, and only for requests whose whole history is
stored on this rank (never for CP's split histories). On the CPU the attention is one native call
(``native/expanded_attention.cpp``: keys and values read where kv_b's product left them, only the
keys a row may see scored); elsewhere ``F.scaled_dot_product_attention`` over padded copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splash_rollout.engine.forward_batch import ForwardBatch
from splash_rollout.engine.kv_pool import KVPool
from splash_rollout.models.numerics import linear, numerics_mode
from splash_rollout.native.expanded_attention import expanded_attention as native_expanded
from splash_rollout.scheduling.cost_model import expanded_is_cheaper


@dataclass(frozen=True)
class FormPlan:
    """Which requests of a step run in which form (indices into the batch's B, ascending)."""

    absorbed: list[int]
    expanded: list[int]


def plan_forms(attn, batch: ForwardBatch, enabled: bool) -> FormPlan:
    """The step's split (the same for every layer, so cached on the batch). ``enabled``: the
    backend takes expanded prefill; the numerics mode and where each history lives decide the rest."""
    if "prefill_forms" not in batch.scratch:
        everything = list(range(batch.num_seqs))
        plan = FormPlan(everything, [])
        if enabled and numerics_mode() == "fast" and any(k > 1 for k in batch.num_new):
            local = batch.key_stored().sum(dim=1).eq(batch.seq_lens).tolist()  # whole history stored here
            lens = batch.seq_lens.tolist()
            dims = (attn.kv_lora_rank, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.index_topk)
            expanded = [b for b in everything if local[b] and batch.num_new[b] > 1
                        and bool(expanded_is_cheaper(batch.num_new[b], lens[b], *dims))]
            taken = set(expanded)
            plan = FormPlan([b for b in everything if b not in taken], expanded)
        batch.scratch["prefill_forms"] = plan
    return batch.scratch["prefill_forms"]


def _groups(batch: ForwardBatch, seqs: list[int]) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Requests with the same (new rows Q, history length S), one attention call each:
    (Q, S, rows [g*Q] int64 of the batch, history slots [g*S] int64). The same for every layer of
    the step, so cached on the batch."""
    if "expanded_groups" not in batch.scratch:
        lens, starts = batch.seq_lens.tolist(), batch.query_start
        by_shape: dict[tuple[int, int], list[int]] = {}
        for b in seqs:
            by_shape.setdefault((batch.num_new[b], lens[b]), []).append(b)
        slots_all, _ = batch.key_slots()
        groups = []
        for (q_len, s_len), group in by_shape.items():
            idx = torch.tensor(group, dtype=torch.int64, device=batch.device)
            first = torch.tensor([starts[b] for b in group], dtype=torch.int64, device=batch.device)
            rows = (first[:, None] + torch.arange(q_len, device=batch.device)[None, :]).flatten()
            groups.append((q_len, s_len, rows, slots_all[idx, :s_len].flatten()))
        batch.scratch["expanded_groups"] = groups
    return batch.scratch["expanded_groups"]


def expanded_attention(attn, kv_b: torch.Tensor, pool: KVPool, q_nope: torch.Tensor, q_pe: torch.Tensor,
                       batch: ForwardBatch, seqs: list[int], selected: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of requests ``seqs`` in expanded form.

    kv_b: [h*(nope+v), kv_lora] (the shard's heads); q_nope [N, h, nope], q_pe [N, h, rope] roped,
    the whole batch's rows; selected: Bool [N, S] DSA selection or None (causal). The requests' KV
    must already be in the pool. Returns (rows [n] int64 of the batch, values [n, h, v])."""
    h, nope, v = q_nope.shape[1], attn.nope_dim, attn.v_dim
    all_rows, all_values = [], []
    for q_len, s_len, rows, slots in _groups(batch, seqs):
        g = rows.numel() // q_len
        c_kv, k_pe = pool.read_kv(attn.layer_idx, slots)  # [g*S, r], [g*S, rope]
        kv = linear(c_kv.to(q_nope.dtype), kv_b).view(g * s_len, h, nope + v)
        k_pe = k_pe.to(q_nope.dtype)
        out = native_expanded(q_nope, q_pe, rows, kv, k_pe, q_len, s_len, v, selected, attn.softmax_scale)
        if out is None:
            out = _torch_attention(attn, q_nope, q_pe, rows, kv.view(g, s_len, h, nope + v), k_pe, q_len, s_len,
                                   selected)
        all_rows.append(rows)
        all_values.append(out)
    return torch.cat(all_rows), torch.cat(all_values)


def _torch_attention(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor,
                     k_pe: torch.Tensor, q_len: int, s_len: int, selected: torch.Tensor | None) -> torch.Tensor:
    """The same attention through ``F.scaled_dot_product_attention`` (where the native kernel does
    not apply): kv [g, S, h, nope + v], k_pe [g*S, rope] -> [g*Q, h, v]. Its CPU flash kernel wants
    one head width for q, k and v, so the narrower side is zero-padded (zeros change neither the
    scores nor the values kept)."""
    g, _, h, _ = kv.shape
    nope, rope, v = attn.nope_dim, attn.rope_dim, attn.v_dim
    qk = nope + rope
    width = max(qk, v)
    k = torch.cat([kv[..., :nope], k_pe.view(g, s_len, 1, rope).expand(g, s_len, h, rope)], -1)
    q = torch.cat([q_nope[rows], q_pe[rows]], -1).view(g, q_len, h, qk)
    values = kv[..., nope:]
    if qk < width:
        q, k = F.pad(q, (0, width - qk)), F.pad(k, (0, width - qk))
    if v < width:
        values = F.pad(values, (0, width - v))
    if selected is not None:
        mask = selected[rows, :s_len].view(g, 1, q_len, s_len)
    elif q_len == s_len:
        mask = None  # a whole prompt: plain causal
    else:  # a chunk after earlier positions: row i sees keys <= s_len - q_len + i
        mask = torch.ones(q_len, s_len, dtype=torch.bool, device=q.device).tril(s_len - q_len)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, is_causal=mask is None,
                                         scale=attn.softmax_scale)  # [g, h, Q, width]
    return out.transpose(1, 2).reshape(g * q_len, h, width)[..., :v]
