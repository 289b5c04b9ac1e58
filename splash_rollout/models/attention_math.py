"""The one place the MLA attention and DSA selection math lives.

The training forward (models/mla.py) and the engine's paged backends call these functions, so the
trainer's logprobs and the rollout's agree by construction. The functions work on one request
(queries [N, ...] against that request's keys [S, ...]) or on requests padded into a batch.

All scores are computed in float32 whatever the input dtype (float64 under reproducible numerics,
models/numerics.py); outputs come back in the input dtype and ``lse`` in float32, unless the caller
asks for a ``partial`` result that other ranks' parts complete (then both stay in the accumulation
dtype until ``merge_partial_attention`` rounds once).
"""
from __future__ import annotations

import torch

from splash_rollout.models.numerics import acc_dtype


def absorbed_attention(
    q_nope_abs: torch.Tensor,  # [N, H, r]  q_nope already multiplied by W_UK
    q_pe: torch.Tensor,  # [N, H, rope] roped
    c_kv: torch.Tensor,  # [S, r] normed latent
    k_pe: torch.Tensor,  # [S, rope] roped
    allowed: torch.Tensor,  # [N, S] bool
    scale: float,
    partial: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out_latent [N, H, r], lse [N, H] float32, natural log of the scaled logits' sum-exp);
    with ``partial`` both in the accumulation dtype (``merge_partial_attention`` finishes them).

    out_latent = softmax(scale * (q_nope_abs . c_kv + q_pe . k_pe)) @ c_kv over the allowed keys.
    A row with no allowed key gives zeros and lse = -inf, so partial results merge exactly.

    When every row allows at most a quarter of the keys (a DSA top-k selection over a long history)
    the allowed keys are gathered per row and only those are scored: O(N·H·k) instead of O(N·H·S).
    The gathered keys keep their position order, so the result does not depend on S (padding).
    """
    keys = allowed.sum(dim=1)
    widest = int(keys.max()) if keys.numel() else 0
    if allowed.shape[1] >= SPARSE_MIN_KEYS and 4 * widest <= allowed.shape[1]:
        index, valid = allowed_index(allowed, keys, widest)
        out, lse = _attend(q_nope_abs, q_pe, c_kv[index], k_pe[index], valid, scale, True)
    else:
        out, lse = _attend(q_nope_abs, q_pe, c_kv, k_pe, allowed[:, None, :], scale, False)
    if partial:
        return out, lse
    return out.to(q_nope_abs.dtype), lse.float()


SPARSE_MIN_KEYS = 64
"""Histories shorter than this are always attended densely (gathering does not pay)."""


def allowed_index(allowed: torch.Tensor, keys: torch.Tensor | None = None, widest: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of each row's allowed keys, in increasing order, padded:
    (index [N, K] int64 (padding points at key 0), valid [N, 1, K] bool) with K = the widest row."""
    n = allowed.shape[0]
    keys = allowed.sum(dim=1) if keys is None else keys
    widest = int(keys.max()) if widest is None else widest
    row, col = allowed.nonzero(as_tuple=True)  # row-major: each row's keys in position order
    first = torch.cumsum(keys, 0) - keys  # [N] offset of each row's first key in ``col``
    slot = torch.arange(row.numel(), device=allowed.device) - first[row]
    index = torch.zeros(n, widest, dtype=torch.long, device=allowed.device)
    valid = torch.zeros(n, widest, dtype=torch.bool, device=allowed.device)
    index[row, slot] = col
    valid[row, slot] = True
    return index, valid[:, None, :]


def first_allowed(allowed: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``allowed_index`` at a fixed width, with no host sync: the first ``width`` allowed positions of
    each row in increasing order (index [N, K] int64, 0 where padding; valid [N, 1, K] bool),
    K = min(width, S). Every row must allow at most ``width`` keys (a DSA selection allows at most its
    top-k); more would be cut."""
    n, s = allowed.shape
    k = min(width, s)
    pos = torch.arange(s, device=allowed.device)
    earlier_first = torch.where(allowed, s - pos, torch.zeros_like(pos))  # [N, S]: allowed keys > 0, earlier larger
    top = earlier_first.topk(k, dim=1, sorted=True).values  # [N, K]
    valid = top > 0
    return torch.where(valid, s - top, torch.zeros_like(top)), valid[:, None, :]


def _attend(q_nope_abs, q_pe, c, k_pe, visible, scale: float, gathered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of absorbed queries: ``c`` [S, r] and ``k_pe`` [S, rope] shared by every
    row, or (``gathered``) [N, K, r] / [N, K, rope] per row; ``visible`` broadcasts to the [N, H, S|K]
    logits. Everything runs in the accumulation dtype; (out, lse) come back in it."""
    keys = "nk" if gathered else "s"
    return softmax_attention(q_nope_abs, q_pe, c, k_pe, visible, scale, f"nhr,{keys}r->nh{keys[-1]}")


def softmax_attention(q_nope_abs, q_pe, c, k_pe, visible, scale: float, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The one softmax-attention kernel of absorbed MLA queries, for any batching of rows and keys.

    ``spec`` is the einsum of the latent scores, e.g. ``"nhr,sr->nhs"`` (rows share keys),
    ``"nhr,nkr->nhk"`` (keys gathered per row) or ``"bqhr,bsr->bqhs"`` (requests padded to a
    common query and key length); the rope scores and the output follow the same index letters.
    ``visible`` broadcasts to the logits; keys it hides must hold finite values (zeros).
    Everything runs in the accumulation dtype; (out [..., H, r], lse [..., H]) come back in it."""
    acc = acc_dtype(q_nope_abs.dtype)
    operands, scores = spec.split("->")
    queries, keys = operands.split(",")
    c = c.to(acc)
    logits = torch.einsum(spec, q_nope_abs.to(acc), c)
    rope = f"{queries[:-1]}p,{keys[:-1]}p->{scores}"
    logits = logits + torch.einsum(rope, q_pe.to(acc), k_pe.to(acc))
    logits = (logits * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [..., H]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse[..., None])  # exp(-inf) = 0 for masked keys and empty rows
    out = torch.einsum(f"{scores},{keys}->{queries}", probs, c)
    return out, lse


def merge_partial_attention(outs: list[torch.Tensor], lses: list[torch.Tensor],
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact merge of attention over disjoint key sets: outs [N, H, r] each, lses [N, H] each (as
    ``absorbed_attention(..., partial=True)`` returns them) -> [N, H, r] in ``out_dtype`` (default:
    the parts' dtype)."""
    acc = acc_dtype(outs[0].dtype)
    lse = torch.stack([x.to(acc) for x in lses])  # [P, N, H]
    total = torch.logsumexp(lse, dim=0)  # [N, H]
    safe_total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.exp(lse - safe_total)  # [P, N, H]; zero for empty parts
    out = sum(w[..., None] * o.to(acc) for w, o in zip(weights, outs))
    return out.to(outs[0].dtype if out_dtype is None else out_dtype)


def indexer_scores(
    index_q: torch.Tensor,  # [..., N, Hi, D] roped
    index_w: torch.Tensor,  # [..., N, Hi] per-head weights carrying every scale
    index_k: torch.Tensor,  # [..., S, D] roped, normed
) -> torch.Tensor:
    """DSA lightning-indexer scores [..., N, S] float32: sum_h w[n,h] * relu(q[n,h] . k[s]).
    Leading dims batch requests (queries [B, Q, Hi, D] against keys [B, S, D])."""
    acc = acc_dtype(index_q.dtype)
    scores = torch.relu(torch.einsum("...nhd,...sd->...nhs", index_q.to(acc), index_k.to(acc)))
    return torch.einsum("...nh,...nhs->...ns", index_w.to(acc), scores).float()


TIE_BREAKS = ("position", "torch")


def indexer_select(scores: torch.Tensor, allowed: torch.Tensor, topk: int, tie_break: str = "position"
                   ) -> torch.Tensor:
    """Top-``topk`` allowed keys per query row: BoolTensor [N, S] (every allowed key if fewer).

    ``tie_break="position"`` (default): higher score first, and among equal scores the earlier
    position wins. Exact ties are common (a key whose every indexer head is cut by the ReLU scores
    exactly 0), and ``torch.topk`` breaks them differently for rows of different lengths, so an
    engine whose rows are as long as the cache and a trainer whose rows are as long as the padded
    batch would pick different keys. With this rule the choice depends only on the allowed keys'
    scores and positions: the same for every row length, padding, page split or layout.

    ``tie_break="torch"``: what transformers does (disallowed keys set to float32's lowest value,
    ``torch.topk`` over the whole row), bit-exact with transformers for a row of the same length;
    used by the parity tests. Both rules agree whenever the k-th and (k+1)-th allowed scores differ.
    """
    n, s = scores.shape
    k = min(topk, s)
    if tie_break == "position":
        if k == s:
            return allowed.clone()
        masked = scores.float().masked_fill(~allowed, float("-inf"))
        # the k-th largest score is the threshold: every key above it is chosen, and of the keys
        # equal to it the earliest positions fill the remaining places (a stable descending sort,
        # in O(N·S) instead of O(N·S·log S))
        threshold = masked.topk(k, dim=-1, sorted=False).values.min(dim=-1, keepdim=True).values  # [N, 1]
        above = masked > threshold
        at = masked == threshold
        places = k - above.sum(dim=-1, keepdim=True)
        return (above | (at & (torch.cumsum(at, dim=-1) <= places))) & allowed
    elif tie_break == "torch":
        idx = scores.float().masked_fill(~allowed, torch.finfo(torch.float32).min).topk(k, dim=-1).indices
    else:
        raise ValueError(f"tie_break: expected one of {TIE_BREAKS}, got {tie_break!r}")
    chosen = torch.zeros(n, s, dtype=torch.bool, device=scores.device).scatter_(1, idx, True)
    return chosen & allowed
